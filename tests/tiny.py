"""Tiny random Hugging Face targets built in-process (no hub), shared by the tests.

Each builder returns a float32 model in eval mode with a fixed seed. The hybrid ones mix Gated
DeltaNet (``linear_attention``) and full-attention layers like Qwen3.5 / Qwen3-Next, so tests
cover the recurrent-state and padding behaviour that breaks other pipelines.
"""

from __future__ import annotations

import pyarrow as pa
import torch
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    Qwen3_5TextConfig,
    Qwen3Config,
    Qwen3NextConfig,
)

VOCAB = 512


def _common(**kw):
    base = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                rms_norm_eps=1e-6, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                tie_word_embeddings=False)
    base.update(kw)
    return base


def tiny_config(kind: str, **overrides):
    """Config of a tiny target: ``llama``, ``qwen3``, ``qwen3_5`` or ``qwen3_next``."""
    if kind == "llama":
        return LlamaConfig(**_common(**overrides))
    if kind == "qwen3":
        return Qwen3Config(**_common(head_dim=16, **overrides))
    hybrid = dict(head_dim=16, linear_conv_kernel_dim=4, linear_key_head_dim=16,
                  linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                  layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"])
    if kind == "qwen3_5":
        return Qwen3_5TextConfig(**_common(**hybrid, **overrides))
    if kind == "qwen3_next":
        return Qwen3NextConfig(**_common(**hybrid, num_experts=4, num_experts_per_tok=2,
                                         moe_intermediate_size=32, shared_expert_intermediate_size=32,
                                         decoder_sparse_step=1, **overrides))
    raise ValueError(f"unknown tiny target kind {kind!r}")


def tiny_target(kind: str, seed: int = 0, **overrides):
    """A tiny random target model (float32, eval mode, sdpa attention)."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(kind, **overrides), dtype=torch.float32,
                                             attn_implementation="sdpa")
    return model.eval()


def randomize_final_norm(model, std: float = 0.5, seed: int = 1):
    """Draw the final norm's weight of ``model`` from N(0, std), in place (Qwen3.5 / Qwen3-Next initialise their
    Gemma-style ``1 + w`` norms at w = 0). With a zero final norm the target's pre-norm and post-norm states are equal
    after the MTP head's ``pre_fc_norm_hidden`` (an RMSNorm absorbs the scale), so a test could not tell which one the
    head is fed; real checkpoints' final norms are far from zero."""
    from draftsmith.target import final_norm

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        weight = final_norm(model).weight
        weight.copy_(torch.randn(weight.shape, generator=g) * std)
    return model


def add_mtp_weights(folder, seed: int = 0, std: float = 0.1, *, num_layers: int = 1, sharded: bool = False,
                    fused_experts: bool = False, drop: str | None = None) -> dict[str, torch.Tensor]:
    """Add a random MTP head (``mtp.*`` tensors, as Qwen3.5 / 3.6 / Qwen3-Next checkpoints ship it) to a tiny
    target folder written by ``save_pretrained``, and ``mtp_num_hidden_layers`` to its config.json.

    The names and shapes are those of a real checkpoint (:func:`draftsmith.evaluate.mtp.checkpoint_shapes`:
    ``mtp.fc.weight [H, 2H]``, the two pre-fc norms, ``mtp.layers.<i>.*`` of the target's own full-attention layer
    class, e.g. Qwen3.5's gated ``q_proj`` of ``2 x heads x head_dim`` rows, ``mtp.norm.weight``; MoE experts per
    expert unless ``fused_experts``), drawn from N(0, std). ``sharded``: written to their own shard
    ``model-mtp.safetensors`` with a ``model.safetensors.index.json`` naming every tensor's file (how a sharded
    checkpoint stores them); else into ``model.safetensors`` beside the model's own. ``drop``: leave that tensor out
    (a malformed set). Returns the tensors written (by name)."""
    import json
    from pathlib import Path

    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig

    from draftsmith.evaluate.mtp import MTPHead, checkpoint_shapes

    folder = Path(folder)
    config = AutoConfig.from_pretrained(folder)
    with torch.device("meta"):
        head = MTPHead(AutoModelForCausalLM.from_config(config), num_layers)
    g = torch.Generator().manual_seed(seed)
    tensors = {name: (torch.randn(shape, generator=g) * std).contiguous()
               for name, shape in checkpoint_shapes(head, fused_experts=fused_experts).items() if name != drop}
    if sharded:
        main = folder / "model.safetensors"
        own = load_file(str(main))
        main.rename(folder / "model-main.safetensors")
        save_file(tensors, str(folder / "model-mtp.safetensors"), metadata={"format": "pt"})
        weight_map = {**{k: "model-main.safetensors" for k in own}, **{k: "model-mtp.safetensors" for k in tensors}}
        (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    else:
        own = load_file(str(folder / "model.safetensors"))
        save_file({**own, **tensors}, str(folder / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((folder / "config.json").read_text())
    cfg["mtp_num_hidden_layers"] = num_layers
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    return tensors


# --- tiny chat tokenizer (tokenize / regenerate) ---------------------------------------------------

TINY_CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
_TINY_CORPUS = (
    "The quick brown fox jumps over the lazy dog. Hello! How are you today? I am fine, thank you. "
    "Write a function that adds two numbers. def add(a, b): return a + b. The answer is 42. "
    "Please explain speculative decoding: a small drafter proposes tokens and the target verifies them. "
)



def _byte_level_bpe(vocab_size: int, specials: list[str]):
    """A byte-level BPE ``tokenizers.Tokenizer`` trained on the tiny corpus, ``specials`` taking ids 0, 1, ..."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator([_TINY_CORPUS] * 4, trainer)
    return backend

def tiny_tokenizer(vocab_size: int = VOCAB, chat_template: str = TINY_CHATML_TEMPLATE):
    """A byte-level BPE fast tokenizer trained in-process (deterministic), with a ChatML chat template.

    Special tokens match the tiny targets' config: ``<|endoftext|>`` = 0 (pad), ``<|im_start|>`` = 1,
    ``<|im_end|>`` = 2 (eos, end of turn). ``vocab_size`` <= the tiny targets' VOCAB.
    """
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    backend = _byte_level_bpe(vocab_size, specials)
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tok.chat_template = chat_template
    assert tok.convert_tokens_to_ids(specials) == [0, 1, 2]
    return tok


# Llama-3-Instruct's own chat template (meta-llama/Meta-Llama-3-8B-Instruct, tokenizer_config.json): turns end
# with <|eot_id|>, while the tokenizer's eos is <|end_of_text|>.
LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
    "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]


def tiny_llama3_tokenizer(vocab_size: int = VOCAB):
    """A tiny byte-level BPE tokenizer laid out like Llama-3-Instruct's: ``<|begin_of_text|>`` = 0 (bos),
    ``<|end_of_text|>`` = 1 (eos, also pad), ``<|start_header_id|>`` = 2, ``<|end_header_id|>`` = 3,
    ``<|eot_id|>`` = 4 (end of turn, **not** eos), with Llama 3's chat template."""
    from transformers import PreTrainedTokenizerFast

    backend = _byte_level_bpe(vocab_size, LLAMA3_SPECIALS)
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<|begin_of_text|>",
                                  eos_token="<|end_of_text|>", pad_token="<|end_of_text|>",
                                  additional_special_tokens=LLAMA3_SPECIALS[2:])
    tok.chat_template = LLAMA3_TEMPLATE
    assert tok.convert_tokens_to_ids(LLAMA3_SPECIALS) == [0, 1, 2, 3, 4]
    return tok


# The curated-parquet contract of docs/design.md, written out independently of draftsmith.curate so tests
# that build curated input (tokenize, regenerate, evaluate) check the stages against the contract.
TOOL_CALL = pa.struct([("id", pa.string()), ("type", pa.string()),
                       ("function", pa.struct([("name", pa.string()), ("arguments", pa.string())]))])
MESSAGE = pa.struct([("role", pa.string()), ("content", pa.string()), ("reasoning_content", pa.string()),
                     ("tool_calls", pa.list_(TOOL_CALL)), ("tool_call_id", pa.string()), ("name", pa.string())])
CURATED = pa.schema([("id", pa.string()), ("source", pa.string()), ("messages", pa.list_(MESSAGE)),
                     ("tools", pa.string())])
# The regenerated-parquet contract (draftsmith.regenerated), written out the same way: the curated columns, each
# message with the ids the target generated for it (null on the messages it did not generate).
REGENERATED = pa.schema([("id", pa.string()), ("source", pa.string()),
                         ("messages", pa.list_(pa.struct(list(MESSAGE) + [("generated_ids", pa.list_(pa.int32()))]))),
                         ("tools", pa.string())])


def progress_lines(records, desc: str, t0: float) -> list[tuple[float, str]]:
    """The progress lines (:mod:`draftsmith.progress`) of the bar named ``desc`` among log ``records``:
    ``(seconds since t0, line)`` in order."""
    return [(r.created - t0, r.getMessage()) for r in records if r.getMessage().startswith(f"{desc}: ")]


def assert_steady(lines: list[tuple[float, str]], interval: float, end: float) -> None:
    """A progress line at least every ``interval`` seconds (with slack for a loaded CI machine) from the start
    (0) to ``end`` seconds."""
    times = [0.0] + [t for t, _ in lines] + [end]
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert max(gaps) <= 1.75 * interval, (gaps, [line for _, line in lines])
