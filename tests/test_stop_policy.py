"""One stop policy for regenerate, tokenize and evaluate, on a target whose end-of-turn token is not its eos.

The target is laid out like Llama-3-Instruct as first shipped: its chat template ends every turn with
``<|eot_id|>`` (id 4), while the tokenizer's, config.json's and generation_config.json's eos is
``<|end_of_text|>`` (id 1). Its model is a tiny random llama whose LM-head rows of ``<|eot_id|>`` and a
token it generates are swapped, so that its greedy answer to "Hello! How are you today?" is two tokens,
then ``<|eot_id|>``, then more text (``ar<|eot_id|>!<|eot_id|>!...``): exactly what an eos-only stop
writes until ``max_new_tokens``.

Expected, and asserted with the real stage functions: the policy is ``[1, 4]``; regenerate stops at
``<|eot_id|>`` (counted as stopped, not cut); tokenize supervises each answer up to and including its first
``<|eot_id|>`` and nothing after; evaluate decodes to that same token (target-only and speculative), and
its report names the same stop ids.
"""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from draftsmith import tokenize as tk
from draftsmith.chat import render_prompt
from draftsmith.evaluate import (
    EvaluateSettings,
    PromptLookupProposer,
    run_evaluate,
    speculative_generate,
    target_generate,
)
from draftsmith.regenerate.run import run as run_regenerate
from draftsmith.regenerate.settings import RegenerateShardSettings
from draftsmith.regenerate.turns import Regenerator
from tiny import CURATED, tiny_llama3_tokenizer, tiny_target, tiny_tokenizer

EOS, EOT = 1, 4  # <|end_of_text|>, <|eot_id|>
QUESTION = "Hello! How are you today?"


def msg(role, content=""):
    return {"role": role, "content": content, "reasoning_content": None, "tool_calls": None, "tool_call_id": None,
            "name": None}


@pytest.fixture(scope="module")
def tok():
    return tiny_llama3_tokenizer()


@pytest.fixture(scope="module")
def model(tok):
    """Tiny llama (eos 1) whose greedy answer to QUESTION holds <|eot_id|> after two tokens, then goes on."""
    m = tiny_target("llama", seed=3, bos_token_id=0, eos_token_id=EOS, pad_token_id=EOS)
    m.generation_config.eos_token_id = EOS
    with torch.no_grad():
        m.lm_head.weight[[EOT, 282]] = m.lm_head.weight[[282, EOT]]  # it generates 282 third: now <|eot_id|>
    return m


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory, model, tok):
    out = tmp_path_factory.mktemp("llama3-like-target")
    model.save_pretrained(out)
    tok.save_pretrained(out)
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == EOS
    assert json.loads((out / "config.json").read_text())["eos_token_id"] == EOS
    return out


@pytest.fixture(scope="module")
def free_answer(model, tok):
    """The target's greedy continuation of QUESTION's serving prompt with no stop at all (16 tokens)."""
    prompt = render_prompt(tok, [msg("user", QUESTION)])
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False, eos_token_id=None,
                             pad_token_id=EOS)
    new = out[0, len(prompt):].tolist()
    first = new.index(EOT)
    assert first == 2 and EOS not in new and len(new) == 16 and EOT in new[first + 1:]  # text goes on after it
    return prompt, new


def test_policy_is_eos_plus_the_templates_end_of_turn(tok, target_dir):
    assert tok.eos_token_id == EOS and tok.convert_ids_to_tokens(EOT) == "<|eot_id|>"
    assert tk.end_of_turn_token_ids(tok) == [EOT]
    assert tk.stop_token_ids(tok, target_dir) == [EOS, EOT]
    assert tk.stop_token_ids(tok) == [EOS, EOT]  # the template alone already names <|eot_id|>
    # ChatML: the end-of-turn token is the eos (<|im_end|> = 2); <|endoftext|> (0, the pad) is no stop
    assert tk.end_of_turn_token_ids(tiny_tokenizer()) == [2] and tk.stop_token_ids(tiny_tokenizer()) == [2]
    # a template that writes nothing after the answer has no end-of-turn token: eos only
    bare = tiny_tokenizer(chat_template="{% for m in messages %}{{ m['content'] }}{% endfor %}"
                                        "{% if add_generation_prompt %}{{ '<|im_start|>' }}{% endif %}")
    assert tk.end_of_turn_token_ids(bare) == [] and tk.stop_token_ids(bare) == [2]


def test_regenerate_stops_at_end_of_turn_not_eos(model, tok, target_dir, free_answer, tmp_path):
    _, new = free_answer
    conv = {"id": "a", "source": "chat", "tools": None, "messages": [msg("user", QUESTION), msg("assistant", "x")]}
    settings = RegenerateShardSettings.from_config(regenerate={"max_new_tokens": 16, "batch_size": 1})
    regen = Regenerator(model, tok, settings)
    assert regen.stop_ids == [EOS, EOT]
    out, stats = regen.regenerate([json.loads(json.dumps(conv))])
    assert out[0]["messages"][1]["content"] == tok.decode(new[:2], skip_special_tokens=False)
    assert "<|eot_id|>" not in out[0]["messages"][1]["content"]
    assert stats["turns_regenerated"] == 1 and stats["tokens_generated"] == 2
    assert not any(k.startswith("cut.") for k in stats), dict(stats)  # stopped, not cut
    # control: an eos-only stop writes the "answer<|eot_id|>..." up to max_new_tokens, cut
    out, stats = Regenerator(model, tok, settings, [EOS]).regenerate([json.loads(json.dumps(conv))])
    assert out[0]["messages"][1]["content"] == tok.decode(new, skip_special_tokens=False)
    assert out[0]["messages"][1]["content"].count("<|eot_id|>") >= 2 and stats["cut.hit_max_new_tokens"] == 1
    # the stage reads the same policy from the target folder and records it
    src = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist([conv], schema=CURATED), src)
    report = run_regenerate(conversations=src, target_dir=target_dir, output=tmp_path / "out.parquet",
                            settings=settings, device="cpu")
    assert report["stop_token_ids"] == [EOS, EOT] and report["counts"]["tokens_generated"] == 2
    assert "cut.hit_max_new_tokens" not in report["counts"]


def test_tokenize_supervises_through_the_first_end_of_turn_only(tok, target_dir, free_answer, tmp_path):
    prompt, new = free_answer
    clean = tok.decode(new[:2], skip_special_tokens=False)
    runaway = tok.decode(new, skip_special_tokens=False)  # what an eos-only regenerate wrote
    rows = [{"id": rid, "source": "chat", "tools": None, "messages": [msg("user", QUESTION), msg("assistant", text)]}
            for rid, text in (("clean", clean), ("runaway", runaway))]
    pq.write_table(pa.Table.from_pylist(rows, schema=CURATED), tmp_path / "train.parquet")
    pq.write_table(pa.Table.from_pylist([], schema=CURATED), tmp_path / "eval.parquet")
    report = tk.run(train_in=tmp_path / "train.parquet", eval_in=tmp_path / "eval.parquet", target_dir=target_dir,
                    train_out=tmp_path / "tok_train.parquet", eval_out=tmp_path / "tok_eval.parquet",
                    report_out=tmp_path / "report.json",
                    settings=tk.TokenizeSettings.from_config(tokenize={"max_length": 256, "threads": 1}))
    assert report["stop_token_ids"] == [EOS, EOT] and report["end_of_turn_token_ids"] == [EOT]
    got = {r["id"]: r for r in pq.read_table(tmp_path / "tok_train.parquet").to_pylist()}
    answer = tok(clean, add_special_tokens=False)["input_ids"]
    for rid in ("clean", "runaway"):
        ids, mask = got[rid]["input_ids"], got[rid]["loss_mask"]
        assert ids[:len(prompt)] == prompt and ids[len(prompt):len(prompt) + len(answer) + 1] == answer + [EOT]
        # 1 exactly on the answer and its first <|eot_id|>; nothing after it (the target stops there)
        assert mask == [0] * len(prompt) + [1] * (len(answer) + 1) + [0] * (len(ids) - len(prompt) - len(answer) - 1)
    assert len(got["runaway"]["input_ids"]) > len(got["clean"]["input_ids"])
    assert report["splits"]["train"]["rows"]["answers_with_stop_in_text"] == 1  # counted, not silent


def test_evaluate_decodes_to_the_same_end_of_turn(model, tok, target_dir, free_answer, tmp_path):
    prompt, new = free_answer
    stops = tk.stop_token_ids(tok, target_dir)
    ref = target_generate(model, prompt, max_new_tokens=16, stop_token_ids=stops)
    assert ref.tokens == new[:3] and ref.tokens[-1] == EOT and ref.stopped
    spec = speculative_generate(model, PromptLookupProposer(3, 3), prompt, max_new_tokens=16, stop_token_ids=stops)
    assert spec.tokens == ref.tokens and spec.stopped
    # the stage: the held-out prompt is answered with the regenerated answer's tokens plus <|eot_id|>
    from draftsmith.drafter_config import build_drafter_config
    from draftsmith.modeling import DFlashDraftModel
    from draftsmith.tokenize import tokenized_metadata, tokenizer_fingerprint

    cfg = build_drafter_config(model.config, num_layers=1, block_size=4, target_layer_ids=[1, 2],
                               mask_token_id=model.config.vocab_size - 1)
    torch.manual_seed(0)
    DFlashDraftModel(cfg).eval().save_pretrained(tmp_path / "drafter")
    rows = [{"id": "h", "source": "chat", "tools": None, "messages": [msg("user", QUESTION), msg("assistant", "x")]}]
    pq.write_table(pa.Table.from_pylist(rows, schema=CURATED), tmp_path / "eval.parquet")
    schema = tk.TOKENIZED_SCHEMA.with_metadata(tokenized_metadata({}, tokenizer_fingerprint(tok), 256))
    pq.write_table(pa.Table.from_pylist([], schema=schema), tmp_path / "tok_eval.parquet")
    outputs = {k: str(tmp_path / f) for k, f in [("json", "report.json"), ("md", "report.md"), ("tau", "tau.png"),
                                                 ("positions", "pos.png"), ("histogram", "hist.png")]}
    sets = {"heldout": {"source": "heldout", "max_new_tokens": 16}}
    report = run_evaluate(target_dir=str(target_dir), drafter_dir=str(tmp_path / "drafter"),
                          curated_eval=str(tmp_path / "eval.parquet"),
                          tokenized_eval=str(tmp_path / "tok_eval.parquet"), outputs=outputs,
                          settings=EvaluateSettings.from_config(evaluate={"sets": sets}, target={"dtype": "float32"}),
                          sources=[{"name": "chat", "split": "both"}], device="cpu")
    assert report["run"]["stop_token_ids"] == [EOS, EOT]
    (row,) = report["sets"]["heldout"]["per_prompt"]
    assert row["prompt_tokens"] == len(prompt) and row["new_tokens"] == 3  # "ar" + <|eot_id|>
    assert report["sets"]["heldout"]["lossless"]["dflash"]["lossless"]
