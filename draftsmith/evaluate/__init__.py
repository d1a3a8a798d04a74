"""evaluate: real speculative decoding of the target with the DFlash drafter.

Measures what users care about, with the target and drafter decoding together: acceptance length τ
(tokens committed per target verify forward, bonus included), per-position acceptance, the
acceptance-length histogram, tokens/s and wall-clock speedup against target-only decoding of the same
prompts in the same run, prompt-lookup (n-gram) decoding as a reference drafter, the target's own MTP head
(Qwen3.5 / 3.6 / Qwen3-Next checkpoints) as the drafter users already have, and a lossless check
(greedy speculative output == greedy target-only output), per benchmark set.

Modules: :mod:`.sampling` (greedy / sampling / rejection sampling), :mod:`.cache` (target cache with
exact rollback of GDN recurrent state), :mod:`.static` (static cache, CUDA graphs), :mod:`.decode` (the decoding
loops and proposers), :mod:`.mtp` (the target's MTP head as a proposer), :mod:`.prompts` (benchmark sets),
:mod:`.drafter` (the exported drafter), :mod:`.decoders` (the stage's decoders and how they decode a set),
:mod:`.resume` (saved conversations), :mod:`.workers` and :mod:`.worker` (one decoding process per GPU),
:mod:`.report` (metrics, report.json's sections, report.md, plots), :mod:`.settings` (the config keys the stage
reads), :mod:`.run` (the stage); :mod:`.compare` (two reports paired by prompt: ``python -m
draftsmith.evaluate.compare A/report.json B/report.json``).
"""

from draftsmith.evaluate.cache import TargetCache
from draftsmith.evaluate.decode import (
    DFlashProposer,
    GenerationResult,
    PromptLookupProposer,
    Proposer,
    speculative_generate,
    target_generate,
)
from draftsmith.evaluate.drafter import check_pair, load_drafter
from draftsmith.evaluate.mtp import MTPDrafter, MTPProposer, MTPStatus, load_mtp_head, mtp_status
from draftsmith.evaluate.prompts import BenchmarkSet, Conversation, load_sets, split_conversation
from draftsmith.evaluate.report import drafter_name, lossless_check, render_markdown, summarize
from draftsmith.evaluate.run import run_evaluate
from draftsmith.evaluate.sampling import SamplingConfig, greedy_accept, rejection_sample, sampling_probs
from draftsmith.evaluate.settings import EvaluateSettings

__all__ = [
    "BenchmarkSet", "Conversation", "DFlashProposer", "EvaluateSettings", "GenerationResult", "MTPDrafter",
    "MTPProposer", "MTPStatus", "PromptLookupProposer", "Proposer", "SamplingConfig", "TargetCache", "check_pair",
    "drafter_name", "greedy_accept", "load_drafter", "load_mtp_head", "load_sets", "lossless_check", "mtp_status",
    "rejection_sample", "render_markdown", "run_evaluate", "sampling_probs", "speculative_generate",
    "split_conversation", "summarize", "target_generate",
]
