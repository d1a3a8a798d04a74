"""Tests of the evaluate stage: lossless speculative decoding (greedy token for token, sampling in
distribution), exact rollback of Gated DeltaNet state, τ equal to the official z-lab ``dflash``
package's, metrics, benchmark sets, and the stage end to end on a tiny target folder.

Targets are the tiny random models of tests/tiny.py (Llama, Qwen3, and the hybrid GDN Qwen3.5 and
Qwen3-Next). Drafters are draftsmith's ``DFlashDraftModel`` (random, briefly trained with the real
training loss, or an oracle subclass that drafts the target's own tokens with chosen slots corrupted,
giving fully accepted, partially accepted and fully rejected blocks by construction) and the official
``dflash.model.DFlashDraftModel`` (pinned wheel dflash==0.1.0, unpacked by the conftest fixture; the
tests that need it skip when it cannot be fetched).
"""

from __future__ import annotations

import itertools
import json
import sys
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from draftsmith.drafter_config import build_drafter_config
from draftsmith.evaluate import (
    DFlashProposer,
    EvaluateSettings,
    GenerationResult,
    PromptLookupProposer,
    SamplingConfig,
    TargetCache,
    load_sets,
    rejection_sample,
    run_evaluate,
    sampling_probs,
    speculative_generate,
    split_conversation,
    summarize,
    target_generate,
)
from draftsmith.evaluate.cache import _rewind_linear
from draftsmith.evaluate.report import lossless_check, step_slots
from draftsmith.hybrid_cache import is_recurrent
from draftsmith.modeling import DFlashDraftModel
from draftsmith.target import capture_layers, fla_available
from tiny import CURATED, TINY_CHATML_TEMPLATE, VOCAB, assert_steady, progress_lines, tiny_target, tiny_tokenizer

BLOCK = 8
MASK = VOCAB - 1
STOP = [2]  # the tiny targets' eos
# chi-square critical values at alpha = 1e-3 (NIST/SEMATECH e-Handbook, table 1.3.6.7.4)
CHI2_CRIT_001 = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515, 6: 22.458, 7: 24.322}


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny models run fastest on one thread; several threads on a shared 2-core box thrash."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


_TARGETS: dict = {}


def target(kind: str):
    """Tiny random target of that kind (cached per session; read only). Weights drawn with std 0.1: with
    HF's default 0.02 a tiny hybrid target barely depends on its recurrent state (its greedy output
    loops over a few tokens), so a wrong rollback would go unnoticed."""
    if kind not in _TARGETS:
        if kind == "qwen3_sliding":  # sliding-window attention layers (window 6 < prompt): cropped, not rewound
            _TARGETS[kind] = tiny_target("qwen3", initializer_range=0.1, sliding_window=6, use_sliding_window=True,
                                         layer_types=["sliding_attention", "full_attention"] * 2)
        else:
            _TARGETS[kind] = tiny_target(kind, initializer_range=0.1)
    return _TARGETS[kind]


def make_drafter(tgt, *, seed: int = 0, block_size: int = BLOCK, layer_ids=(1, 2), cls=DFlashDraftModel):
    cfg = build_drafter_config(tgt.config, num_layers=1, block_size=block_size, target_layer_ids=list(layer_ids),
                               mask_token_id=tgt.config.vocab_size - 1)
    torch.manual_seed(seed)
    return cls(cfg).eval()


def prompt(seed: int, length: int = 12):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB - 1, (1, length), generator=g)


def oracle_drafter(base_cls, reference: torch.Tensor, corrupt=None):
    """A DFlash drafter (real forward, real K/V cache) whose logits are replaced by the reference tokens
    at the drafted positions; ``corrupt(call, slot)`` makes that draft wrong. Works with draftsmith's and
    the official class, so both decoding loops see identical drafts."""

    class Oracle(base_cls):
        def forward(self, position_ids, *args, **kwargs):
            out = super().forward(position_ids, *args, **kwargs)
            self._block_positions = position_ids[0, -out.shape[1]:]
            return out

        def compute_logits(self, hidden, output_head):
            logits = super().compute_logits(hidden, output_head)
            positions = self._block_positions[-logits.shape[1]:]
            ref = reference[positions.clamp(max=reference.shape[0] - 1)].clone()
            for slot in range(ref.shape[0]):
                if corrupt is not None and corrupt(self.calls, slot):
                    ref[slot] = (ref[slot] + 1) % (MASK - 3) + 3
            self.calls += 1
            forced = torch.full_like(logits, -1e4)
            forced[0, torch.arange(ref.shape[0]), ref] = 1e4
            return forced

    return Oracle


def build_oracle(base_cls, tgt, reference, corrupt=None, seed=0):
    drafter = make_drafter(tgt, seed=seed, cls=oracle_drafter(base_cls, reference, corrupt))
    drafter.calls = 0
    return drafter


@pytest.fixture(scope="module")
def official(unpacked_wheel):
    """The official z-lab ``dflash.model`` module (dflash==0.1.0): installed, else the pinned wheel
    unpacked by the conftest fixture (skips when it cannot be fetched)."""
    try:
        import dflash.model as dm

        return dm
    except ImportError:
        pass
    folder = unpacked_wheel("dflash==0.1.0")
    sys.path.insert(0, str(folder))
    try:
        import dflash.model as dm
    finally:
        sys.path.remove(str(folder))
    return dm


@pytest.fixture
def official_cpu(official, monkeypatch):
    """The official module with its timer made CPU-safe (``return_stats`` calls torch.cuda.synchronize)."""
    monkeypatch.setattr(official, "_cuda_time", time.perf_counter)  # it calls torch.cuda.synchronize
    return official


# ------------------------------------------------------------------------------------------------
# Greedy losslessness
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["llama", "qwen3_sliding", "qwen3_5", "qwen3_next"])
def test_greedy_speculative_equals_target_only(kind):
    """Token-for-token equality with target-only greedy decoding (itself equal to HF generate) for a
    random drafter, fully accepted, partially accepted and fully rejected blocks, and prompt lookup;
    for hybrid targets with both rollback modes (re-run the recurrent mixers / the whole target), and
    for a target with sliding-window layers whose window is shorter than the prompt."""
    tgt = target(kind)
    new = 24 if kind == "qwen3_next" else 40
    ids = prompt(1)
    ref = target_generate(tgt, ids, max_new_tokens=new)
    hf = tgt.generate(ids, max_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert ref.tokens == hf[0, ids.shape[1]:].tolist()
    reference = torch.cat([ids[0], torch.tensor(ref.tokens)])
    modes = ["mixer", "forward"] if kind in ("qwen3_5", "qwen3_next") else ["auto"]
    for mode in modes:
        cases = {
            "random drafter": DFlashProposer(make_drafter(tgt, seed=3), tgt),
            "full acceptance": DFlashProposer(build_oracle(DFlashDraftModel, tgt, reference), tgt),
            "partial": DFlashProposer(build_oracle(DFlashDraftModel, tgt, reference,
                                                   lambda c, s: (c + s) % 4 == 3), tgt),
            "full rejection": DFlashProposer(build_oracle(DFlashDraftModel, tgt, reference, lambda c, s: True), tgt),
            "prompt lookup": PromptLookupProposer(3, BLOCK - 1),
        }
        for name, proposer in cases.items():
            out = speculative_generate(tgt, proposer, ids, max_new_tokens=new, rollback=mode)
            assert out.tokens == ref.tokens, f"{kind} {mode} {name}: speculative output differs"
            assert sum(out.committed) + 1 == len(out.tokens)
            if name == "full acceptance":
                assert out.committed[:-1] == [BLOCK] * (len(out.committed) - 1)
            if name == "full rejection":
                assert set(out.committed) == {1} and set(out.accepted) == {0}
            if name == "partial":
                assert any(1 < c < BLOCK for c in out.committed) and 1 in out.committed


@pytest.mark.skipif(not torch.cuda.is_available() or not fla_available(),
                    reason="needs a CUDA GPU and flash-linear-attention (the Gated DeltaNet kernels)")
@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_next"])
def test_greedy_speculative_equals_target_only_on_the_gpu_kernels(kind):
    """The same equality on a GPU in float32, where Gated DeltaNet runs flash-linear-attention's Triton kernels:
    a verify forward runs the chunked kernel over the block, target-only decoding the one-token recurrent one, and
    the rollback re-runs the accepted tokens. A prompt of 150 tokens spans several of the kernel's 64-token chunks.
    (On a random Qwen3.5-27B-shape target in bf16 the two decodes differed from the second token on:
    docs/rehearsal-x2/README.md. Near-tied logits flip with bf16 rounding; this test tells rounding from a wrong
    rollback: in float32 a tiny target with std-0.1 weights has no near ties.)"""
    _assert_greedy_equality_on(torch.device("cuda"), kind)


def _assert_greedy_equality_on(device: torch.device, kind: str) -> None:
    tgt = tiny_target(kind, initializer_range=0.1).to(device).eval()
    if kind == "qwen3_next" and device.type == "cuda":
        # MoE experts: transformers' default grouped_mm copies to the host for float32 (in bf16, the dtype targets
        # run in, it captures), and the eager loop syncs on nonzero(): batched_mm is the float32 kernel a CUDA
        # graph can capture (measured on an H200, torch 2.11: docs/rehearsal-x2/README.md)
        tgt.set_experts_implementation("batched_mm")
    new = 40
    ids = prompt(1, length=150).to(device)
    ref = target_generate(tgt, ids, max_new_tokens=new)
    reference = torch.cat([ids[0], torch.tensor(ref.tokens, device=device)])
    for mode in ("mixer", "forward"):
        cases = {
            "random drafter": DFlashProposer(make_drafter(tgt, seed=3).to(device), tgt),
            "partial": DFlashProposer(build_oracle(DFlashDraftModel, tgt, reference,
                                                   lambda c, s: (c + s) % 4 == 3).to(device), tgt),
            "full rejection": DFlashProposer(build_oracle(DFlashDraftModel, tgt, reference,
                                                          lambda c, s: True).to(device), tgt),
            "prompt lookup": PromptLookupProposer(3, BLOCK - 1),
        }
        for name, proposer in cases.items():
            out = speculative_generate(tgt, proposer, ids, max_new_tokens=new, rollback=mode)
            assert out.tokens == ref.tokens, f"{kind} {mode} {name} on {device}: speculative output differs"
    # the static path: verify forwards and rollbacks replayed as CUDA graphs on a GPU
    from draftsmith.evaluate.static import StaticTarget

    static = StaticTarget(tgt, ids.shape[1] + new + BLOCK + 1, layer_ids=[1, 2],
                          cuda_graphs=device.type == "cuda", verify_width=BLOCK)
    assert target_generate(tgt, ids, max_new_tokens=new, static=static).tokens == ref.tokens
    assert target_generate(tgt, ids, max_new_tokens=new, static=static, width=None).tokens == ref.tokens
    for name, make in {
        "random drafter": lambda: DFlashProposer(make_drafter(tgt, seed=3).to(device), tgt),
        "partial": lambda: DFlashProposer(build_oracle(DFlashDraftModel, tgt, reference,
                                                       lambda c, s: (c + s) % 4 == 3).to(device), tgt),
        "prompt lookup": lambda: PromptLookupProposer(3, BLOCK - 1),
    }.items():
        out = speculative_generate(tgt, make(), ids, max_new_tokens=new, static=static)
        assert out.tokens == ref.tokens, f"{kind} static {name} on {device}: speculative output differs"
    assert static.graph_failures == {}
    if device.type == "cuda":
        assert static._graphs and static._replays  # forwards and rollbacks ran as graphs


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_grouped_sdpa_equals_transformers_sdpa_with_a_padding_mask(kind):
    """draftsmith's grouped-query attention (query heads folded onto their K/V head, no repeated K/V) gives the
    very logits of transformers' sdpa on left-padded rows with a 4D mask on a static cache (float32: exact)."""
    from transformers import StaticCache

    from draftsmith.target import GROUPED_SDPA, use_grouped_sdpa

    tgt = tiny_target(kind, initializer_range=0.1)
    assert tgt.config.num_attention_heads == 2 * tgt.config.num_key_value_heads
    pad, L = torch.tensor([0, 2, 5]), 32
    ids = prompt(3, 20).expand(3, 20).clone()
    q = torch.arange(20)
    visible = (torch.arange(L)[None, None, None] <= q[None, None, :, None]) & (
        torch.arange(L)[None, None, None] >= pad[:, None, None, None])
    mask = torch.zeros(3, 1, 20, L).masked_fill(~visible, torch.finfo(torch.float32).min)
    positions = (q[None] - pad[:, None]).clamp_min(0)

    def logits():
        return tgt(input_ids=ids, position_ids=positions, attention_mask=mask, use_cache=True,
                   past_key_values=StaticCache(config=tgt.config, max_cache_len=L)).logits

    before = logits()
    assert use_grouped_sdpa(tgt) and tgt.config._attn_implementation == GROUPED_SDPA
    assert torch.equal(logits(), before)


@pytest.mark.parametrize("kind", ["llama", "qwen3", "qwen3_5", "qwen3_next"])
def test_static_cache_decoding_equals_the_dynamic_cache(kind):
    """The static-cache path (one fixed verify width, padded blocks, rollback = the cache length counter and, for
    the Gated DeltaNet layers of hybrid targets, the state snapshot put back and the kept tokens re-run through
    the mixers; on a GPU its forwards and rollbacks are CUDA graphs) gives the same tokens, acceptance lengths
    and DFlash drafts (so the same features) as the dynamic cache, for target-only decoding (one-token forwards
    and forwards padded to the verify width), DFlash (random, partially and fully accepted drafts) and prompt
    lookup, with one StaticTarget reused across prompts; sliding-window targets are refused."""
    from draftsmith.evaluate.static import StaticTarget, static_decoding_supported

    tgt = tiny_target("qwen3", initializer_range=0.1) if kind == "qwen3" else target(kind)
    new = 24 if kind == "qwen3_next" else 40
    static = StaticTarget(tgt, 12 + new + BLOCK + 1, layer_ids=[1, 2], cuda_graphs=False, verify_width=BLOCK)
    assert bool(static.recurrent) == (kind in ("qwen3_5", "qwen3_next"))
    for seed in (1, 2):
        ids = prompt(seed)
        ref = target_generate(tgt, ids, max_new_tokens=new)
        assert target_generate(tgt, ids, max_new_tokens=new, static=static).tokens == ref.tokens
        assert target_generate(tgt, ids, max_new_tokens=new, static=static, width=None).tokens == ref.tokens
        reference = torch.cat([ids[0], torch.tensor(ref.tokens)])
        for name, make in {
            "random drafter": lambda: DFlashProposer(make_drafter(tgt, seed=3), tgt),
            "partial": lambda: DFlashProposer(build_oracle(DFlashDraftModel, tgt, reference,
                                                           lambda c, s: (c + s) % 4 == 3), tgt),
            "full acceptance": lambda: DFlashProposer(build_oracle(DFlashDraftModel, tgt, reference), tgt),
            "prompt lookup": lambda: PromptLookupProposer(3, BLOCK - 1),
        }.items():
            dyn = speculative_generate(tgt, make(), ids, max_new_tokens=new)
            sta = speculative_generate(tgt, make(), ids, max_new_tokens=new, static=static)
            assert sta.tokens == dyn.tokens == ref.tokens, f"{kind} {name}"
            assert (sta.committed, sta.accepted, sta.proposed) == (dyn.committed, dyn.accepted, dyn.proposed), name
    assert static_decoding_supported(target("qwen3_5")) == (True, "")
    assert not static_decoding_supported(target("qwen3_sliding"))[0]
    with pytest.raises(ValueError, match="static-cache decoding does not support"):
        StaticTarget(target("qwen3_sliding"), 64)


def test_static_hybrid_rollback_is_what_keeps_the_output():
    """Control for the hybrid static path: with the snapshot / replay rollback switched off (commit a no-op, as
    for attention-only targets) the recurrent state keeps rejected drafts and padding, and the output changes."""
    from draftsmith.evaluate.static import StaticTarget

    tgt = target("qwen3_5")
    ids = prompt(1)
    ref = target_generate(tgt, ids, max_new_tokens=24)
    static = StaticTarget(tgt, 12 + 24 + BLOCK + 1, layer_ids=[1, 2], cuda_graphs=False, verify_width=BLOCK)
    static.commit = lambda keep: setattr(static, "_width", None)
    out = speculative_generate(tgt, DFlashProposer(make_drafter(tgt, seed=3), tgt), ids, max_new_tokens=24,
                               static=static)
    assert out.tokens != ref.tokens


@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_next"])
def test_naive_crop_breaks_hybrid_targets(monkeypatch, kind):
    """Control: rolling a hybrid target back with ``crop()`` alone (what HF and the official HF backend
    do) changes the output, so the equality above depends on restoring the GDN state."""
    tgt = target(kind)
    ids = prompt(1)
    ref = target_generate(tgt, ids, max_new_tokens=24)
    reference = torch.cat([ids[0], torch.tensor(ref.tokens)])
    proposer = DFlashProposer(build_oracle(DFlashDraftModel, tgt, reference, lambda c, s: (c + s) % 4 == 3), tgt)

    def crop_only(self, consumed, keep, block_ids, block_positions):
        remove = consumed - keep
        for layer in self.cache.layers:  # conv windows rewound, recurrent state left as is
            if is_recurrent(layer):
                _rewind_linear(layer, remove, {s: layer.recurrent_states[s]
                                               for s, ok in layer.is_recurrent_states_initialized.items() if ok})
            else:
                layer.crop(-remove)
        self.length += keep
        self.trim()

    monkeypatch.setattr(TargetCache, "rollback", crop_only)
    out = speculative_generate(tgt, proposer, ids, max_new_tokens=24)
    assert out.tokens != ref.tokens


def test_rollback_restores_recurrent_state_exactly():
    """After verifying a block and keeping k tokens, every cache tensor equals that of a target that
    consumed exactly those tokens (GDN recurrent + conv state, attention K/V), for both modes."""
    tgt = target("qwen3_5")
    ids = prompt(2, 10)
    block = prompt(3, BLOCK)
    keep = 3
    with torch.inference_mode():
        expected = TargetCache(tgt)
        tgt(input_ids=torch.cat([ids, block[:, :keep]], 1), past_key_values=expected.cache, use_cache=True)
        expected.advance(ids.shape[1] + keep)
        for mode in ("mixer", "forward"):
            tc = TargetCache(tgt, rollback=mode)
            assert tc.mode == mode
            tgt(input_ids=ids, past_key_values=tc.cache, use_cache=True)
            tc.advance(ids.shape[1])
            tc.checkpoint()
            pos = torch.arange(ids.shape[1], ids.shape[1] + BLOCK)[None]
            tgt(input_ids=block, position_ids=pos, past_key_values=tc.cache, use_cache=True)
            tc.rollback(BLOCK, keep, block, pos)
            assert tc.length == ids.shape[1] + keep == tc.cache.get_seq_length()
            for i in tc.recurrent:
                got, want = tc.cache.layers[i], expected.cache.layers[i]
                torch.testing.assert_close(got.recurrent_states[0], want.recurrent_states[0], atol=1e-5, rtol=1e-4)
                torch.testing.assert_close(got.conv_states[0], want.conv_states[0], atol=1e-5, rtol=1e-4)
            attn = [i for i in range(len(tc.cache.layers)) if i not in tc.recurrent]
            for i in attn:
                torch.testing.assert_close(tc.cache.layers[i].keys, expected.cache.layers[i].keys, atol=1e-5, rtol=1e-4)
            tc.close()


def test_stop_tokens_and_budget():
    """Generation ends at the first stop token (kept) or after max_new_tokens, for every method."""
    tgt = target("llama")
    ids = prompt(4)
    free = target_generate(tgt, ids, max_new_tokens=30)
    stop = free.tokens[9]
    first = free.tokens.index(stop)
    ref = target_generate(tgt, ids, max_new_tokens=30, stop_token_ids=[stop])
    assert ref.tokens == free.tokens[:first + 1] and ref.stopped
    reference = torch.cat([ids[0], torch.tensor(free.tokens)])
    for proposer in (DFlashProposer(build_oracle(DFlashDraftModel, tgt, reference), tgt),
                     PromptLookupProposer(3, BLOCK - 1)):
        out = speculative_generate(tgt, proposer, ids, max_new_tokens=30, stop_token_ids=[stop])
        assert out.tokens == ref.tokens and out.stopped
        short = speculative_generate(tgt, proposer, ids, max_new_tokens=first)
        assert short.tokens == free.tokens[:first] and not short.stopped


def test_per_position_counts_no_draft_after_a_stop_or_the_budget():
    """The issue's step: the stop token is draft 2 of 7, all 7 accepted by the target; the step emits 2 tokens
    (τ = 2). Only draft 1 counts as accepted (draft 2, the stop, is the step's last token, where the bonus
    would be; drafts 3-7 were never emitted), so 1 + Σ per-position = 2 = τ, not 8."""
    assert step_slots(7, 7, 2) == (1, 1)
    assert step_slots(3, 3, 3) == (2, 2)  # the budget allowed 3 tokens: all 3 drafts accepted, the third is last
    assert step_slots(7, 3, 4) == (7, 3)  # uncut: draft 4 rejected, slots 5-7 reached nothing but count as misses
    assert step_slots(7, 7, 8) == (7, 7)
    with pytest.raises(ValueError, match="inconsistent"):
        step_slots(3, 2, 4)
    stop_step = GenerationResult(tokens=[5, 6, 7], num_prompt_tokens=4, seconds=1.0, prefill_seconds=0.1,
                                 committed=[2], accepted=[7], proposed=[7], stopped=True)
    m = summarize([stop_step], max_block=8)
    assert m["tau"] == 2.0 and m["acceptance_histogram"] == [0, 1, 0, 0, 0, 0, 0, 0]
    assert m["per_position"] == [1.0, None, None, None, None, None, None]
    assert m["per_position_conditional"] == [1.0, None, None, None, None, None, None]
    assert m["per_position_hits"] == [1, 0, 0, 0, 0, 0, 0] and m["per_position_steps"] == [1, 0, 0, 0, 0, 0, 0]
    assert 1 + sum(r or 0.0 for r in m["per_position"]) == m["tau"]
    # with an uncut step beside it: slot 1 accepted in both, slot 2 only counted (and accepted) in the uncut one
    full = GenerationResult(tokens=list(range(5)), num_prompt_tokens=4, seconds=1.0, prefill_seconds=0.1,
                            committed=[4], accepted=[3], proposed=[7])
    m = summarize([stop_step, full], max_block=8)
    assert m["per_position"] == [1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    assert m["per_position_hits"] == [2, 1, 1, 0, 0, 0, 0] and m["per_position_steps"] == [2, 1, 1, 1, 1, 1, 1]
    assert m["tau"] == 3.0 == 1 + sum(m["per_position_hits"]) / m["steps"]


def test_per_position_sums_equal_tau_on_every_decoded_step():
    """Real decoding with a drafter that drafts the target's own tokens (every draft accepted) and one that
    corrupts some slots: a stop token inside a block and a token budget ending inside a block cut steps
    short; on every step of every run 1 + the accepted draft slots that count = tokens committed, and over a
    run τ = 1 + Σ_k hits_k / steps."""
    tgt = target("llama")
    ids = prompt(1)
    free = target_generate(tgt, ids, max_new_tokens=40)
    reference = torch.cat([ids[0], torch.tensor(free.tokens)])
    # full acceptance commits tokens 1..8 in step 1, 9..16 in step 2: a stop at index 10 is draft 2 of step 2
    at = 10
    assert free.tokens[at] not in free.tokens[:at]
    stop = free.tokens[at]
    runs = {}
    for name, corrupt in (("full", None), ("partial", lambda c, s: (c + s) % 4 == 3)):
        oracle = lambda: DFlashProposer(build_oracle(DFlashDraftModel, tgt, reference, corrupt), tgt)  # noqa: E731
        runs[f"{name} stop"] = speculative_generate(tgt, oracle(), ids, max_new_tokens=40, stop_token_ids=[stop])
        runs[f"{name} budget"] = speculative_generate(tgt, oracle(), ids, max_new_tokens=13)
        runs[f"{name} lookup"] = speculative_generate(tgt, PromptLookupProposer(3, BLOCK - 1), ids,
                                                      max_new_tokens=13, stop_token_ids=[stop])
    stop_run, budget_run = runs["full stop"], runs["full budget"]
    assert stop_run.tokens == free.tokens[:at + 1] and stop_run.stopped
    # the step holding the stop: 7 drafts, all accepted by the target, 2 tokens emitted (draft 1 and the stop)
    assert (stop_run.proposed[-1], stop_run.accepted[-1], stop_run.committed[-1]) == (7, 7, 2)
    assert summarize([stop_run])["per_position_steps"][1] == len(stop_run.committed) - 1  # slot 2 of the last: no
    assert budget_run.committed == [8, 4] and budget_run.accepted == [7, 4] and budget_run.proposed == [7, 4]
    for name, run in runs.items():
        for p, a, c in zip(run.proposed, run.accepted, run.committed):
            counted, accepted = step_slots(p, a, c)
            assert 1 + accepted == c and accepted <= counted <= p, (name, p, a, c)
        m = summarize([run], max_block=BLOCK)
        assert m["tau"] == pytest.approx(1 + sum(m["per_position_hits"]) / m["steps"]), name
        assert sum(m["acceptance_histogram"]) == m["steps"] and sum(run.committed) + 1 == len(run.tokens), name


# ------------------------------------------------------------------------------------------------
# The official z-lab implementation
# ------------------------------------------------------------------------------------------------

def test_tau_equals_official_dflash(official_cpu):
    """Per-step acceptance lengths, output tokens and τ equal the official ``dflash_generate(...,
    return_stats=True)`` on the same tiny Qwen3 target, drafter and prompts: a random drafter, an oracle
    with a varied corruption pattern, and draftsmith's DFlashDraftModel loaded with the official weights."""
    dm = official_cpu
    tgt = target("qwen3")
    prompts = [prompt(s, 10 + 3 * s) for s in range(3)]
    figures = {"official": [], "draftsmith": []}
    random_official = make_drafter(tgt, seed=5, cls=dm.DFlashDraftModel)
    ours_same_weights = make_drafter(tgt, seed=99)
    missing, unexpected = ours_same_weights.load_state_dict(random_official.state_dict(), strict=False)
    assert not missing and all("rotary" in k for k in unexpected)
    varied = lambda c, s: (3 * c + s) % 5 == 4  # noqa: E731
    for ids in prompts:
        ref = target_generate(tgt, ids, max_new_tokens=40, stop_token_ids=STOP)
        reference = torch.cat([ids[0], torch.tensor(ref.tokens)])
        for drafter_pair in (
            (random_official, random_official),
            (random_official, ours_same_weights),
            (build_oracle(dm.DFlashDraftModel, tgt, reference, varied),
             build_oracle(DFlashDraftModel, tgt, reference, varied)),
        ):
            theirs = dm.dflash_generate(drafter_pair[0], tgt, ids, 40, STOP, return_stats=True)
            ours = speculative_generate(tgt, DFlashProposer(drafter_pair[1], tgt), ids, max_new_tokens=40,
                                        stop_token_ids=STOP)
            assert ours.committed == theirs.acceptance_lengths
            assert ours.tokens == theirs.output_ids[0, ids.shape[1]:].tolist() == ref.tokens
            figures["official"].append(theirs.acceptance_lengths)
            figures["draftsmith"].append(ours)
    # the aggregate τ of the official benchmark (mean over prompts of per-prompt means) and ours
    official_tau = sum(sum(a) / len(a) for a in figures["official"]) / len(figures["official"])
    assert summarize(figures["draftsmith"])["tau_per_prompt"] == pytest.approx(official_tau, abs=1e-12)
    lengths = [c for r in figures["draftsmith"] for c in r.committed]
    assert len(set(lengths)) >= 3  # the comparison covered rejections, partial and full blocks


def test_official_dflash_loop_is_not_lossless_on_hybrid(official_cpu):
    """Documents why draftsmith owns the loop: the official HF backend's crop()-only rollback gives a
    different output from target-only greedy decoding on a tiny Qwen3.5 target; ours does not. With transformers
    5.25 the official loop does not run on Qwen3.5 at all: it calls ``activate_past_recording()``, whose new
    ``recurrent_states_to_keep`` defaults to None, and the Gated DeltaNet forward compares that with an int."""
    dm = official_cpu
    tgt = target("qwen3_5")
    ids = prompt(1)
    ref = target_generate(tgt, ids, max_new_tokens=24)
    reference = torch.cat([ids[0], torch.tensor(ref.tokens)])
    corrupt = lambda c, s: (c + s) % 4 == 3  # noqa: E731
    try:
        theirs = dm.dflash_generate(build_oracle(dm.DFlashDraftModel, tgt, reference, corrupt), tgt, ids, 24, None)
        official = theirs[0, ids.shape[1]:].tolist()
    except TypeError as err:  # transformers >= 5.25
        assert "NoneType" in str(err)
        official = None
    ours = speculative_generate(tgt, DFlashProposer(build_oracle(DFlashDraftModel, tgt, reference, corrupt), tgt),
                                ids, max_new_tokens=24)
    assert ours.tokens == ref.tokens
    assert official != ref.tokens


def test_sampling_probs_match_official(official):
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0)) * 3
    for t, p, k in [(1.0, 1.0, 0), (0.7, 0.9, 0), (1.3, 1.0, 10), (0.8, 0.5, 20), (1.0, 0.95, 50)]:
        torch.testing.assert_close(sampling_probs(logits, SamplingConfig(t, p, k)),
                                   official._sampling_probs(logits, t, p, k))


# ------------------------------------------------------------------------------------------------
# Trained drafter
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["llama", "qwen3_5"])
def test_trained_drafter_is_lossless_and_accepts_more(kind):
    """A drafter trained (draftsmith.modeling training loss, 60 AdamW steps) on the target's own greedy
    continuations: lossless, and its τ on those prompts beats the untrained drafter's."""
    from draftsmith.drafter_config import default_loss_gamma
    from draftsmith.modeling import PackedBatch, sample_anchors

    tgt = target(kind)
    drafter = make_drafter(tgt, seed=7)
    untrained = make_drafter(tgt, seed=7)
    prompts = [prompt(10 + s) for s in range(2)]
    refs, batches = [], []
    embed = tgt.get_input_embeddings().weight.detach()
    head = tgt.lm_head.weight.detach()
    for ids in prompts:
        ref = target_generate(tgt, ids, max_new_tokens=40)
        seq = torch.cat([ids[0], torch.tensor(ref.tokens)])
        refs.append(ref)
        with torch.no_grad(), capture_layers(tgt, drafter.target_layer_ids) as cap:
            tgt(seq[None])
            feats = cap.features()
        loss_mask = torch.zeros(seq.shape[0], dtype=torch.bool)
        loss_mask[ids.shape[1] - 1:] = True
        doc = torch.zeros_like(seq)
        anchors = sample_anchors(loss_mask, doc, 64, torch.Generator().manual_seed(0))
        batches.append(PackedBatch(features=feats, input_ids=seq[None], loss_mask=loss_mask[None], doc_ids=doc[None],
                                   position_ids=torch.arange(seq.shape[0])[None], anchors=anchors[None],
                                   anchor_valid=torch.ones_like(anchors, dtype=torch.bool)[None]))
    drafter.train()
    opt = torch.optim.AdamW(drafter.parameters(), lr=5e-3)
    losses = []
    for step in range(60):
        out = drafter.training_forward(batches[step % 2], embed, head, gamma=default_loss_gamma(BLOCK))
        opt.zero_grad()
        out.loss.backward()
        opt.step()
        losses.append(out.loss.item())
    drafter.eval()
    assert sum(losses[-4:]) < sum(losses[:4])
    taus = {}
    for name, model in (("trained", drafter), ("untrained", untrained)):
        results = []
        for ids, ref in zip(prompts, refs):
            for mode in (["mixer", "forward"] if kind != "llama" else ["auto"]):
                out = speculative_generate(tgt, DFlashProposer(model, tgt), ids, max_new_tokens=40, rollback=mode)
                assert out.tokens == ref.tokens, f"{kind} {name} drafter {mode}: not lossless"
                results.append(out)
        taus[name] = summarize(results)["tau"]
    assert taus["trained"] > taus["untrained"]


# ------------------------------------------------------------------------------------------------
# Sampling
# ------------------------------------------------------------------------------------------------

def _chi2(counts: list[int], probs: list[float]) -> float:
    n = sum(counts)
    return sum((c - n * p) ** 2 / (n * p) for c, p in zip(counts, probs) if p > 0)


def test_rejection_sampling_preserves_the_target_distribution():
    """The committed token after a block is distributed as the target's p, whatever the drafter's q
    (random q, a top-k-truncated q, a deterministic draft), and the bonus token when all are accepted;
    a broken scheme (accepting every draft) is detected by the same test."""
    g = torch.Generator().manual_seed(0)
    V, n = 5, 6000
    p = torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05], [0.1, 0.3, 0.2, 0.25, 0.15]])
    for q in (torch.tensor([[0.05, 0.1, 0.15, 0.3, 0.4]]), torch.tensor([[0.0, 0.0, 0.5, 0.5, 0.0]]), None):
        counts = [0] * V
        for _ in range(n):
            if q is None:
                draft = torch.tensor([3])
            else:
                draft = torch.multinomial(q[0], 1, generator=g)
            accepted, token = rejection_sample(draft, p, q, g)
            first = int(draft[0]) if accepted else token
            counts[first] += 1
        assert _chi2(counts, p[0].tolist()) < CHI2_CRIT_001[V - 1], (q, counts)
    # power: committing the drafts unconditionally gives q's distribution, which the test rejects
    q = torch.tensor([0.05, 0.1, 0.15, 0.3, 0.4])
    counts = torch.bincount(torch.multinomial(q, n, replacement=True, generator=g), minlength=V).tolist()
    assert _chi2(counts, p[0].tolist()) > CHI2_CRIT_001[V - 1]
    # bonus: with an always-accepted draft the next token comes from p[k]
    counts = [0] * V
    sure = torch.tensor([[0.0, 0.0, 1.0, 0.0, 0.0], [0.1, 0.3, 0.2, 0.25, 0.15]])
    for _ in range(n):
        accepted, token = rejection_sample(torch.tensor([2]), sure, None, g)
        assert accepted == 1
        counts[token] += 1
    assert _chi2(counts, sure[1].tolist()) < CHI2_CRIT_001[V - 1]


@pytest.mark.slow
@pytest.mark.parametrize("sampling,scale", [(SamplingConfig(1.0), 5.0), (SamplingConfig(0.8, top_p=0.9), 10.0)])
def test_speculative_sampling_matches_target_on_two_token_vocabulary(sampling, scale):
    """End to end, two-token vocabulary: the sequences of 3 tokens sampled by speculative decoding with a
    random DFlash drafter follow the target's exact sequence distribution (chi-square, 7 dof, alpha 1e-3,
    fixed seed); committing the drafts without rejection would not."""
    tgt = tiny_target("llama", vocab_size=2, pad_token_id=0, bos_token_id=0, eos_token_id=1,
                      hidden_size=32, intermediate_size=64, num_hidden_layers=2, seed=2)
    with torch.no_grad():
        tgt.lm_head.weight.mul_(scale)  # a skewed target distribution
    drafter = make_drafter(tgt, seed=3, block_size=4, layer_ids=(0, 1))
    ids = torch.tensor([[0, 1, 1, 0, 1]])
    exact = {}
    with torch.no_grad():
        for seq in itertools.product([0, 1], repeat=3):
            prob = 1.0
            for i in range(3):
                ctx = torch.cat([ids[0], torch.tensor(seq[:i], dtype=torch.long)])[None]
                prob *= sampling_probs(tgt(ctx).logits[0, -1], sampling)[seq[i]].item()
            exact[seq] = prob
    assert max(exact.values()) > 2 * min(exact.values())  # not uniform: the test has something to detect
    proposer = DFlashProposer(drafter, tgt)
    g = torch.Generator().manual_seed(0)
    n = 1200
    counts = dict.fromkeys(exact, 0)
    drafted = dict.fromkeys(exact, 0)
    accepted = proposed = 0
    for _ in range(n):
        out = speculative_generate(tgt, proposer, ids, max_new_tokens=3, sampling=sampling, generator=g)
        counts[tuple(out.tokens)] += 1
        accepted += sum(out.accepted)
        proposed += sum(out.proposed)
    assert 0 < accepted < proposed  # both acceptances and rejections happened
    keys = [k for k, v in exact.items() if v > 0]
    assert min(exact[k] for k in keys) * n >= 5  # the chi-square approximation holds
    assert all(counts[k] == 0 for k in exact if k not in keys)  # top-p-excluded sequences never appear
    crit = CHI2_CRIT_001[len(keys) - 1]
    assert _chi2([counts[k] for k in keys], [exact[k] for k in keys]) < crit
    # power: the drafter's own proposals (first token from the target, the rest drafted, never rejected)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for _ in range(400):
            first = int(torch.multinomial(sampling_probs(tgt(ids).logits[0, -1], sampling), 1, generator=g))
            with TargetCache(tgt) as tc, capture_layers(tgt, drafter.target_layer_ids) as cap:
                tgt(ids, past_key_values=tc.cache, use_cache=True)
                proposer.reset(ids, cap.features())
            toks = torch.cat([ids[0], torch.tensor([first, 0, 0])])
            drafts, _ = proposer.propose(toks, ids.shape[1], 2, sampling, g)
            drafted[(first, *drafts.tolist())] += 1
    assert _chi2([drafted[k] for k in keys], [exact[k] for k in keys]) > crit


# ------------------------------------------------------------------------------------------------
# Prompt lookup, metrics
# ------------------------------------------------------------------------------------------------

def test_prompt_lookup_proposals():
    pl = PromptLookupProposer(max_ngram=3, num_tokens=4)
    s = SamplingConfig()
    toks = torch.tensor([5, 6, 7, 8, 9, 10, 5, 6, 7])
    drafts, probs = pl.propose(toks, 8, 4, s, None)
    assert drafts.tolist() == [8, 9, 10, 5] and probs is None  # trailing 3-gram, earliest match
    drafts, _ = pl.propose(torch.tensor([1, 2, 3, 9, 3]), 4, 4, s, None)
    assert drafts.tolist() == [9, 3]  # falls back to the 1-gram [3]; stops at the end of the text
    drafts, _ = pl.propose(torch.tensor([1, 2, 3, 4]), 3, 4, s, None)
    assert drafts.numel() == 0
    drafts, _ = pl.propose(toks, 8, 2, s, None)
    assert drafts.tolist() == [8, 9]  # capped by the budget


def test_summarize_metrics():
    r1 = GenerationResult(tokens=list(range(9)), num_prompt_tokens=5, seconds=2.0, prefill_seconds=0.5,
                          committed=[4, 1, 3], accepted=[3, 0, 2], proposed=[3, 3, 3])
    r2 = GenerationResult(tokens=list(range(4)), num_prompt_tokens=5, seconds=1.0, prefill_seconds=0.25,
                          committed=[2, 1], accepted=[1, 0], proposed=[3, 1])
    base = [GenerationResult(tokens=list(range(9)), num_prompt_tokens=5, seconds=6.0, prefill_seconds=0.5),
            GenerationResult(tokens=list(range(4)), num_prompt_tokens=5, seconds=3.0, prefill_seconds=0.25)]
    m = summarize([r1, r2], base, max_block=4)
    assert m["tau"] == pytest.approx(11 / 5)
    assert m["tau_per_prompt"] == pytest.approx((8 / 3 + 1.5) / 2)
    assert m["acceptance_histogram"] == [2, 1, 1, 1]
    # slot 1: 5 steps proposed >= 1, 3 accepted >= 1; slot 2: 4 steps proposed >= 2, 2 accepted >= 2 (of 3
    # that reached slot 2); slot 3: 4 steps, 1 accepted (of 2 that reached it)
    assert m["per_position"] == pytest.approx([3 / 5, 2 / 4, 1 / 4])
    assert m["per_position_conditional"] == pytest.approx([3 / 5, 2 / 3, 1 / 2])
    assert m["speedup"] == pytest.approx((13 / 3) / (13 / 9))
    assert m["decode_speedup"] == pytest.approx((11 / 2.25) / (11 / 8.25))
    check = lossless_check(base, [r1, GenerationResult(tokens=[0, 1, 7], num_prompt_tokens=5, seconds=1,
                                                        prefill_seconds=0)], ["a", "b"])
    assert not check["lossless"] and check["mismatches"] == [
        {"prompt": "b", "first_mismatch": 2, "ref_tokens": 4, "tokens": 3}]


# ------------------------------------------------------------------------------------------------
# Benchmark sets and the stage end to end
# ------------------------------------------------------------------------------------------------



def m(role, content):
    return {"role": role, "content": content}


def write_curated(path, rows):
    pq.write_table(pa.Table.from_pylist(rows, schema=CURATED), path)
    return str(path)


def test_split_conversation():
    conv = split_conversation("a", "s", [m("system", "S"), m("user", "q1"), m("assistant", "a1"),
                                         m("user", "q2"), m("assistant", "ref")], None)
    assert conv.context == [] and conv.user_turns == [[m("system", "S"), m("user", "q1"), m("assistant", "a1"),
                                                       m("user", "q2")]]
    conv = split_conversation("b", "mtbench", [m("system", "S"), m("user", "t1"), m("user", "t2")], None)
    assert conv.context == [m("system", "S")] and conv.user_turns == [[m("user", "t1")], [m("user", "t2")]]
    assert split_conversation("c", "s", [m("system", "S"), m("assistant", "x")], None) is None


def test_load_sets(tmp_path):
    rows = [
        {"id": "h1", "source": "chat", "messages": [m("user", "hi"), m("assistant", "yo")], "tools": None},
        {"id": "x1", "source": "code", "messages": [m("user", "def f"), m("assistant", "pass")], "tools": None},
        {"id": "h2", "source": "chat", "messages": [m("assistant", "orphan")], "tools": None},
        {"id": "h3", "source": "math", "messages": [m("user", "1+1"), m("assistant", "2")], "tools": None},
        {"id": "t1", "source": "mtbench", "messages": [m("user", "turn one"), m("user", "turn two")], "tools": None},
    ]
    path = write_curated(tmp_path / "eval.parquet", rows)
    sets = load_sets(path, {"heldout": {"source": "heldout", "max_prompts": 5},
                            "mt": {"source": "mtbench", "max_new_tokens": 7},
                            "code": {"source": "code", "max_prompts": 1}},
                     heldout_sources=["chat", "math"])
    held, mt, code = sets
    assert [c.id for c in held.conversations] == ["h1", "h3"] and held.skipped == {"no_user_turn": 1}
    assert held.rows_read == 3 == len(held.conversations) + sum(held.skipped.values())
    assert mt.max_prompts == 16 and mt.max_new_tokens == 7
    assert mt.conversations[0].user_turns == [[m("user", "turn one")], [m("user", "turn two")]]
    assert [c.id for c in code.conversations] == ["x1"]
    with pytest.raises(ValueError, match="humaneval"):
        load_sets(path, {"he": {"source": "humaneval"}}, heldout_sources=["chat"])
    # prompts that do not fit are skipped, counted, and the set is filled from the rows after them
    long_first = [{"id": "L", "source": "chat", "messages": [m("user", "x" * 50), m("assistant", "a")],
                   "tools": None}] + rows
    path = write_curated(tmp_path / "eval2.parquet", long_first)
    (held,) = load_sets(path, {"heldout": {"source": "heldout", "max_prompts": 2, "max_new_tokens": 3}},
                        heldout_sources=["chat", "math"],
                        first_prompt_fits=lambda conv, new: len(conv.user_turns[0][0]["content"]) + new <= 10)
    assert [c.id for c in held.conversations] == ["h1", "h3"]
    assert held.skipped == {"prompt_too_long": 1, "no_user_turn": 1} and held.rows_read == 4


class _TurnDecoders:
    """Just what :func:`draftsmith.evaluate.decoders.decode_set` asks of its decoders: every prompt's target-only
    answer is token 0 repeated, the lossless methods' (and the reference's, when ``reference``) token 1; the
    rendered histories are kept."""

    warmed, seed, max_prompt_tokens = True, 0, 1000

    def __init__(self, reference: bool):
        from types import SimpleNamespace

        self.reference, self.histories = reference, []
        self.tokenizer = SimpleNamespace(decode=lambda ids, skip_special_tokens: "".join("AB"[i] for i in ids))

    def render(self, messages, tools):
        self.histories.append([dict(msg) for msg in messages])
        return [len(self.histories)] * 4  # a prompt of its own per turn

    def fits(self, num_prompt_tokens, max_new):
        return True

    def draw_seed(self, label):
        return 0

    def passes(self):
        return 3 + int(self.reference)

    def decode(self, ids, max_new, gen_seed, rotate=0, on_tokens=None):
        from draftsmith.evaluate.decode import GenerationResult

        def result(tok: int, committed: list[int]) -> GenerationResult:
            return GenerationResult(tokens=[tok] * 3, num_prompt_tokens=len(ids), seconds=0.1, prefill_seconds=0.01,
                                    committed=committed, accepted=[c - 1 for c in committed],
                                    proposed=[3] * len(committed))

        out = {"target_only": result(0, []), "dflash": result(1, [3]), "prompt_lookup": result(1, [2, 1])}
        if self.reference:
            out["reference"] = result(1, [])
        return out


@pytest.mark.parametrize("reference", [True, False])
def test_second_turn_is_asked_after_the_lossless_reference_when_there_is_one(reference):
    """A conversation's second turn follows the target's greedy answer every lossless method commits (the
    reference, which repeats from run to run) when decoding made one, else target-only decoding's answer; the
    report's ``run.next_turn`` and the resume key say which (an evaluation saved under the older rule is decoded
    again)."""
    from unittest import mock

    from draftsmith.evaluate.decoders import decode_set
    from draftsmith.evaluate.prompts import BenchmarkSet, Conversation

    def m(role, content):
        return {"role": role, "content": content}

    bset = BenchmarkSet("mt", "mtbench", 4, 3, [Conversation("c1", "mtbench", [m("system", "S")],
                                                              [[m("user", "one")], [m("user", "two")]])])
    decoders = _TurnDecoders(reference)
    out = decode_set(decoders, bset, {}, mock.MagicMock())
    assert out["labels"] == ["c1#0", "c1#1"] and len(out["results"]["dflash"]) == 2
    assert decoders.histories[0] == [m("system", "S"), m("user", "one")]
    answer = "BBB" if reference else "AAA"
    assert decoders.histories[1] == [m("system", "S"), m("user", "one"), m("assistant", answer), m("user", "two")]


def test_the_resume_key_changes_with_the_rule_later_turns_follow(monkeypatch):
    """Conversations saved by an evaluation whose later turns followed another answer are not reused: the rule
    (``NEXT_TURN_RULE``) and ``evaluate.static_cache`` (whether there is a reference to follow) are part of the
    resume key of a set with later turns; a single-turn set's key leaves them out."""
    from types import SimpleNamespace

    import draftsmith.evaluate.resume as resume
    from draftsmith.evaluate.decoders import NEXT_TURN_RULE
    from draftsmith.evaluate.prompts import BenchmarkSet, Conversation
    from draftsmith.evaluate.sampling import SamplingConfig

    monkeypatch.setattr(resume, "sha256_file", lambda path: "drafter-sha")
    monkeypatch.setattr(resume, "target_fingerprint", lambda path: "target-fingerprint")
    decoders = SimpleNamespace(tokenizer_fingerprint="tok", template_kwargs={}, sampling=SamplingConfig(), seed=0,
                               block_size=16, lookup=SimpleNamespace(max_ngram=3, max_drafts=15), stops=[2],
                               device=torch.device("cpu"), dtype=torch.float32, rollback="auto",
                               max_prompt_tokens=1000, mtp_tokens=[], start_dir=None, static_cache="auto")
    user = [{"role": "user", "content": "q"}]
    multi = BenchmarkSet("mt", "mtbench", 4, 8, [Conversation("c", "mtbench", [], [user, user])])
    single = BenchmarkSet("he", "humaneval", 4, 8, [Conversation("h", "humaneval", [], [user])])
    key = resume.run_key(decoders, "target", "drafter")
    assert key["next_turn"] == {"rule": NEXT_TURN_RULE, "static_cache": "auto"} and "reference" in NEXT_TURN_RULE
    keys = {b.name: resume.set_key(key, b) for b in (multi, single)}
    dynamic = resume.run_key(SimpleNamespace(**{**vars(decoders), "static_cache": "false"}), "target", "drafter")
    assert resume.set_key(dynamic, multi) != keys["mt"] and resume.set_key(dynamic, single) == keys["he"]
    monkeypatch.setattr(resume, "NEXT_TURN_RULE", "target-only decoding's answer")
    other_rule = resume.run_key(decoders, "target", "drafter")
    assert resume.set_key(other_rule, multi) != keys["mt"] and resume.set_key(other_rule, single) == keys["he"]


def test_evaluate_settings_hold_the_stage_keys_and_the_schema_defaults():
    """EvaluateSettings holds exactly the keys rule evaluate reads (draftsmith.stages.STAGE_KEYS), keeps the sets
    in config order (through the JSON the decoding workers get too), refuses the removed evaluate.stop_tokens, and
    a set's omitted sizes take the schema's defaults."""
    from draftsmith.config import REMOVED_STOP_TOKENS, schema_entry_defaults
    from draftsmith.evaluate.prompts import set_config
    from draftsmith.stages import STAGE_KEYS

    assert EvaluateSettings.keys() == {section: kinds.get("output", ()) + kinds.get("runtime", ())
                                       for section, kinds in STAGE_KEYS["evaluate"].items()}
    settings = EvaluateSettings.from_config(evaluate={"sets": {"z": {"source": "heldout"}, "a": {"source": "mt"}}})
    assert list(settings.evaluate.sets) == ["z", "a"]
    assert list(EvaluateSettings.from_config(json.loads(json.dumps(settings.to_dict()))).evaluate.sets) == ["z", "a"]
    with pytest.raises(ValueError, match="evaluate.stop_tokens is no longer read") as refused:
        EvaluateSettings.from_config(evaluate={"stop_tokens": ["</s>"]})
    assert str(refused.value) == REMOVED_STOP_TOKENS
    assert schema_entry_defaults("evaluate", "sets") == {"max_prompts": 16, "max_new_tokens": 128}
    # evaluate.mtp: the schema's default, also for an empty mapping; refused values name the key
    assert settings.evaluate.mtp_tokens == [1, 2, 3]
    assert EvaluateSettings.from_config(evaluate={"mtp": {}}).evaluate.mtp_tokens == [1, 2, 3]
    assert EvaluateSettings.from_config(evaluate={"mtp": {"num_speculative_tokens": []}}).evaluate.mtp_tokens == []
    for bad in ({"num_speculative_tokens": [0]}, {"num_speculative_tokens": [2, 2]}, {"tokens": [1]}):
        with pytest.raises(ValueError, match=r"evaluate\.mtp\."):
            EvaluateSettings.from_config(evaluate={"mtp": bad})
    assert set_config("z", settings.evaluate.sets["z"]) == {"source": "heldout", "max_prompts": 16,
                                                            "max_new_tokens": 128}


@pytest.fixture(scope="module")
def stage_inputs(tmp_path_factory):
    """A tiny target folder (llama + tiny ChatML tokenizer), an exported drafter, curated and tokenized
    eval files and an MT-Bench question file."""
    from draftsmith.curate import normalize_conversation
    from draftsmith.tokenize import tokenized_metadata, tokenizer_fingerprint

    root = tmp_path_factory.mktemp("evaluate")
    tok = tiny_tokenizer()
    tgt = tiny_target("llama", max_position_embeddings=256)
    tdir = root / "target"
    tgt.save_pretrained(tdir)
    tok.save_pretrained(tdir)
    ddir = root / "drafter"
    make_drafter(tgt, seed=2).save_pretrained(ddir)
    t1, t2 = "Write a function that adds two numbers.", "Now explain it."
    mt_id = normalize_conversation([{"role": "user", "content": t1}, {"role": "user", "content": t2}],
                                   prompt_only=True).id
    rows = [
        {"id": "c1", "source": "chat", "messages": [m("user", "Hello! How are you today?"), m("assistant", "fine")],
         "tools": None},
        {"id": "c2", "source": "chat", "messages": [m("system", "Be brief."), m("user", "The quick brown fox"),
                                                    m("assistant", "jumps")], "tools": None},
        {"id": "c3", "source": "chat", "messages": [m("user", "The answer is " + "42, " * 300),
                                                    m("assistant", "ok")], "tools": None},
        {"id": mt_id, "source": "mtbench", "messages": [m("user", t1), m("user", t2)], "tools": None},
    ]
    curated = write_curated(root / "eval.parquet", rows)
    meta = tokenized_metadata({}, tokenizer_fingerprint(tok), 512)
    schema = pa.schema([("id", pa.string()), ("source", pa.string()), ("input_ids", pa.list_(pa.int32())),
                        ("loss_mask", pa.list_(pa.int8())), ("num_tokens", pa.int32())], metadata=meta)
    tokenized = str(root / "tok_eval.parquet")
    pq.write_table(pa.Table.from_pylist([], schema=schema), tokenized)
    return {"root": root, "target": str(tdir), "drafter": str(ddir), "curated": curated, "tokenized": tokenized,
            "tokenizer": tok}


def _stage_kwargs(inputs, out, **cfg):
    evaluate_cfg = {"sets": {"heldout": {"source": "heldout", "max_prompts": 3, "max_new_tokens": 24},
                             "mtbench": {"source": "mtbench", "max_prompts": 2, "max_new_tokens": 16}},
                    "prompt_lookup_ngram": 3, **cfg}
    outputs = {k: str(out / f) for k, f in [("json", "report.json"), ("md", "report.md"), ("tau", "tau.png"),
                                            ("positions", "per_position.png"), ("histogram", "hist.png")]}
    state = out / "trainer_state.json"
    out.mkdir(parents=True, exist_ok=True)
    state.write_text(json.dumps({"steps": 7, "labels": "target", "block_size": BLOCK, "last_train": {},
                                 "heldout": {"tau_blocks": 1.75, "tau_expected": 1.5, "loss": 3.0,
                                             "accuracy_per_position": [0.4, 0.2, 0.1]}}))
    settings = EvaluateSettings.from_config(evaluate=evaluate_cfg, target={"dtype": "float32"})
    return dict(target_dir=inputs["target"], drafter_dir=inputs["drafter"], curated_eval=inputs["curated"],
                tokenized_eval=inputs["tokenized"], outputs=outputs, settings=settings,
                trainer_state=str(state), device="cpu",
                sources=[{"name": "chat", "split": "both"}, {"name": "mtbench", "split": "eval"}])


@pytest.mark.slow
def test_evaluate_stage_end_to_end(stage_inputs, tmp_path, monkeypatch):
    """run_evaluate writes a reconciled report (lossless, τ, speedups, histogram), report.md and valid
    PNGs; MT-Bench turn 2 is asked after the target's answer; an over-long prompt is a counted skip; a
    run killed after the first set resumes without redoing it; a tokenizer mismatch is refused."""
    import draftsmith.evaluate.decoders as decoders_mod

    kwargs = _stage_kwargs(stage_inputs, tmp_path)
    calls, rendered = [], []
    real_generate, real_render = decoders_mod.target_generate, decoders_mod.render

    def counting_generate(*a, **k):
        calls.append(1)
        if kill_at and len(calls) == kill_at:
            raise KeyboardInterrupt("killed")
        return real_generate(*a, **k)

    monkeypatch.setattr(decoders_mod, "target_generate", counting_generate)
    monkeypatch.setattr(decoders_mod, "render",
                        lambda tok, msgs, *a: rendered.append(msgs) or real_render(tok, msgs, *a))
    kill_at = 4  # warm-up, two heldout prompts, then killed on the first MT-Bench turn
    with pytest.raises(KeyboardInterrupt):
        run_evaluate(**kwargs)
    assert json.loads((tmp_path / "partial" / "heldout" / "main.json").read_text())["conversations"].keys() == {
        "c1", "c2"} and not (tmp_path / "report.json").exists()
    assert not (tmp_path / "partial" / "mtbench").exists()
    kill_at, calls[:], rendered[:] = None, [], []
    report = run_evaluate(**kwargs)
    assert len(calls) == 1 + 2  # warm-up + the two MT-Bench turns: heldout came from the partial file
    assert not (tmp_path / "partial").exists()
    # MT-Bench turn 2 is asked after the target's own (decoded) answer to turn 1
    turn1, turn2 = rendered[-2], rendered[-1]
    assert [x["role"] for x in turn2] == ["user", "assistant", "user"] and turn2[:1] == turn1
    assert turn2[2]["content"] == "Now explain it."

    saved = json.loads((tmp_path / "report.json").read_text())
    assert saved == json.loads(json.dumps(report))
    held, mt = report["sets"]["heldout"], report["sets"]["mtbench"]
    # the over-long first prompt is skipped when the set is read (counted), not at decode time
    assert held["rows_read"] == 3 and held["conversations"] == 2 and held["prompts"] == 2
    assert held["skipped_rows"] == {"prompt_too_long": 1} and held["skipped_prompts"] == {}
    assert held["prompts_planned"] == 2
    assert mt["conversations"] == 1 and mt["prompts"] == 2  # both MT-Bench turns
    for s in (held, mt):
        assert s["lossless"]["dflash"]["lossless"] and s["lossless"]["prompt_lookup"]["lossless"]
        d = s["dflash"]
        assert d["tau"] >= 1.0 and d["steps"] > 0 and sum(d["acceptance_histogram"]) == d["steps"]
        assert len(d["per_position"]) == BLOCK - 1 and d["speedup"] > 0
        assert s["target_only"]["tokens"] == d["tokens"] == s["prompt_lookup"]["tokens"]
        for method in ("dflash", "prompt_lookup"):  # the per-prompt sums give the set's own figures
            rows, m = s["per_prompt"], s[method]
            assert sum(r[f"{method}_steps"] for r in rows) == m["steps"]
            assert sum(r[f"{method}_committed"] for r in rows) / m["steps"] == pytest.approx(m["tau"])
            assert sum(r[f"{method}_tokens"] for r in rows) == m["tokens"]
    assert report["overall"]["prompts"] == 4
    # the shared stop policy: eos 2 = <|im_end|>, ChatML's end-of-turn; <|endoftext|> (0) is the pad, where
    # transformers' generate does not stop either
    assert report["run"]["block_size"] == BLOCK and report["run"]["stop_token_ids"] == [2]
    md = (tmp_path / "report.md").read_text()
    assert "| heldout |" in md and "| mtbench |" in md and "prompt_too_long × 1" in md
    # training's teacher-forced held-out block τ beside the decoded held-out τ
    assert report["training"]["heldout_tau_blocks"] == 1.75
    assert f"| 7 | target | 1.75 | 1.50 | {held['dflash']['tau']:.2f} | 0.40 / 0.20 / 0.10 |" in md
    for png in ("tau.png", "per_position.png", "hist.png"):
        assert (tmp_path / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    bad = dict(kwargs, tokenized_eval=str(tmp_path / "other.parquet"))
    schema = pq.read_schema(stage_inputs["tokenized"])
    meta = dict(schema.metadata)
    meta[b"draftsmith.chat_template_kwargs"] = b'{"enable_thinking": true}'
    meta[b"draftsmith.tokenizer_fingerprint"] = b'"0000"'
    pq.write_table(pa.Table.from_pylist([], schema=schema.with_metadata(meta)), bad["tokenized_eval"])
    with pytest.raises(ValueError, match="another tokenizer"):
        run_evaluate(**bad)


# Mistral / Llama 2 style: the template raises on a system message and on more than two messages (so MT-Bench's
# second turn, asked after the target's answer, fails when decoding, and the system-prompt row when the set is read)
RAISING_TEMPLATE = (
    "{% if messages[0]['role'] == 'system' or messages | length > 2 %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    + TINY_CHATML_TEMPLATE)


@pytest.mark.slow
def test_a_template_that_raises_on_a_prompt_skips_it_counted_and_listed(stage_inputs, tmp_path):
    import shutil

    from draftsmith.tokenize import tokenized_metadata, tokenizer_fingerprint

    target = tmp_path / "target"
    shutil.copytree(stage_inputs["target"], target)
    tok = tiny_tokenizer(chat_template=RAISING_TEMPLATE)
    tok.save_pretrained(target)
    tokenized = tmp_path / "tok_eval.parquet"
    schema = pq.read_schema(stage_inputs["tokenized"])
    pq.write_table(pa.Table.from_pylist([], schema=schema.with_metadata(
        tokenized_metadata({}, tokenizer_fingerprint(tok), 512))), tokenized)
    kwargs = _stage_kwargs(stage_inputs, tmp_path / "out")
    report = run_evaluate(**dict(kwargs, target_dir=str(target), tokenized_eval=str(tokenized)))
    held, mt = report["sets"]["heldout"], report["sets"]["mtbench"]
    # c2 (system prompt) is refused by the template when the set is read, c3 is too long: c1 is evaluated
    assert held["rows_read"] == 3 and held["conversations"] == 1 and held["prompts"] == 1
    assert held["skipped_rows"] == {"template_error": 1, "prompt_too_long": 1}
    assert held["skipped_row_ids"] == {"template_error": ["c2"], "prompt_too_long": ["c3"]}
    # MT-Bench: turn 1 is evaluated, turn 2 (after the target's answer) is refused when decoding
    assert mt["prompts_planned"] == 2 and mt["prompts"] == 1 and mt["skipped_prompts"] == {"template_error": 1}
    for s in (held, mt):
        assert s["lossless"]["dflash"]["lossless"] and s["dflash"]["tokens"] == s["target_only"]["tokens"] > 0
    md = (tmp_path / "out" / "report.md").read_text()
    assert "template_error × 1" in md and "template_error rows: c2" in md


def test_evaluate_stage_on_the_static_cache(stage_inputs, tmp_path):
    """evaluate.static_cache: true (on a GPU: CUDA graphs too): the same τ and tokens as the dynamic path, and a
    lossless reference decoded with forwards of the verify width."""
    dyn = run_evaluate(**_stage_kwargs(stage_inputs, tmp_path / "dynamic", static_cache="false"))
    sta = run_evaluate(**_stage_kwargs(stage_inputs, tmp_path / "static", static_cache="true"))
    assert dyn["run"]["decoding"] == "dynamic KV cache" and sta["run"]["decoding"] == "static KV cache"
    assert "verify width (8 tokens" in sta["run"]["lossless_reference"]
    assert sta["run"]["next_turn"] == "after the lossless reference's answer"
    assert dyn["run"]["next_turn"] == "after target-only decoding's answer"
    for name in ("heldout", "mtbench"):
        d, s = dyn["sets"][name], sta["sets"][name]
        assert s["dflash"]["tau"] == d["dflash"]["tau"] and s["prompt_lookup"]["tau"] == d["prompt_lookup"]["tau"]
        assert s["lossless"]["dflash"]["lossless"] and s["lossless"]["prompt_lookup"]["lossless"]
        assert s["target_only_vs_reference"]["lossless"]  # float32: 1-token and 8-token forwards agree here
        assert "target_only_vs_reference" not in d


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_evaluate_stage_on_a_gpu_equals_the_cpu_and_resumes(stage_inputs, tmp_path, monkeypatch):
    """On a GPU the stage decodes on the static cache with CUDA graphs (auto) and reports the CPU run's τ and
    lossless sets; killed after its first conversation, it resumes from the saved one (float32: no near ties)."""
    import draftsmith.evaluate.decoders as decoders_mod

    cpu = run_evaluate(**_stage_kwargs(stage_inputs, tmp_path / "cpu"))
    kwargs = {**_stage_kwargs(stage_inputs, tmp_path / "gpu", checkpoint_interval=1e-6), "device": "cuda"}
    calls, real = [], decoders_mod.speculative_generate

    def killing(*a, **k):
        calls.append(1)
        if len(calls) == 5:  # warm-up (2 proposers), c1 (2), then killed in c2
            raise KeyboardInterrupt("killed")
        return real(*a, **k)

    monkeypatch.setattr(decoders_mod, "speculative_generate", killing)
    with pytest.raises(KeyboardInterrupt):
        run_evaluate(**kwargs)
    monkeypatch.undo()
    partial = json.loads((tmp_path / "gpu" / "partial" / "heldout" / "main.json").read_text())
    assert list(partial["conversations"]) == ["c1"]
    gpu = run_evaluate(**kwargs)
    assert gpu["run"]["decoding"] == "static KV cache, CUDA graphs" and cpu["run"]["decoding"] == "dynamic KV cache"
    for name in ("heldout", "mtbench"):
        g, c = gpu["sets"][name], cpu["sets"][name]
        assert g["lossless"]["dflash"]["lossless"] and g["lossless"]["prompt_lookup"]["lossless"]
        assert (g["dflash"]["tau"], g["prompt_lookup"]["tau"]) == (c["dflash"]["tau"], c["prompt_lookup"]["tau"])


def test_auto_puts_hybrid_targets_on_the_static_cache_on_a_gpu(caplog):
    """evaluate.static_cache: auto on a GPU serves hybrid Gated DeltaNet targets from the static cache (their graph
    rollback ran lossless on an H200: docs/rehearsal-x2), keeps sliding-window targets on the dynamic one (logged,
    with the reason), and never uses it on the CPU; ``true`` refuses a target it cannot serve."""
    from draftsmith.evaluate.decoders import static_target
    from draftsmith.evaluate.settings import EvaluateOptions
    from draftsmith.evaluate.static import StaticTarget

    cuda = torch.device("cuda")  # the model stays on the CPU: no graphs are captured, the decision is what is tested
    cfg = EvaluateOptions.from_mapping(static_cache="auto", sets={"a": {"max_new_tokens": 32}})
    hybrid = target("qwen3_5")
    dflash, lookup = DFlashProposer(make_drafter(hybrid, seed=3), hybrid), PromptLookupProposer(3, BLOCK - 1)
    got = static_target(hybrid, cfg, dflash, lookup, 64, 4096, cuda)
    assert isinstance(got, StaticTarget) and got.recurrent and got.max_length == 64 + 32 + BLOCK + 1
    assert got.max_width == BLOCK and got.verify_width == BLOCK
    assert static_target(hybrid, cfg, dflash, lookup, 64, 4096, torch.device("cpu")) is None
    sliding = target("qwen3_sliding")
    with caplog.at_level("INFO", logger="draftsmith.evaluate"):
        assert static_target(sliding, cfg, DFlashProposer(make_drafter(sliding, seed=3), sliding), lookup, 64, 4096,
                             cuda) is None
    assert "static cache / CUDA graphs not used" in caplog.text and "sliding" in caplog.text
    with pytest.raises(ValueError, match="static_cache: true"):
        static_target(sliding, cfg.replace(static_cache="true"), DFlashProposer(make_drafter(sliding, seed=3),
                      sliding), lookup, 64, 4096, cuda)


def _without_timings(value):
    """A report with its wall-clock figures (seconds, tokens/s, speedups) left out: what two runs share."""
    timing = ("seconds", "tok_per_s", "tokens_per_s", "speedup", "time", "wall")
    if isinstance(value, dict):
        return {k: _without_timings(v) for k, v in value.items()
                if not (k.endswith("_s") or any(t in k for t in timing))}
    if isinstance(value, list):
        return [_without_timings(v) for v in value]
    return value


def _differences(a, b, path="") -> list[str]:
    """The paths where two JSON-like values differ."""
    if isinstance(a, dict) and isinstance(b, dict):
        return [d for k in sorted(set(a) | set(b)) for d in _differences(a.get(k), b.get(k), f"{path}.{k}")]
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [d for k, (x, y) in enumerate(zip(a, b)) for d in _differences(x, y, f"{path}[{k}]")]
    return [] if a == b else [f"{path}: {a!r} != {b!r}"[:300]]


@pytest.mark.slow
def test_decoding_workers_share_gpus_as_evaluate_workers_per_gpu_says(monkeypatch):
    """evaluate.workers_per_gpu: that many decoding processes on each leased GPU, dealt round-robin; the CPU keeps
    one process; a job given fewer GPUs than evaluate.gpus decodes on one; too few visible GPUs are named."""
    from draftsmith.evaluate.workers import decoding_workers, gpu_of

    assert decoding_workers(1, "cpu", 4) == 1 and decoding_workers(4, "cpu", 1) == 1
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert decoding_workers(1, "cuda") == 1 and decoding_workers(1, "cuda", 3) == 3
    assert decoding_workers(2, "cuda", 3) == 6 and decoding_workers(2, "cuda") == 2
    assert decoding_workers(4, "cuda", 2) == 2  # 4 GPUs asked, 2 visible: one GPU, shared by 2
    assert [gpu_of(w, 6, 3, ["4", "5"]) for w in range(6)] == ["4", "5", "4", "5", "4", "5"]
    assert [gpu_of(w, 3, 3, ["7"]) for w in range(3)] == ["7", "7", "7"]
    assert [gpu_of(w, 2, 1, ["0", "1", "2"]) for w in range(2)] == ["0", "1"]
    with pytest.raises(ValueError, match="6 decoding workers, 2 a GPU, need 3 GPU"):
        gpu_of(0, 6, 2, ["0", "1"])
    settings = EvaluateSettings.from_config(evaluate={"workers_per_gpu": 3})
    assert settings.evaluate.workers_per_gpu == 3 and EvaluateSettings.from_config().evaluate.workers_per_gpu == 1


def test_report_md_says_when_processes_shared_a_gpu():
    """A report decoded by processes sharing a GPU says in report.md that its tokens/s are no speed figures."""
    from pathlib import Path

    from draftsmith.evaluate.report import render_markdown

    report = json.loads((Path(__file__).resolve().parents[1] / "docs" / "peers" / "recipe-gpu-2026-12-05"
                         / "d2-selgrad-kl" / "report.json").read_text())  # a real H200 report
    assert "sharing each GPU" not in render_markdown(report)
    report["run"].update(decoding_workers=6, workers_per_gpu=3)
    assert ("- **decoded by 6 processes, 3 sharing each GPU (evaluate.workers_per_gpu): τ and the lossless check are "
            "one process's; tokens/s and speedups were measured on a shared GPU and are no speed figures**"
            in render_markdown(report))


def test_conversations_are_dealt_to_workers_by_the_tokens_they_may_decode():
    """deal_conversations: every conversation to exactly one worker (one shared by two sets too), longest first to
    the least-loaded worker, so the workers' costs (turns x max_new_tokens) differ by at most one conversation's;
    the same deal from every process and rerun. The hash it replaced dealt the gpu-proof sets 33 / 29 / 20."""
    from draftsmith.evaluate.prompts import BenchmarkSet, Conversation
    from draftsmith.evaluate.workers import deal_conversations

    def conv(i, turns=1):
        return Conversation(id=f"r{i}", source="s", context=[], user_turns=[[{"role": "user", "content": "q"}]] * turns)

    heldout = BenchmarkSet("heldout", "heldout", 40, 256, [conv(i) for i in range(40)])
    mtbench = BenchmarkSet("mtbench", "mtbench", 16, 256, [conv(100 + i, turns=2) for i in range(16)])
    mmath = BenchmarkSet("mmath", "mmath", 6, 512, [conv(i) for i in (1, 2)] + [conv(200 + i) for i in range(4)])
    sets = [heldout, mtbench, mmath]
    cost = {c.id: 0 for b in sets for c in b.conversations}
    for b in sets:
        for c in b.conversations:
            cost[c.id] = max(cost[c.id], len(c.user_turns) * b.max_new_tokens)
    for workers in (1, 2, 3, 8):
        deal = deal_conversations(sets, workers)
        assert set(deal) == set(cost) and set(deal.values()) == set(range(workers))
        load = [sum(cost[c] for c, w in deal.items() if w == k) for k in range(workers)]
        assert sum(load) == sum(cost.values()) == 38 * 256 + 16 * 2 * 256 + 6 * 512  # r1, r2 at mmath's 512
        assert max(load) - min(load) <= max(cost.values()), (workers, load)
        assert deal == deal_conversations([mmath, mtbench, heldout], workers)  # the order of the sets: the same deal
    assert [sum(1 for w in deal_conversations(sets, 3).values() if w == k) for k in range(3)] == [20, 20, 20]


def test_two_decoding_workers_report_what_one_process_reports(stage_inputs, tmp_path):
    """evaluate.gpus > 1 runs one decoding worker per GPU (``python -m draftsmith.evaluate.worker``), each
    with the conversations deal_conversations gives it (here the MT-Bench pair, 2 x 16 tokens, on worker 0, c1 and
    c2, 24 tokens each, on worker 1: worker 0 has nothing of the held-out set); the merged report equals one
    process's, timings aside, prompt for prompt in the sets' order; a rerun after the workers finished reuses their
    files."""
    one = run_evaluate(**_stage_kwargs(stage_inputs, tmp_path / "one"), workers=1)
    two = run_evaluate(**_stage_kwargs(stage_inputs, tmp_path / "two"), workers=2)
    assert two["run"]["decoding_workers"] == 2 and one["run"]["decoding_workers"] == 1
    one["run"].pop("decoding_workers"), two["run"].pop("decoding_workers")
    assert _differences(_without_timings(two), _without_timings(one)) == []
    assert two["sets"]["heldout"]["prompts"] == 2 and two["overall"]["prompts"] == 4
    assert not (tmp_path / "two" / "partial").exists()



@pytest.mark.slow
def test_killed_evaluate_resumes_inside_a_set_and_with_other_worker_counts(stage_inputs, tmp_path, monkeypatch,
                                                                          caplog):
    """Conversations are saved as they are decoded (evaluate.checkpoint_interval): a job killed inside a set
    resumes at its first unsaved conversation, also when rerun with another number of decoding workers; a rerun
    with everything saved loads no target and starts no worker; every report equals an uninterrupted run's, timings
    aside."""
    import draftsmith.evaluate.decoders as decoders_mod
    import draftsmith.evaluate.run as run_mod
    import draftsmith.target

    reference = run_evaluate(**_stage_kwargs(stage_inputs, tmp_path / "ref"))
    out = tmp_path / "out"
    kwargs = _stage_kwargs(stage_inputs, out, checkpoint_interval=1e-6)
    calls = []
    real_generate = decoders_mod.target_generate

    def killing_generate(*a, **k):
        calls.append(1)
        if kill_at and len(calls) == kill_at:
            raise KeyboardInterrupt("killed")
        return real_generate(*a, **k)

    monkeypatch.setattr(decoders_mod, "target_generate", killing_generate)
    # target_generate runs twice per prompt (target-only, the lossless reference at the verify width: float32 CPU
    # runs the dynamic path, so once) + the warm-up: call 1 warm-up, 2 = c1, 3 = c2 (killed)
    kill_at = 3
    with pytest.raises(KeyboardInterrupt):
        run_evaluate(**kwargs)
    saved = json.loads((out / "partial" / "heldout" / "main.json").read_text())
    assert list(saved["conversations"]) == ["c1"]  # saved before c2 started, though the set was not finished

    # resumed by 2 workers: c1 is not decoded again (c2 and the MT-Bench pair are), the report is the same
    kill_at = None
    resumed = run_evaluate(**kwargs, workers=2)
    for report in (resumed, reference):
        report["run"].pop("decoding_workers")
    assert _differences(_without_timings(resumed), _without_timings(reference)) == []
    assert not (out / "partial").exists()

    # killed after every conversation was saved (while plotting): the rerun needs no target and no worker
    monkeypatch.setattr(run_mod, "plot_tau", lambda *a: (_ for _ in ()).throw(KeyboardInterrupt("killed")))
    with pytest.raises(KeyboardInterrupt):
        run_evaluate(**_stage_kwargs(stage_inputs, tmp_path / "late"))
    monkeypatch.undo()
    monkeypatch.setattr(draftsmith.target, "load_target", lambda *a, **k: pytest.fail("the target was loaded"))
    with caplog.at_level("INFO", logger="draftsmith.evaluate"):
        late = run_evaluate(**_stage_kwargs(stage_inputs, tmp_path / "late"), workers=2)
    assert "every conversation was saved by an earlier run: no decoding worker started" in caplog.text
    late["run"].pop("decoding_workers")
    assert _differences(_without_timings(late), _without_timings(reference)) == []


def test_saved_conversations_from_other_inputs_are_decoded_again(tmp_path, caplog):
    """A saved file with another key (other drafter, sampling, set...) or one that is not JSON is logged and its
    conversations decoded again, never mixed into the report."""
    from draftsmith.evaluate.resume import load_saved

    folder = tmp_path / "heldout"
    folder.mkdir()
    (folder / "main.json").write_text(json.dumps({"key": "other", "conversations": {"c1": {}}}))
    (folder / "worker-0-of-2.json").write_text('{"key": "k", "conversations": {"c2": {"labels": []}}')  # cut short
    (folder / "worker-1-of-2.json").write_text(json.dumps({"key": "k", "conversations": {"c3": {"labels": []}}}))
    with caplog.at_level("INFO", logger="draftsmith.evaluate"):
        assert load_saved(tmp_path, "heldout", "k") == {"c3": {"labels": []}}
    assert "main.json was computed with other inputs" in caplog.text
    assert "worker-0-of-2.json is not valid JSON" in caplog.text


@pytest.mark.slow
def test_prompt_in_two_sets_is_decoded_once_and_counted_once(stage_inputs, tmp_path, monkeypatch):
    """The held-out rows of a split: both source are also the rows of a set on that source (as the default's
    BFCL / MMATH sets are): each such prompt is decoded once, reported in both sets, and counted once in the
    "all" row."""
    import draftsmith.evaluate.decoders as decoders_mod

    calls = []
    real_generate = decoders_mod.target_generate
    monkeypatch.setattr(decoders_mod, "target_generate", lambda *a, **k: calls.append(1) or real_generate(*a, **k))
    kwargs = _stage_kwargs(stage_inputs, tmp_path,
                           sets={"heldout": {"source": "heldout", "max_prompts": 3, "max_new_tokens": 24},
                                 "chat": {"source": "chat", "max_prompts": 3, "max_new_tokens": 24}})
    report = run_evaluate(**kwargs)
    held, chat = report["sets"]["heldout"], report["sets"]["chat"]
    assert held["prompts"] == chat["prompts"] == 2  # c1, c2 (c3's prompt is too long)
    assert [p["prompt_key"] for p in held["per_prompt"]] == [p["prompt_key"] for p in chat["per_prompt"]]
    assert len(calls) == 1 + 2  # warm-up + each prompt once
    assert held["dflash"] == chat["dflash"]
    o = report["overall"]
    assert o["prompts"] == 2 and o["prompts_in_several_sets"] == 2 and o["conversations"] == 2
    assert o["target_only"]["tokens"] == held["target_only"]["tokens"]
    assert o["dflash"]["steps"] == held["dflash"]["steps"] and o["dflash"]["tau"] == held["dflash"]["tau"]
    assert "2 prompt(s) sit in more than one set" in (tmp_path / "report.md").read_text()


def test_drafter_target_mismatch_is_refused(stage_inputs, tmp_path):
    from draftsmith.evaluate import check_pair, load_drafter

    tgt = tiny_target("llama", num_hidden_layers=6)
    drafter = load_drafter(stage_inputs["drafter"], device="cpu", dtype=torch.float32)
    with pytest.raises(ValueError, match="num_target_layers=4"):
        check_pair(drafter, tgt)
    assert drafter.block_size == BLOCK and drafter.target_layer_ids == [1, 2]


def test_exported_drafter_loads_in_both_implementations(stage_inputs, official):
    """The exported folder decodes identically through draftsmith's and the official drafter class."""
    from draftsmith.evaluate import load_drafter
    from draftsmith.target import load_target

    tgt = load_target(stage_inputs["target"], dtype="float32", device="cpu")
    ids = prompt(6)
    runs = []
    for impl in ("draftsmith", "dflash"):
        drafter = load_drafter(stage_inputs["drafter"], device="cpu", dtype=torch.float32, implementation=impl)
        assert drafter.target_layer_ids == [1, 2] and drafter.block_size == BLOCK
        runs.append(speculative_generate(tgt, DFlashProposer(drafter, tgt), ids, max_new_tokens=24))
    assert runs[0].tokens == runs[1].tokens == target_generate(tgt, ids, max_new_tokens=24).tokens
    assert runs[0].committed == runs[1].committed


def test_evaluate_stage_with_the_official_drafter_class(stage_inputs, official, tmp_path):
    """evaluate with ``drafter_implementation: dflash`` (the official class) reports what draftsmith's class
    reports, timings aside: the block size, target layer ids and mask token the stage reads from config.json before
    loading anything agree with what the official class loads."""
    one = run_evaluate(**_stage_kwargs(stage_inputs, tmp_path / "ours"))
    two = run_evaluate(**_stage_kwargs(stage_inputs, tmp_path / "official"), drafter_implementation="dflash")
    assert two["run"].pop("drafter_implementation") == "dflash"
    one["run"].pop("drafter_implementation")
    assert _differences(_without_timings(two), _without_timings(one)) == []
    assert two["run"]["block_size"] == BLOCK and two["run"]["target_layer_ids"] == [1, 2]


def test_evaluate_stage_decodes_a_dflash2_drafter_in_both_implementations(stage_inputs, official, tmp_path):
    """evaluate decodes an exported DFlash2 drafter with its candidate selector, losslessly, with per-position
    acceptance; the report names the architecture; the official class reports the same figures."""
    from draftsmith.modeling_dflash2 import DFlash2DraftModel

    tgt = tiny_target("llama", max_position_embeddings=256)
    cfg = build_drafter_config(tgt.config, num_layers=1, block_size=BLOCK, target_layer_ids=[1, 2],
                               mask_token_id=MASK, architecture="dflash2", conv_group_size=16, selector_rank=8,
                               selector_top_k=4)
    torch.manual_seed(2)
    drafter = DFlash2DraftModel(cfg)
    with torch.no_grad():  # away from the identity / near-zero initialisation: every module drafts
        for name, param in drafter.named_parameters():
            if "_conv." in name or "candidate_selector" in name:
                param.add_(0.3 * torch.randn_like(param))
    drafter.save_pretrained(tmp_path / "drafter2")
    inputs = dict(stage_inputs, drafter=str(tmp_path / "drafter2"))
    one = run_evaluate(**_stage_kwargs(inputs, tmp_path / "ours"))
    assert one["run"]["drafter_architecture"] == "DFlash2DraftModel"
    md = (tmp_path / "ours" / "report.md").read_text()
    assert md.startswith("# draftsmith evaluation: speculative decoding with the DFlash2 drafter")
    assert "| DFlash2 τ | DFlash2 tok/s | DFlash2 speedup |" in md and "DFlash τ" not in md
    assert "## Per-position acceptance (DFlash2)" in md and "## Acceptance-length histogram (DFlash2)" in md
    for s in one["sets"].values():
        assert s["lossless"]["dflash"]["lossless"] and len(s["dflash"]["per_position"]) == BLOCK - 1
        assert s["target_only"]["tokens"] == s["dflash"]["tokens"]
    two = run_evaluate(**_stage_kwargs(inputs, tmp_path / "official"), drafter_implementation="dflash")
    two["run"].pop("drafter_implementation")
    one["run"].pop("drafter_implementation")
    assert _differences(_without_timings(two), _without_timings(one)) == []

    # the two architectures compared on the same prompts (python -m draftsmith.evaluate.compare)
    from draftsmith.evaluate.compare import main as compare_main

    run_evaluate(**_stage_kwargs(stage_inputs, tmp_path / "dflash"))
    assert compare_main([str(tmp_path / "dflash" / "report.json"), str(tmp_path / "ours" / "report.json"),
                         "--names", "dflash,dflash2", "--json", str(tmp_path / "cmp.json"),
                         "--md", str(tmp_path / "cmp.md")]) == 0
    cmp = json.loads((tmp_path / "cmp.json").read_text())
    base = json.loads((tmp_path / "dflash" / "report.json").read_text())
    assert list(cmp["sets"]) == ["heldout", "mtbench", "all"]
    for name, s in cmp["sets"].items():
        new_set = one["overall"] if name == "all" else one["sets"][name]
        old_set = base["overall"] if name == "all" else base["sets"][name]
        paired = s["paired"]
        # greedy and lossless: the same target answers, so every prompt pairs, and the paired τ is each set's own
        assert paired["matched"] == new_set["prompts"] and paired["base_only"] == paired["new_only"] == 0
        assert paired["tau"]["new"] == pytest.approx(new_set["dflash"]["tau"])
        assert paired["tau"]["base"] == pytest.approx(old_set["dflash"]["tau"])
        assert s["tau_ratio"] == pytest.approx(new_set["dflash"]["tau"] / old_set["dflash"]["tau"])
        assert paired["tau"]["ratio"] == pytest.approx(s["tau_ratio"])
        assert paired["tokens_per_s"]["new"] == pytest.approx(new_set["dflash"]["tokens_per_s"])
        assert paired["tau"]["ratio_low"] <= paired["tau"]["ratio"] <= paired["tau"]["ratio_high"]
    assert "| heldout | 2 (0, 0) |" in (tmp_path / "cmp.md").read_text()


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_static_drafter_drafts_what_the_dynamic_cache_drafts(kind):
    """The static drafter (fixed K/V buffers, context rows written in chunks of B, padded rows overwritten by the
    block; CUDA graphs on a GPU) gives the dynamic-cache drafter's draft distribution at every step, whatever
    number of positions was committed in between (1..B), for a prompt longer than two blocks, full and shorter
    blocks, and across prompts on one set of buffers. A drafter that overrides forward is refused."""
    from draftsmith.evaluate.static import StaticDrafter, StaticTarget

    tgt = target(kind) if kind == "llama" else tiny_target("qwen3", initializer_range=0.1)
    drafter = make_drafter(tgt, seed=7)
    sampling = SamplingConfig(temperature=1.0)
    for seed, length in ((1, 21), (2, 5)):
        ids = prompt(seed, length)
        full = torch.cat([ids[0], torch.tensor(target_generate(tgt, ids, max_new_tokens=40).tokens)])
        _, feats = StaticTarget(tgt, full.numel() + 1, layer_ids=[1, 2], cuda_graphs=False).prefill(full[None])
        dyn, sta = DFlashProposer(drafter, tgt), DFlashProposer(drafter, tgt)
        assert sta.use_static(64, cuda_graphs=False)
        start = ids.shape[1]
        for proposer in (dyn, sta):
            proposer.reset(ids, feats[:, :start])
        for committed, drafts in ((1, BLOCK - 1), (3, BLOCK - 1), (BLOCK, BLOCK - 1), (2, 4), (5, BLOCK - 1),
                                  (7, 2), (1, BLOCK - 1)):
            got = {}
            for name, proposer in (("dynamic", dyn), ("static", sta)):
                with torch.inference_mode():
                    got[name] = proposer.propose(full, start, drafts, sampling, torch.Generator().manual_seed(start))
            assert torch.equal(got["dynamic"][0], got["static"][0]), (kind, seed, start)
            torch.testing.assert_close(got["static"][1], got["dynamic"][1], rtol=0, atol=1e-6)
            assert got["static"][1].shape == (drafts, tgt.config.vocab_size)
            start += committed
            for proposer in (dyn, sta):
                proposer.commit(feats[:, start - committed:start])
    ok, why = StaticDrafter.supported(build_oracle(DFlashDraftModel, tgt, full))
    assert not ok and "overrides forward" in why
    with pytest.raises(ValueError, match="exceeds the drafter's static buffers"):
        sta.static.logits(feats[:, :1], full[0], 64, BLOCK)


def test_static_drafter_decodes_as_the_dynamic_path():
    """End to end on the static target: DFlash decoding with the static drafter commits the same tokens, in the
    same steps, as with the dynamic-cache drafter, and equals target-only decoding."""
    from draftsmith.evaluate.static import StaticTarget

    tgt = tiny_target("qwen3", initializer_range=0.1)
    static = StaticTarget(tgt, 20 + 40 + BLOCK + 1, layer_ids=[1, 2], cuda_graphs=False, verify_width=BLOCK)
    for seed in (1, 2, 3):
        ids = prompt(seed, 20)
        ref = target_generate(tgt, ids, max_new_tokens=40)
        dyn = speculative_generate(tgt, DFlashProposer(make_drafter(tgt, seed=seed), tgt), ids, max_new_tokens=40,
                                   static=static)
        fast = DFlashProposer(make_drafter(tgt, seed=seed), tgt)
        assert fast.use_static(static.max_length, cuda_graphs=False)
        sta = speculative_generate(tgt, fast, ids, max_new_tokens=40, static=static)
        assert sta.tokens == dyn.tokens == ref.tokens
        assert (sta.committed, sta.accepted, sta.proposed) == (dyn.committed, dyn.accepted, dyn.proposed)


def test_decoding_workers_append_to_the_job_log(stage_inputs, tmp_path):
    """The workers' lines and the job's own, before and after them, all stay in the job's log file (the job
    opened it for writing: without reopening it to append, its next line would overwrite the workers')."""
    import logging

    from draftsmith.io import setup_logging

    log_file = tmp_path / "evaluate.log"
    setup_logging(log_file)
    try:
        logging.getLogger("draftsmith").info("the job starts")
        run_evaluate(**_stage_kwargs(stage_inputs, tmp_path / "out"), workers=2)
        logging.getLogger("draftsmith").info("the job ends")
    finally:
        setup_logging(None)
    text = log_file.read_text()
    lines = [line for line in text.splitlines() if "evaluate worker" in line and "100%" in line]
    assert "the job starts" in text and "the job ends" in text and "2 decoding workers started" in text
    assert {line.split("evaluate worker ")[1][0] for line in lines} == {"0", "1"}


def test_progress_lines_come_every_interval_with_the_tokens_decoded(stage_inputs, tmp_path, monkeypatch, caplog):
    """A slow target (every forward sleeps 0.1 s) decoding one held-out prompt three ways (~7 s): a progress line at
    least every second (evaluate.progress_interval 1 s), the tokens decoded of the prompt in flight counted and
    rising before it is done, with an ETA (issue 34: evaluate went 293 s without a line)."""
    import re

    from transformers import LlamaForCausalLM

    real_forward = LlamaForCausalLM.forward

    def slow_forward(self, *args, **kwargs):
        time.sleep(0.1)
        return real_forward(self, *args, **kwargs)

    monkeypatch.setattr(LlamaForCausalLM, "forward", slow_forward)
    kwargs = _stage_kwargs(stage_inputs, tmp_path, progress_interval=1.0,
                           sets={"heldout": {"source": "heldout", "max_prompts": 1, "max_new_tokens": 24}})
    t0 = time.time()
    with caplog.at_level("INFO", logger="draftsmith"):
        report = run_evaluate(**kwargs)
    lines = progress_lines(caplog.records, "evaluate", t0)
    assert_steady(lines, 1.0, lines[-1][0])  # to the bar's last line (then the report and plots are written)
    in_flight = [line for _, line in lines if line.startswith("evaluate: 0/1 prompt") and "tok decoded" in line]
    assert len(in_flight) >= 2, lines
    tokens = [int(re.search(r", ([\d,]+) tok decoded,", line).group(1).replace(",", "")) for line in in_flight]
    assert tokens[0] > 0 and tokens == sorted(tokens) and tokens[-1] > tokens[0], in_flight
    assert "ETA ?" not in in_flight[-1] and "set heldout c1#0" in in_flight[-1], in_flight[-1]
    assert lines[-1][1].startswith("evaluate: 1/1 prompt")
    # the last line counts every token of the three decodings (greedy and lossless: each as long as target-only's)
    final = int(re.search(r", ([\d,]+) tok decoded,", lines[-1][1]).group(1).replace(",", ""))
    assert final == 3 * report["sets"]["heldout"]["per_prompt"][0]["new_tokens"] > tokens[-1]


def test_a_failed_evaluation_stops_its_progress_heartbeat(stage_inputs, tmp_path, monkeypatch):
    """An evaluation that raises while decoding closes its progress bar: the heartbeat thread that prints a line
    every ``progress_interval`` stops (it was left logging a stale "2/4 prompt" line on into whatever ran next)."""
    import threading

    import draftsmith.evaluate.run as evaluate_run

    def failing_decode_set(*args, **kwargs):
        time.sleep(0.3)  # a heartbeat or two (interval 0.1 s)
        raise RuntimeError("decoding failed")

    monkeypatch.setattr(evaluate_run, "decode_set", failing_decode_set)
    kwargs = _stage_kwargs(stage_inputs, tmp_path, progress_interval=0.1,
                           sets={"heldout": {"source": "heldout", "max_prompts": 1, "max_new_tokens": 4}})
    with pytest.raises(RuntimeError, match="decoding failed"):
        run_evaluate(**kwargs)
    assert [t.name for t in threading.enumerate() if t.name == "progress evaluate"] == []


def test_every_plot_shows_its_sample_sizes():
    """Each evaluation figure names, for every set, the prompts it stands on (τ bars: under the set's name; the
    per-position lines and the histogram: in the legend, with the DFlash verify steps they count)."""
    import matplotlib.text

    from draftsmith.evaluate.report import histogram_figure, per_position_figure, tau_figure

    def set_entry(prompts, steps):
        return {"prompts": prompts, "dflash": {"tau": 1.4, "speedup": 0.8, "per_position": [0.3, 0.1, None],
                                               "acceptance_histogram": [steps - 3, 2, 1], "steps": steps},
                "prompt_lookup": {"tau": 1.5, "speedup": 1.1}}

    report = {"run": {"drafter_architecture": "DFlashDraftModel"},
              "sets": {"heldout": set_entry(12, 340), "mtbench": set_entry(2, 57)}}
    for build in (tau_figure, per_position_figure, histogram_figure):
        fig = build(report)
        texts = " | ".join(t.get_text() for t in fig.findobj(matplotlib.text.Text))
        assert "n=12 prompts" in texts and "n=2 prompts" in texts, (build.__name__, texts)
        if build is not tau_figure:
            assert "heldout (n=12 prompts, 340 steps)" in texts and "mtbench (n=2 prompts, 57 steps)" in texts


# ------------------------------------------------------------------------------------------------
# The target's own MTP head (Qwen3.5 / Qwen3-Next checkpoints' mtp.* tensors)
# ------------------------------------------------------------------------------------------------

def _mtp_drafter_class():
    """An :class:`~draftsmith.evaluate.mtp.MTPDrafter` that records, per drafting call, the head's argmax at every
    step (``calls``: ``{"start", "argmax", "chosen"}``; eager runs only), and optionally forces its drafts: the
    target's own continuation ``reference [T]`` with the positions where ``wrong [T]`` is true made wrong (graph-safe
    tensor ops, so the forced drafts also run inside a captured CUDA graph). The head's real forwards and K/V cache
    run either way: forcing only decides which tokens the next steps and the target see."""
    from draftsmith.evaluate.mtp import MTPDrafter

    class Recording(MTPDrafter):
        reference = None
        wrong = None
        record = True

        def draft(self, hidden, tokens, start, k):
            if self.record:
                self.calls.append({"start": start + hidden.shape[1], "argmax": [], "chosen": []})
            return super().draft(hidden, tokens, start, k)

        def _select(self, logits, position):
            best = torch.argmax(logits, dim=-1)
            token = best
            if self.reference is not None:
                at = (position + 2).clamp(max=self.reference.shape[0] - 1)
                token = torch.where(self.wrong[at], (self.reference[at] + 1) % (MASK - 3) + 3, self.reference[at])
            if self.record:
                self.calls[-1]["argmax"].append(int(best.item()))
                self.calls[-1]["chosen"].append(int(token.item()))
            return token

    return Recording


_MTP: dict = {}


def mtp_target(kind: str, tmp_path_factory):
    """``(target, folder, mtp.* tensors)``: a tiny hybrid target (std-0.1 weights, a random final norm: with Qwen3.5's
    zero-initialised ``1 + w`` norm the pre-norm and post-norm states would look alike to the head) saved with a random
    MTP head in its safetensors (Qwen3-Next: per-expert tensors in their own shard, as its checkpoints hold them)."""
    from tiny import add_mtp_weights, randomize_final_norm

    if kind not in _MTP:
        tgt = randomize_final_norm(tiny_target(kind, initializer_range=0.1, max_position_embeddings=256))
        folder = tmp_path_factory.mktemp(f"mtp-{kind}")
        tgt.save_pretrained(folder)
        tensors = add_mtp_weights(folder, seed=5, std=0.1, sharded=kind == "qwen3_next")
        _MTP[kind] = (tgt, folder, tensors)
    return _MTP[kind]


def _mtp_proposer(tgt, folder, k, reference=None, wrong_every=None, device=None):
    from draftsmith.evaluate.mtp import MTPProposer, load_mtp_head

    drafter = _mtp_drafter_class()(load_mtp_head(folder, tgt), tgt, cuda_graphs=device is not None)
    drafter.calls = []
    drafter.record = device is None
    if reference is not None:
        drafter.reference = reference
        positions = torch.arange(reference.shape[0], device=reference.device)
        drafter.wrong = (positions % wrong_every == wrong_every - 1) if wrong_every else positions < 0
    return MTPProposer(drafter, k)


def _gemma_rms(x, weight, eps):
    """Qwen3.5's RMSNorm written out: x / rms(x) * (1 + w), in float32."""
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + weight.float())


@torch.no_grad()
def reference_mtp_argmax(tgt, mtp: dict, layer, committed: torch.Tensor, chosen: list[int], k: int) -> list[int]:
    """The published algorithm (vLLM ``qwen3_5_mtp.py`` and its EAGLE / MTP proposer), slow and without a cache: the
    head's argmax at each of ``k`` steps after the committed tokens ``x_0 .. x_s`` (``committed [s + 1]``; the target
    has consumed ``x_0 .. x_{s-1}``), the later steps fed the tokens ``chosen`` (the drafts, or forced ones).

    The target's states after its final norm ``h_0 .. h_{s-1}`` (``model.model(...).last_hidden_state``); row i =
    ``fc(cat[norm_e(embed(x_{i+1})), norm_h(h_i)])`` at rotary position i; every step recomputes the whole causal
    sequence of rows from scratch through transformers' own ``Qwen3_5DecoderLayer`` (no cache, no mask: causal), takes
    the last row's output after ``mtp.norm``, its LM-head argmax is the step's draft, and the next row pairs that
    output with the chosen token."""
    eps = tgt.config.rms_norm_eps
    s = committed.shape[0] - 1
    states = tgt.model(input_ids=committed[None, :s]).last_hidden_state[0]  # [s, H], after the final norm
    embed = tgt.get_input_embeddings().weight
    hidden, tokens, out = list(states), list(committed[1:s + 1]), []
    for step in range(k):
        rows = torch.cat([_gemma_rms(embed[torch.stack(tokens)], mtp["mtp.pre_fc_norm_embedding.weight"], eps),
                          _gemma_rms(torch.stack(hidden), mtp["mtp.pre_fc_norm_hidden.weight"], eps)], dim=-1)
        x = torch.nn.functional.linear(rows, mtp["mtp.fc.weight"])[None]
        positions = torch.arange(x.shape[1])[None]
        cos, sin = tgt.model.rotary_emb(x, positions[None].expand(3, 1, -1))  # M-RoPE: three equal text rows
        y = layer(x, position_embeddings=(cos, sin), attention_mask=None, position_ids=positions)
        last = _gemma_rms(y[0, -1], mtp["mtp.norm.weight"], eps)
        out.append(int(torch.argmax(tgt.lm_head(last))))
        hidden.append(last)
        tokens.append(torch.tensor(chosen[step]) if step < len(chosen) else None)
    return out


def _reference_layer(tgt, mtp: dict):
    """transformers' ``Qwen3_5DecoderLayer`` (full attention, its gated ``q_proj``) holding ``mtp.layers.0.*``."""
    import copy

    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer

    cfg = copy.deepcopy(tgt.config)
    cfg.layer_types, cfg.num_hidden_layers = ["full_attention"], 1
    layer = Qwen3_5DecoderLayer(cfg, 0).eval()
    layer.load_state_dict({n[len("mtp.layers.0."):]: t for n, t in mtp.items() if n.startswith("mtp.layers.0.")})
    return layer


def _assert_drafts_follow_the_reference(tgt, mtp, proposer, full: torch.Tensor, k: int) -> int:
    layer = _reference_layer(tgt, mtp)
    calls = proposer.drafter.calls
    assert calls
    for call in calls:
        start = call["start"]
        want = reference_mtp_argmax(tgt, mtp, layer, full[:start + 1], call["chosen"][:-1], k)
        assert call["argmax"] == want, f"k={k}, draft after position {start}: {call['argmax']} != reference {want}"
    return len(calls)


@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_next"])
def test_mtp_greedy_decoding_is_lossless(kind, tmp_path_factory):
    """Greedy speculative decoding with the target's MTP head (1-3 drafts a step; its own random drafts, and drafts
    forced to the target's continuation with every 3rd / 4th position wrong: full, partial and no acceptance) equals
    target-only decoding token for token, on the dynamic cache and on the static path (one StaticTarget tapping
    DFlash's layers and the last one; CPU: no graphs); the static path's τ and counts equal the dynamic path's."""
    from draftsmith.evaluate.static import StaticTarget

    tgt, folder, _ = mtp_target(kind, tmp_path_factory)
    new = 24 if kind == "qwen3_next" else 40
    ids = prompt(1)
    ref = target_generate(tgt, ids, max_new_tokens=new)
    full = torch.cat([ids[0], torch.tensor(ref.tokens)])
    L = tgt.config.num_hidden_layers
    static = StaticTarget(tgt, 12 + new + BLOCK + 1, layer_ids=[1, 2, L - 1], cuda_graphs=False, verify_width=BLOCK)
    for k in (1, 2, 3):
        accepted = set()
        for forced in (None, 3, 4):
            dyn = speculative_generate(tgt, _mtp_proposer(tgt, folder, k, full if forced else None, forced), ids,
                                       max_new_tokens=new)
            sta = speculative_generate(tgt, _mtp_proposer(tgt, folder, k, full if forced else None, forced), ids,
                                       max_new_tokens=new, static=static)
            assert dyn.tokens == ref.tokens == sta.tokens, (kind, k, forced)
            assert (sta.committed, sta.accepted, sta.proposed) == (dyn.committed, dyn.accepted, dyn.proposed)
            assert max(dyn.proposed) == k and set(dyn.proposed[:-2]) == {k}
            accepted |= set(dyn.accepted[:-1])
        assert accepted == set(range(k + 1)), (k, accepted)  # every acceptance length, 0 .. k
    # the DFlash drafter beside it on the same static target: its own columns of the shared features
    out = speculative_generate(tgt, DFlashProposer(make_drafter(tgt, seed=3), tgt), ids, max_new_tokens=new,
                               static=static)
    assert out.tokens == ref.tokens


def test_mtp_drafts_equal_the_published_algorithm(tmp_path_factory):
    """After every verify step (accepted, partly accepted and rejected drafts, so the head's cache gets 1..k+1 new
    rows a step and its speculative entries are overwritten), the head's argmax at every draft step equals a slow
    cache-free recomputation of the published algorithm (:func:`reference_mtp_argmax`: post-norm target states,
    embedding first, recursive drafts on the head's own normed output, transformers' Qwen3.5 layer), with its own
    drafts and with forced ones, on the dynamic and the static target path."""
    from draftsmith.evaluate.static import StaticTarget

    tgt, folder, mtp = mtp_target("qwen3_5", tmp_path_factory)
    ids = prompt(2)
    ref = target_generate(tgt, ids, max_new_tokens=30)
    full = torch.cat([ids[0], torch.tensor(ref.tokens)])
    static = StaticTarget(tgt, 12 + 30 + BLOCK + 1, layer_ids=[3], cuda_graphs=False, verify_width=BLOCK)
    checked = 0
    for k, forced, path in ((1, None, None), (3, None, static), (2, 3, None), (3, 4, static), (3, 5, None)):
        proposer = _mtp_proposer(tgt, folder, k, full if forced else None, forced)
        out = speculative_generate(tgt, proposer, ids, max_new_tokens=30, static=path)
        assert out.tokens == ref.tokens
        checked += _assert_drafts_follow_the_reference(tgt, mtp, proposer, full, k)
    assert checked > 40


def test_mtp_fed_the_pre_norm_state_drafts_something_else(tmp_path_factory, monkeypatch):
    """Control for the test above: feeding the head the target's last layer before its final norm (the classic
    silent bug: it never fails, it only lowers acceptance) changes its drafts, so the reference comparison catches
    it; decoding stays lossless, as it would in an engine."""
    import draftsmith.target as target_mod

    tgt, folder, mtp = mtp_target("qwen3_5", tmp_path_factory)
    ids = prompt(2)
    ref = target_generate(tgt, ids, max_new_tokens=20)
    full = torch.cat([ids[0], torch.tensor(ref.tokens)])
    monkeypatch.setattr(target_mod, "final_norm", lambda model: torch.nn.Identity())  # LayerCapture: pre-norm
    proposer = _mtp_proposer(tgt, folder, 2, full, 3)
    assert speculative_generate(tgt, proposer, ids, max_new_tokens=20).tokens == ref.tokens
    with pytest.raises(AssertionError, match="!= reference"):
        _assert_drafts_follow_the_reference(tgt, mtp, proposer, full, 2)


def test_mtp_tau_equals_the_per_position_counts(tmp_path_factory):
    """The MTP rows' τ reconciles with their per-position acceptance (τ = 1 + Σ_k hits_k / steps), on runs with a
    stop token and a token budget ending inside a step; the histogram counts every verify step."""
    tgt, folder, _ = mtp_target("qwen3_5", tmp_path_factory)
    ids = prompt(1)
    free = target_generate(tgt, ids, max_new_tokens=40)
    full = torch.cat([ids[0], torch.tensor(free.tokens)])
    stop = next(t for i, t in enumerate(free.tokens[8:], 8) if t not in free.tokens[:i])
    for k in (1, 2, 3):
        runs = [speculative_generate(tgt, _mtp_proposer(tgt, folder, k, full, 4), ids, max_new_tokens=40,
                                     stop_token_ids=[stop]),
                speculative_generate(tgt, _mtp_proposer(tgt, folder, k, full, 3), ids, max_new_tokens=13)]
        m = summarize(runs, max_block=k + 1)
        assert m["tau"] == pytest.approx(1 + sum(m["per_position_hits"]) / m["steps"])
        assert len(m["per_position"]) == k and sum(m["acceptance_histogram"]) == m["steps"]
        assert m["tau"] > 1.0
        for run in runs:
            for p, a, c in zip(run.proposed, run.accepted, run.committed):
                assert 1 + step_slots(p, a, c)[1] == c


def test_mtp_tensor_set_is_checked_exactly(tmp_path):
    """The checkpoint's mtp.* set must be exactly the head's: a target without mtp.* tensors has no MTP head (the
    reason says so), a missing tensor is refused by name, an extra or misshapen one too; the shapes are a real
    checkpoint's (Qwen3.5's gated q_proj: 2 x heads x head_dim rows; fc [H, 2H]); a sharded checkpoint with an index
    (the tensors in their own shard) loads; transformers still loads the target, ignoring mtp.*."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    from draftsmith.evaluate.mtp import load_mtp_head, mtp_status
    from tiny import add_mtp_weights

    tgt = tiny_target("qwen3_5", initializer_range=0.1)
    plain = tmp_path / "plain"
    tgt.save_pretrained(plain)
    status = mtp_status(plain)
    assert not status.available and "no mtp.* tensors" in status.reason

    good = tmp_path / "good"
    tgt.save_pretrained(good)
    tensors = add_mtp_weights(good, sharded=True)
    cfg = tgt.config
    assert tensors["mtp.fc.weight"].shape == (cfg.hidden_size, 2 * cfg.hidden_size)
    assert tensors["mtp.layers.0.self_attn.q_proj.weight"].shape == (2 * cfg.num_attention_heads * cfg.head_dim,
                                                                     cfg.hidden_size)
    assert len(tensors) == 15  # as Qwen3.6-27B's checkpoint: 15 mtp.* tensors
    status = mtp_status(good)
    assert status.available and status.num_layers == 1 and status.tensors == 15
    head = load_mtp_head(good, tgt)
    assert torch.equal(head.fc.weight, tensors["mtp.fc.weight"])
    assert torch.equal(head.layers[0].self_attn.q_proj.weight, tensors["mtp.layers.0.self_attn.q_proj.weight"])
    reloaded = AutoModelForCausalLM.from_pretrained(good)
    assert not any(name.startswith("mtp") for name in reloaded.state_dict())

    missing = tmp_path / "missing"
    tgt.save_pretrained(missing)
    add_mtp_weights(missing, drop="mtp.layers.0.self_attn.k_norm.weight")
    for check in (lambda: mtp_status(missing), lambda: load_mtp_head(missing, tgt)):
        with pytest.raises(ValueError, match=r"tensor mtp\.layers\.0\.self_attn\.k_norm\.weight is missing"):
            check()

    extra = tmp_path / "extra"
    tgt.save_pretrained(extra)
    add_mtp_weights(extra)
    weights = load_file(str(extra / "model.safetensors"))
    save_file({**weights, "mtp.layers.0.self_attn.bogus.weight": torch.zeros(2)}, str(extra / "model.safetensors"),
              metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"unexpected MTP tensor mtp\.layers\.0\.self_attn\.bogus\.weight"):
        mtp_status(extra)
    weights["mtp.fc.weight"] = torch.zeros(cfg.hidden_size, cfg.hidden_size)  # pre-fc without the embedding half
    save_file(weights, str(extra / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"MTP tensor mtp\.fc\.weight has shape \[64, 64\].*needs \[64, 128\]"):
        mtp_status(extra)


@pytest.fixture(scope="module")
def hybrid_stage_inputs(stage_inputs, tmp_path_factory):
    """stage_inputs with a tiny hybrid Qwen3.5 target carrying a random MTP head (and the tiny tokenizer), and an
    exported DFlash drafter for it."""
    from tiny import add_mtp_weights, randomize_final_norm

    root = tmp_path_factory.mktemp("evaluate-mtp")
    tgt = randomize_final_norm(tiny_target("qwen3_5", initializer_range=0.1, max_position_embeddings=256))
    tdir = root / "target"
    tgt.save_pretrained(tdir)
    stage_inputs["tokenizer"].save_pretrained(tdir)
    add_mtp_weights(tdir, seed=5)
    ddir = root / "drafter"
    make_drafter(tgt, seed=2).save_pretrained(ddir)
    return dict(stage_inputs, target=str(tdir), drafter=str(ddir))


def test_evaluate_stage_reports_the_target_mtp_head(hybrid_stage_inputs, stage_inputs, tmp_path):
    """A target whose checkpoint carries mtp.* tensors: every prompt is also decoded by its MTP head once per
    evaluate.mtp.num_speculative_tokens entry, losslessly; each set's (and "all"'s) mtp section has each k's τ,
    tokens/s and speedup, the fastest k and whether the drafter beats it; report.md has the MTP table, the plot its
    bars; the static path (CPU, no graphs) reports the dynamic path's τ. A target without mtp.* gets no MTP rows and
    one line saying why, and num_speculative_tokens: [] turns the rows off."""
    import matplotlib.text

    from draftsmith.evaluate.report import tau_figure

    runs = {}
    for path in ("false", "true"):
        runs[path] = run_evaluate(**_stage_kwargs(hybrid_stage_inputs, tmp_path / path, static_cache=path,
                                                  mtp={"num_speculative_tokens": [1, 3]}))
    report = runs["true"]
    assert report["run"]["mtp"]["available"] and report["run"]["mtp"]["num_speculative_tokens"] == [1, 3]
    assert report["run"]["mtp_decoding"] == "fixed K/V buffers indexed by position"
    for name in ("heldout", "mtbench"):
        s, d = report["sets"][name], runs["false"]["sets"][name]
        assert set(s["lossless"]) == {"dflash", "prompt_lookup", "mtp_1", "mtp_3"}
        assert all(check["lossless"] for check in s["lossless"].values())
        m = s["mtp"]
        assert m["num_speculative_tokens"] == [1, 3] and m["fastest"] in (1, 3)
        for k in ("1", "3"):
            mk = m["by_tokens"][k]
            assert mk["tokens"] == s["target_only"]["tokens"] and mk["speedup"] > 0
            assert len(mk["per_position"]) == int(k)
            assert mk["tau"] == d["mtp"]["by_tokens"][k]["tau"]  # static == dynamic
            assert sum(r[f"mtp_{k}_steps"] for r in s["per_prompt"]) == mk["steps"]
        assert m["drafter_faster"] == (s["dflash"]["tokens_per_s"] > m["fastest_tokens_per_s"])
    assert report["overall"]["mtp"]["by_tokens"]["3"]["steps"] > 0
    md = (tmp_path / "true" / "report.md").read_text()
    assert "## The target's own MTP head (the number to beat)" in md and "| MTP τ k=1 |" in md
    assert "DFlash faster than MTP | MTP lossless |" in md and "the target's MTP head: 1 layer(s)" in md
    assert md.count(" | yes |\n") >= 2  # every set's MTP rows lossless
    texts = " | ".join(t.get_text() for t in tau_figure(report).findobj(matplotlib.text.Text))
    assert "MTP head (fastest k)" in texts

    plain = run_evaluate(**_stage_kwargs(stage_inputs, tmp_path / "plain"))
    assert not plain["run"]["mtp"]["available"] and "no mtp.* tensors" in plain["run"]["mtp"]["reason"]
    assert all(s["mtp"] is None and set(s["lossless"]) == {"dflash", "prompt_lookup"} for s in plain["sets"].values())
    md = (tmp_path / "plain" / "report.md").read_text()
    assert "- the target's MTP head: none (the target checkpoint has no mtp.* tensors" in md and "no MTP rows" in md
    assert "## The target's own MTP head" not in md
    off = run_evaluate(**_stage_kwargs(hybrid_stage_inputs, tmp_path / "off", mtp={"num_speculative_tokens": []}))
    assert off["run"]["mtp"]["reason"] == "evaluate.mtp.num_speculative_tokens is empty"
    assert off["sets"]["heldout"]["mtp"] is None


def test_evaluate_refuses_a_malformed_mtp_set_naming_the_tensor(hybrid_stage_inputs, tmp_path):
    """A checkpoint whose mtp.* set lacks a tensor stops evaluate before anything is decoded, naming the tensor."""
    import shutil

    from safetensors.torch import load_file, save_file

    target = tmp_path / "target"
    shutil.copytree(hybrid_stage_inputs["target"], target)
    weights = load_file(str(target / "model.safetensors"))
    del weights["mtp.pre_fc_norm_hidden.weight"]
    save_file(weights, str(target / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"tensor mtp\.pre_fc_norm_hidden\.weight is missing"):
        run_evaluate(**_stage_kwargs(dict(hybrid_stage_inputs, target=str(target)), tmp_path / "out"))
    assert not (tmp_path / "out" / "report.json").exists()


@pytest.mark.skipif(not torch.cuda.is_available() or not fla_available(),
                    reason="needs a CUDA GPU and flash-linear-attention (the Gated DeltaNet kernels)")
def test_mtp_decoding_with_cuda_graphs_is_lossless_on_the_gpu_kernels(tmp_path_factory):
    """On a GPU in float32 with flash-linear-attention: MTP decoding on the static target, its drafting step replayed
    as a CUDA graph (forced drafts: full, partial and no acceptance, so 1..k+1 committed rows a step), equals
    target-only decoding at the verify width (evaluate's lossless reference: the kernels verification runs), with no
    capture failure; the eager MTP path gives the same counts.

    The target's random final norm (which the pre-norm control needs) leaves one near tie on this prompt: new token
    25's top-2 logits differ by 5.5e-4 in exact float32 on the CPU (logits of scale 3.5; ``docs/mtp/diag_mtp.py``).
    On the GPU, fla's chunked Gated DeltaNet kernel (prefill, verify) runs its float32 ``tl.dot`` products as TF32
    (Triton's default; unit roundoff 2**-11), its recurrent kernel (one token) has no dot product: the two round
    differently, and on the H200 (2026-12-03) one-token decoding differed from the verify-width one exactly at that
    token, where a full chunked forward puts the two tokens 3.8e-3 apart. So the reference is the verify width's, as in
    evaluate, and one-token decoding may differ from it only where the two tokens' logits are within TF32's reach
    (under 1e-2); a wrong rollback picks a token the target does not nearly prefer."""
    from draftsmith.evaluate.static import StaticTarget

    _, folder, _ = mtp_target("qwen3_5", tmp_path_factory)
    device = torch.device("cuda")
    from tiny import randomize_final_norm

    tgt = randomize_final_norm(tiny_target("qwen3_5", initializer_range=0.1, max_position_embeddings=256)).to(device)
    ids = prompt(1, length=150).to(device)
    new = 40
    static = StaticTarget(tgt, ids.shape[1] + new + BLOCK + 1, layer_ids=[1, 2, 3], cuda_graphs=True,
                          verify_width=BLOCK)
    ref = target_generate(tgt, ids, max_new_tokens=new, static=static, width=None)
    one_token = target_generate(tgt, ids, max_new_tokens=new).tokens
    full = torch.cat([ids[0], torch.tensor(ref.tokens, device=device)])
    differs = next((i for i, (a, b) in enumerate(zip(ref.tokens, one_token)) if a != b), None)
    if differs is not None:
        with torch.no_grad():
            logits = tgt(full[None]).logits[0, ids.shape[1] - 1 + differs].float()
        pair = (ref.tokens[differs], one_token[differs])
        gap = (logits[pair[0]] - logits[pair[1]]).abs().item()
        assert gap < 1e-2, ("not a near tie", differs, pair, gap, logits.topk(2).values.tolist())
    for k in (1, 2, 3):
        for forced in (None, 3, 4):
            graphed = _mtp_proposer(tgt, folder, k, full if forced else None, forced, device=device)
            out = speculative_generate(tgt, graphed, ids, max_new_tokens=new, static=static)
            assert out.tokens == ref.tokens, (k, forced)
            assert graphed.drafter.graph_failures == {} and graphed.drafter._graphs
            eager = _mtp_proposer(tgt, folder, k, full if forced else None, forced)
            again = speculative_generate(tgt, eager, ids, max_new_tokens=new, static=static)
            assert (again.committed, again.accepted) == (out.committed, out.accepted), (k, forced)
