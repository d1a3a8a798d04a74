"""Metrics of a benchmark set and the report: report.json's sections, report.md and the PNG plots.

Definitions (docs/design.md terms):

* acceptance length τ = tokens committed per verify forward of the target, bonus token included
  (``tau``: total committed / total verify forwards over the set; ``tau_per_prompt``: the mean over
  prompts of each prompt's τ, the figure the official ``dflash`` benchmark prints);
* per-position acceptance rate at draft slot k = verify steps whose first k drafts were all accepted /
  steps that proposed at least k drafts (``per_position``), and the conditional rate given slots
  1..k-1 were accepted (``per_position_conditional``). Only drafts that could be emitted count
  (:func:`step_slots`): a step that a stop token or the token budget ends early commits ``c`` tokens, the
  last of which plays the bonus token's role, so its slots 1..c-1 count as accepted and the slots after
  them not at all (never emitted). Hence, on every step, 1 + accepted slots = tokens committed, and over a
  set τ = 1 + Σ_k ``per_position_hits[k]`` / ``steps`` exactly (checked);
* acceptance-length histogram: how many verify steps committed 1, 2, ..., B tokens;
* tokens/s = generated tokens / wall-clock seconds (prefill + decode, CUDA synchronised), summed over
  the prompts; speedup = tokens/s of the method / tokens/s of target-only decoding of the same prompts
  in the same run (= the wall-clock ratio when both generate the same tokens, as greedy decoding does);
  ``decode_speedup`` uses decode time only (prefill excluded, as the official benchmark's TPOT).

The target's own MTP head (:mod:`draftsmith.evaluate.mtp`), when its checkpoint carries one, decodes every prompt
once per ``evaluate.mtp.num_speculative_tokens`` entry k (method ``mtp_<k>``): a set's ``mtp`` section holds each k's
metrics (``by_tokens``), the fastest k in tokens/s, and whether the drafter is faster than that one
(:func:`mtp_metrics`).

With ``drafter.init_from`` the drafter training started from decodes every prompt too (method ``dflash_start``): a
set's ``start`` section holds its figures and the trained drafter's against them, paired by prompt with bootstrap
intervals (:func:`start_metrics`, through :func:`draftsmith.evaluate.compare.paired`), and whether τ dropped.
"""

from __future__ import annotations

import dataclasses
import math
import platform
from typing import TYPE_CHECKING, Iterable

import torch

from draftsmith.evaluate.decode import GenerationResult
from draftsmith.evaluate.prompts import BenchmarkSet
from draftsmith.evaluate.sampling import SamplingConfig
from draftsmith.io import read_json

if TYPE_CHECKING:
    from draftsmith.evaluate.decoders import Decoders

#: the decoders every prompt is decoded by and the report compares: target-only (the baseline), DFlash and prompt
#: lookup (the reference drafter); plus the target's MTP head, once per number of drafts (:func:`mtp_method`), when
#: the target has one
METHODS = ("target_only", "dflash", "prompt_lookup")
#: report.json's ``format`` (also part of the key of saved conversations: a new format decodes them again);
#: 3: the MTP head's methods and the sets' ``mtp`` sections
REPORT_FORMAT = "draftsmith.eval/3"


#: the method of the drafter training started from (``drafter.init_from``): every prompt decoded once more
START_METHOD = "dflash_start"


def mtp_method(k: int) -> str:
    """The method name of the MTP head drafting ``k`` tokens a step (``mtp_2``): results' and report.json's key."""
    return f"mtp_{int(k)}"


def mtp_methods(names) -> list[tuple[int, str]]:
    """``[(k, method)]`` of the MTP methods among ``names`` (a results dict or method names), by k."""
    out = []
    for name in names:
        head, _, k = str(name).partition("_")
        if head == "mtp" and k.isdigit():
            out.append((int(k), name))
    return sorted(out)


def step_slots(proposed: int, accepted: int, committed: int) -> tuple[int, int]:
    """Per-position accounting of one verify step: ``(draft slots that count, how many of them accepted)``.

    The target accepted the first ``accepted`` of ``proposed`` drafts; the step committed ``committed``
    tokens. Uncapped (``committed == accepted + 1``: the accepted drafts plus the target's bonus /
    correction token) all ``proposed`` slots count and ``accepted`` of them are accepted (slot k is
    accepted iff k <= accepted). When a stop token among the drafts or the token budget ended the step
    early (``committed <= accepted``), only the slots before the last emitted token count, all accepted:
    the last emitted token stands where the bonus would, and later drafts were never emitted. Either way
    ``1 + accepted slots == committed``.

    Raises:
        ValueError: inconsistent counts (``committed`` not in 1..accepted + 1, or ``accepted > proposed``).
    """
    if not (0 <= accepted <= proposed and 1 <= committed <= accepted + 1):
        raise ValueError(f"inconsistent verify step: {proposed} proposed, {accepted} accepted, {committed} committed")
    if committed == accepted + 1:
        return proposed, accepted
    return committed - 1, committed - 1


def summarize(results: list[GenerationResult], baseline: list[GenerationResult] | None = None,
              max_block: int | None = None) -> dict:
    """Aggregate metrics of one decoding method over a set's prompts.

    Args:
        results: one :class:`GenerationResult` per prompt of the method.
        baseline: target-only results of the same prompts (for speedups), or None.
        max_block: histogram length (B); default the largest committed count seen.

    Returns:
        dict with ``prompts, tokens, seconds, decode_seconds, tokens_per_s, steps, tau, tau_per_prompt,
        per_position, per_position_conditional`` (index k - 1 = draft slot k; None where no step counted
        the slot), ``per_position_hits`` / ``per_position_steps`` (their counts: steps that accepted slot k /
        that counted it, :func:`step_slots`), ``acceptance_histogram`` (list, index i = i + 1 tokens
        committed), and ``speedup`` / ``decode_speedup`` when a baseline is given.

    Raises:
        AssertionError: τ and the per-position counts do not reconcile (a bug, never silently reported).
    """
    tokens = sum(len(r.tokens) for r in results)
    seconds = sum(r.seconds for r in results)
    decode_seconds = sum(r.decode_seconds for r in results)
    committed = [c for r in results for c in r.committed]
    steps = len(committed)
    out = {
        "prompts": len(results),
        "tokens": tokens,
        "seconds": seconds,
        "decode_seconds": decode_seconds,
        "tokens_per_s": tokens / seconds if seconds > 0 else None,
        "steps": steps,
        "tau": sum(committed) / steps if steps else None,
        "tau_per_prompt": (sum(r.tau for r in results if r.committed)
                           / sum(1 for r in results if r.committed)) if steps else None,
    }
    max_drafts = max((p for r in results for p in r.proposed), default=0)
    reached = [0] * (max_drafts + 1)  # steps whose slot k counts (proposed, and emittable)
    hit = [0] * (max_drafts + 1)  # ... and accepted slot k (so slots 1..k)
    survived = [0] * (max_drafts + 1)  # ... and accepted slots 1..k-1 (slot k was reached)
    for r in results:
        for p, a, c in zip(r.proposed, r.accepted, r.committed):
            counted, acc = step_slots(p, a, c)
            for k in range(1, counted + 1):
                reached[k] += 1
                hit[k] += acc >= k
                survived[k] += acc >= k - 1
    ks = range(1, max_drafts + 1)
    out["per_position"] = [hit[k] / reached[k] if reached[k] else None for k in ks]
    out["per_position_conditional"] = [hit[k] / survived[k] if survived[k] else None for k in ks]
    out["per_position_hits"] = [hit[k] for k in ks]
    out["per_position_steps"] = [reached[k] for k in ks]
    if steps and sum(committed) != steps + sum(hit):
        raise AssertionError(f"per-position counts do not reconcile with τ: {sum(committed)} tokens committed in "
                             f"{steps} steps, but {sum(hit)} accepted draft slots")
    size = max(max_block or 0, max(committed, default=0))
    hist = [0] * size
    for c in committed:
        hist[c - 1] += 1
    out["acceptance_histogram"] = hist
    if baseline is not None:
        b_tokens = sum(len(r.tokens) for r in baseline)
        b_seconds = sum(r.seconds for r in baseline)
        b_decode = sum(r.decode_seconds for r in baseline)
        out["speedup"] = _ratio(tokens / seconds if seconds else None, b_tokens / b_seconds if b_seconds else None)
        dec_tokens = tokens - len(results)  # the first token of each prompt comes from the prefill
        b_dec_tokens = b_tokens - len(baseline)
        out["decode_speedup"] = _ratio(dec_tokens / decode_seconds if decode_seconds > 0 else None,
                                       b_dec_tokens / b_decode if b_decode > 0 else None)
    return out


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return a / b


def lossless_check(reference: list[GenerationResult], other: list[GenerationResult],
                   labels: list[str]) -> dict:
    """Token-for-token comparison of greedy outputs with the target-only reference.

    Returns:
        ``{"lossless": bool, "prompts": n, "mismatches": [{"prompt", "first_mismatch", "ref_tokens",
        "tokens"}]}``; first_mismatch = index of the first differing generated token.
    """
    mismatches = []
    for label, ref, res in zip(labels, reference, other):
        if ref.tokens != res.tokens:
            first = next((i for i, (a, b) in enumerate(zip(ref.tokens, res.tokens)) if a != b),
                         min(len(ref.tokens), len(res.tokens)))
            mismatches.append({"prompt": label, "first_mismatch": first, "ref_tokens": len(ref.tokens),
                               "tokens": len(res.tokens)})
    return {"lossless": not mismatches, "prompts": len(reference), "mismatches": mismatches}


# ------------------------------------------------------------------------------------------------
# report.md
# ------------------------------------------------------------------------------------------------

def set_report(bset: BenchmarkSet, done: dict, sampling: SamplingConfig, block_size: int) -> dict:
    """One set's section of report.json: what was read and decoded, each decoder's metrics
    (:func:`summarize`), the lossless checks (greedy) and one line per prompt.

    Args:
        done: the set's decoded prompts in its order (:func:`draftsmith.evaluate.decoders.aggregate`:
            ``{"results": {method: [GenerationResult]}, "labels", "prompt_keys", "skipped_prompts", "planned"}``).
        block_size: the verify width B (the acceptance histogram's length).

    Raises:
        RuntimeError: the prompts planned, decoded and skipped, or the rows read, kept and skipped, disagree.
    """
    results, labels, keys = done["results"], done["labels"], done["prompt_keys"]
    skipped, planned = done["skipped_prompts"], done["planned"]
    base = results["target_only"]
    if planned != len(base) + sum(skipped.values()):
        raise RuntimeError(f"set {bset.name}: {planned} prompts planned != {len(base)} decoded + {skipped} skipped")
    if bset.rows_read != len(bset.conversations) + sum(bset.skipped.values()):
        raise RuntimeError(f"set {bset.name}: {bset.rows_read} rows read != {len(bset.conversations)} kept + "
                           f"{bset.skipped} skipped")
    out = {
        "source": bset.source,
        "max_prompts": bset.max_prompts,
        "max_new_tokens": bset.max_new_tokens,
        "rows_read": bset.rows_read,
        "conversations": len(bset.conversations),
        "skipped_rows": dict(bset.skipped),
        "skipped_row_ids": {reason: list(ids) for reason, ids in bset.skipped_ids.items()},
        "prompts_planned": planned,
        "prompts": len(base),
        "skipped_prompts": dict(skipped),
        **_decoder_metrics(results, labels, sampling, block_size),
        "per_prompt": [_prompt_row(results, i, lab, key) for i, (lab, key) in enumerate(zip(labels, keys))],
    }
    return out


def _prompt_row(results: dict[str, list[GenerationResult]], i: int, label: str, key: str) -> dict:
    """One prompt's line of a set's ``per_prompt``: its sizes, every method's seconds and τ (``<method>_s``,
    ``<method>_tau``), and the exact sums any subset of prompts adds up to the set's own figures from
    (``draftsmith.evaluate.compare`` pairs two reports' prompts): τ = committed / steps, tokens/s = tokens / s."""
    b = results["target_only"][i]
    row = {"prompt": label, "prompt_key": key, "prompt_tokens": b.num_prompt_tokens, "new_tokens": len(b.tokens),
           "target_only_s": b.seconds}
    for name in ("dflash", "prompt_lookup", *(m for _, m in mtp_methods(results)),
                 *((START_METHOD,) if START_METHOD in results else ())):
        r = results[name][i]
        row.update({f"{name}_s": r.seconds, f"{name}_tau": r.tau, f"{name}_tokens": len(r.tokens),
                    f"{name}_committed": sum(r.committed), f"{name}_steps": len(r.committed)})
    return row


def _decoder_metrics(results: dict[str, list[GenerationResult]], labels: list[str], sampling: SamplingConfig,
                     block_size: int) -> dict:
    """Summaries of target-only, DFlash, prompt-lookup and MTP decoding (``mtp``: :func:`mtp_metrics`, None without
    an MTP head), and (greedy) the lossless checks of every speculative method."""
    base = results["target_only"]
    reference = results.get("reference") or base
    mtp = mtp_methods(results)
    start = (START_METHOD,) if START_METHOD in results else ()
    out = {
        "target_only": summarize(base),
        "dflash": summarize(results["dflash"], base, block_size),
        "prompt_lookup": summarize(results["prompt_lookup"], base),
        "mtp": None,
        "lossless": None if not sampling.greedy else {
            name: lossless_check(reference, results[name], labels)
            for name in ("dflash", "prompt_lookup", *(m for _, m in mtp), *start)},
    }
    if mtp:
        out["mtp"] = mtp_metrics({k: summarize(results[m], base, k + 1) for k, m in mtp}, out["dflash"])
    if start:
        out["start"] = start_metrics(results, block_size)
    if results.get("reference"):  # how often bf16 1-token forwards flip a near-tie against verify-width ones
        out["target_only_vs_reference"] = lossless_check(reference, base, labels)
    return out


def start_metrics(results: dict[str, list[GenerationResult]], block_size: int, resamples: int = 2000,
                  seed: int = 0) -> dict:
    """The ``start`` section of a set (or of the "all" row): the drafter training started from (``dflash_start``)
    before, the trained drafter (``dflash``) after, on the same prompts of the same run.

    Returns:
        ``{"before": summarize(dflash_start), "paired": draftsmith.evaluate.compare.paired(...)`` (before = base,
        after = new: ``tau`` and ``tokens_per_s`` with ``base``, ``new``, ``ratio`` and its 95% bootstrap interval
        over prompts), ``"tau_change"``: τ after - τ before (None without steps), ``"tau_dropped"``: whether τ
        after < τ before}``.
    """
    from draftsmith.evaluate.compare import paired

    base = results["target_only"]
    before = summarize(results[START_METHOD], base, block_size)
    after = summarize(results["dflash"], base, block_size)
    rows = {}
    for i in range(len(base)):
        row = {}
        for name in ("dflash", START_METHOD):
            r = results[name][i]
            row.update({f"{name}_committed": sum(r.committed), f"{name}_steps": len(r.committed),
                        f"{name}_tokens": len(r.tokens), f"{name}_s": r.seconds})
        rows[str(i)] = row
    pair = paired(rows, rows, resamples, seed, base_method=START_METHOD, new_method="dflash")
    change = (after["tau"] - before["tau"]) if None not in (after["tau"], before["tau"]) else None
    return {"before": before, "paired": pair, "tau_change": change,
            "tau_dropped": None if change is None else change < 0}


def start_drops(report: dict) -> list[tuple[str, float, float]]:
    """``[(set, τ before, τ after)]`` of the sets (and the "all" row) whose τ the trained drafter lowered against the
    drafter training started from (report.json ``start`` sections; ``[]`` without a start)."""
    out = []
    sections = list(report.get("sets", {}).items()) + [("all", report.get("overall") or {})]
    for name, section in sections:
        start = section.get("start")
        if start and start.get("tau_dropped"):
            out.append((name, start["before"]["tau"], section["dflash"]["tau"]))
    return out


def mtp_metrics(by_tokens: dict[int, dict], drafter: dict) -> dict:
    """A set's (or the "all" row's) MTP section from each k's :func:`summarize` and the drafter's.

    Returns:
        ``{"num_speculative_tokens": [k...], "by_tokens": {"<k>": summary}, "fastest": k with the most tokens/s (None
        when none was timed), "fastest_tokens_per_s", "drafter_tokens_per_s", "drafter_over_fastest": drafter tokens/s
        / the fastest MTP's, "drafter_faster": whether the drafter decodes more tokens/s than the fastest MTP}``.
    """
    timed = {k: s["tokens_per_s"] for k, s in by_tokens.items() if s.get("tokens_per_s") is not None}
    fastest = max(timed, key=timed.get) if timed else None
    best, mine = timed.get(fastest), drafter.get("tokens_per_s")
    return {"num_speculative_tokens": sorted(by_tokens), "by_tokens": {str(k): by_tokens[k] for k in sorted(by_tokens)},
            "fastest": fastest, "fastest_tokens_per_s": best, "drafter_tokens_per_s": mine,
            "drafter_over_fastest": _ratio(mine, best),
            "drafter_faster": None if best is None or mine is None else mine > best}


def overall_report(sets: list[BenchmarkSet], done: dict[str, dict], set_reports: dict[str, dict],
                   sampling: SamplingConfig, block_size: int) -> dict:
    """The "all" row: every distinct prompt once (a prompt in several sets, e.g. a held-out row that is also
    a BFCL set row, counts once, under its first set's label); ``prompts_in_several_sets`` = set prompts -
    distinct prompts.

    Args:
        sets: the benchmark sets, in config order.
        done: each set's decoded prompts by set name (as :func:`set_report` takes them).
        set_reports: each set's :func:`set_report`.
    """
    all_results: dict[str, list[GenerationResult]] = {m: [] for m in METHODS}
    all_labels: list[str] = []
    all_keys: set[str] = set()
    all_conversations: set[tuple[str, str]] = set()
    for bset in sets:
        results, labels = done[bset.name]["results"], done[bset.name]["labels"]
        for k, key in enumerate(done[bset.name]["prompt_keys"]):
            if key in all_keys:
                continue
            all_keys.add(key)
            all_labels.append(f"{bset.name}:{labels[k]}")
            for m, rs in results.items():
                all_results.setdefault(m, []).append(rs[k])
        all_conversations.update((c.source, c.id) for c in bset.conversations)
    base = all_results["target_only"]
    return {
        "conversations": len(all_conversations),
        "prompts": len(base),
        "prompts_in_several_sets": sum(s["prompts"] for s in set_reports.values()) - len(base),
        **_decoder_metrics(all_results, all_labels, sampling, block_size),
    }


def run_metadata(decoders: Decoders, target_dir: str, drafter_dir: str, drafter_sha: str,
                 drafter_implementation: str, decoding_path: dict) -> dict:
    """The report's ``run`` section: what was decoded, how (``decoding_path``:
    :func:`draftsmith.evaluate.decoders.decoding_path`), with which versions; ``mtp``: the target's MTP head
    (:class:`draftsmith.evaluate.mtp.MTPStatus` and the ``num_speculative_tokens`` decoded, or why none)."""
    sampling = decoders.sampling
    return {
        "mtp": {**decoders.mtp_status, "num_speculative_tokens": decoders.mtp_tokens},
        "start_drafter": decoders.start_dir, "start_sha256": decoders.start_sha,
        "target": str(target_dir), "drafter": str(drafter_dir), "drafter_sha256": drafter_sha,
        "drafter_implementation": drafter_implementation, "drafter_architecture": decoders.architecture,
        "block_size": decoders.block_size, "target_layer_ids": decoders.layer_ids,
        "mask_token_id": decoders.mask_token_id, "device": _device_name(decoders.device),
        "dtype": str(decoders.dtype).replace("torch.", ""),
        "sampling": dataclasses.asdict(sampling), "sampling_text": _sampling_text(sampling), "seed": decoders.seed,
        "chat_template_kwargs": decoders.template_kwargs, "tokenizer_fingerprint": decoders.tokenizer_fingerprint,
        "stop_token_ids": decoders.stops,
        "prompt_lookup_ngram": decoders.lookup.max_ngram, "prompt_lookup_num_tokens": decoders.lookup.max_drafts,
        **decoding_path,
        "versions": {"torch": torch.__version__, "transformers": _version("transformers"),
                     "python": platform.python_version()},
    }


def training_summary(path: str | None) -> dict | None:
    """Training's held-out figures (teacher-forced on held-out rows) from ``trainer_state.json``, or None."""
    if not path:
        return None
    state = read_json(path)
    held = state.get("heldout") or {}
    return {"steps": state.get("steps"), "labels": state.get("labels"), "block_size": state.get("block_size"),
            "heldout_tau_blocks": held.get("tau_blocks"), "heldout_tau_expected": held.get("tau_expected"),
            "heldout_accuracy_per_position": held.get("accuracy_per_position"), "heldout_loss": held.get("loss"),
            "train_tokens_per_s": (state.get("last_train") or {}).get("tokens_per_s")}


def _device_name(device: torch.device) -> str:
    """``cuda (<GPU name>)`` or ``cpu (<processor>, <n> threads)``."""
    if device.type == "cuda":
        return f"cuda ({torch.cuda.get_device_name(device)})"
    return f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def _sampling_text(s: SamplingConfig) -> str:
    """``greedy``, or the sampling settings in words."""
    if s.greedy:
        return "greedy"
    return f"temperature {s.temperature}, top-p {s.top_p}, top-k {s.top_k or 'off'} (rejection sampling)"


def _version(name: str) -> str:
    """An installed distribution's version, or ``unknown``."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return "unknown"


def _fmt(x, digits: int = 2) -> str:
    if x is None:
        return "–"
    if isinstance(x, bool):
        return "yes" if x else "NO"
    if isinstance(x, float):
        if math.isnan(x):
            return "nan"
        return f"{x:.{digits}f}"
    return str(x)


def _table(header: list[str], rows: Iterable[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(_fmt(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def drafter_name(run: dict) -> str:
    """``DFlash2`` or ``DFlash``: the drafter's architecture as report.md, its figures and evaluate's last log line
    name it, from a report's ``run`` dict (``drafter_architecture``; absent: DFlash)."""
    return "DFlash2" if run.get("drafter_architecture") == "DFlash2DraftModel" else "DFlash"


def render_markdown(report: dict) -> str:
    """report.md: setup, one summary table over the sets, per-position and histogram tables."""
    run = report["run"]
    architecture, drafter = run.get("drafter_architecture", "DFlashDraftModel"), drafter_name(run)
    lines = [f"# draftsmith evaluation: speculative decoding with the {drafter} drafter", ""]
    lines.append(f"- target: `{run['target']}`  ")
    lines.append(f"- drafter: `{run['drafter']}` ({architecture}, block size {run['block_size']}, target layer ids "
                 f"{run['target_layer_ids']}, mask token {run['mask_token_id']})  ")
    lines.append(f"- device: {run['device']}, dtype {run['dtype']}, sampling: {run['sampling_text']}  ")
    lines.append(f"- chat template kwargs: `{run['chat_template_kwargs']}`; stop tokens {run['stop_token_ids']}  ")
    lines.append(f"- reference drafter: prompt lookup (n-gram ≤ {run['prompt_lookup_ngram']}, "
                 f"≤ {run['prompt_lookup_num_tokens']} drafts per step); recurrent-state rollback: {run['rollback']}"
                 + (f"; target forwards: {run['decoding']}" if run.get("decoding") else ""))
    if run.get("lossless_reference"):
        lines.append(f"- lossless reference: {run['lossless_reference']}")
    if int(run.get("workers_per_gpu") or 1) > 1:
        lines.append(f"- **decoded by {run['decoding_workers']} processes, {run['workers_per_gpu']} sharing each GPU "
                     "(evaluate.workers_per_gpu): τ and the lossless check are one process's; tokens/s and speedups "
                     "were measured on a shared GPU and are no speed figures**")
    lines.append(f"- the target's MTP head: {_mtp_line(run.get('mtp'))}")
    if run.get("start_drafter"):
        lines.append(f"- the drafter training started from (drafter.init_from): `{run['start_drafter']}`, decoded on "
                     "every prompt too (one more decoding per prompt): the before -> after section below")
    lines.append("")
    lines.append("τ = tokens committed per target verify forward (bonus included). Speedup = tokens/s against "
                 "target-only decoding of the same prompts in the same run (wall clock, prefill included). "
                 "Lossless = greedy speculative output equals the lossless reference token for token.")
    o = report.get("overall")
    if o and o.get("prompts_in_several_sets"):
        lines.append(f"The **all** row counts each prompt once: {o['prompts_in_several_sets']} prompt(s) sit in "
                     "more than one set (decoded once, reported in each).")
    lines.append("")
    rows = []
    for name, s in report["sets"].items():
        t, d, p = s["target_only"], s["dflash"], s["prompt_lookup"]
        rows.append([name, s["conversations"], s["prompts"], t["tokens"], t["tokens_per_s"], d["tau"],
                     d["tokens_per_s"], d.get("speedup"), p["tau"], p["tokens_per_s"], p.get("speedup"),
                     _lossless_text(s)])
    if o:
        rows.append(["**all**", o["conversations"], o["prompts"], o["target_only"]["tokens"],
                     o["target_only"]["tokens_per_s"], o["dflash"]["tau"], o["dflash"]["tokens_per_s"],
                     o["dflash"].get("speedup"), o["prompt_lookup"]["tau"], o["prompt_lookup"]["tokens_per_s"],
                     o["prompt_lookup"].get("speedup"), _lossless_text(o)])
    lines.append(_table(["set", "conversations", "prompts", "new tokens", "target tok/s", f"{drafter} τ",
                         f"{drafter} tok/s", f"{drafter} speedup", "lookup τ", "lookup tok/s", "lookup speedup",
                         "lossless"], rows))
    lines.append("")
    lines += _mtp_table(report, drafter)
    lines += _start_table(report, drafter)
    tr = report.get("training")
    if tr:
        decoded = (report["sets"].get("heldout") or {}).get("dflash", {}).get("tau")
        lines.append("## Training against decoding")
        lines.append("")
        lines.append(_table(
            ["training steps", "labels", "held-out block τ (teacher-forced)", "held-out expected τ",
             "decoded held-out τ", "held-out accuracy, slots 1-3"],
            [[tr["steps"], tr["labels"], tr["heldout_tau_blocks"], tr["heldout_tau_expected"], decoded,
              " / ".join(_fmt(a) for a in (tr["heldout_accuracy_per_position"] or [])[:3])]]))
        lines.append("")
        lines.append("Block τ: training's held-out rows with the data's own context (mean accepted prefix + 1 over "
                     "fully supervised blocks); decoded τ: real speculative decoding of held-out prompts, where "
                     "the context is what the target generated.")
        lines.append("")
    lines.append(f"## Per-position acceptance ({drafter}): P(drafts 1..k all accepted)")
    lines.append("")
    lines.append("Drafts a stop token or the token budget kept from being emitted do not count; over a set, "
                 "τ = 1 + Σ_k (steps accepting draft k) / steps.")
    lines.append("")
    width = max((len(s["dflash"]["per_position"]) for s in report["sets"].values()), default=0)
    lines.append(_table(["set"] + [f"k={k}" for k in range(1, width + 1)],
                        [[n] + s["dflash"]["per_position"] + [None] * (width - len(s["dflash"]["per_position"]))
                         for n, s in report["sets"].items()]))
    lines.append("")
    lines.append(f"## Acceptance-length histogram ({drafter}): verify steps committing n tokens")
    lines.append("")
    width = max((len(s["dflash"]["acceptance_histogram"]) for s in report["sets"].values()), default=0)
    lines.append(_table(["set"] + [f"n={n}" for n in range(1, width + 1)],
                        [[n] + s["dflash"]["acceptance_histogram"]
                         + [0] * (width - len(s["dflash"]["acceptance_histogram"]))
                         for n, s in report["sets"].items()]))
    lines.append("")
    skipped = {n: {k: s["skipped_rows"].get(k, 0) + s["skipped_prompts"].get(k, 0)  # rows and later turns
                   for k in {**s["skipped_rows"], **s["skipped_prompts"]}}
               for n, s in report["sets"].items() if s["skipped_rows"] or s["skipped_prompts"]}
    if skipped:
        lines.append("## Skipped")
        lines.append("")
        for n, reasons in skipped.items():
            lines.append(f"- {n}: " + ", ".join(f"{k} × {v}" for k, v in sorted(reasons.items())))
            failed = report["sets"][n].get("skipped_row_ids", {}).get("template_error")
            if failed:  # a template that refuses rows is worth a look: name them
                lines.append(f"  - template_error rows: {', '.join(failed[:20])}{' ...' if len(failed) > 20 else ''}")
        lines.append("")
    return "\n".join(lines)


def _lossless_text(s: dict) -> str:
    """``yes`` when every speculative method's greedy output equals the reference, else how many outputs differ and
    whose."""
    ll = s.get("lossless")
    if ll is None:
        return "n/a (sampling)"
    bad = {name: len(check["mismatches"]) for name, check in ll.items() if not check["lossless"]}
    if not bad:
        return "yes"
    return f"NO ({sum(bad.values())} mismatching outputs: {', '.join(bad)})"


def _mtp_line(mtp: dict | None) -> str:
    """The report.md line on the target's MTP head: what was decoded, or why there is no MTP column."""
    if not mtp:
        return "not recorded"
    if not mtp.get("available"):
        return f"none ({mtp.get('reason') or 'not available'}): no MTP rows"
    ks = ", ".join(str(k) for k in mtp.get("num_speculative_tokens", []))
    return (f"{mtp.get('num_layers')} layer(s) from the checkpoint's {mtp.get('tensors')} mtp.* tensors, decoded "
            f"with {ks} draft(s) per step (post-norm target state, recursive drafts, argmax)")


def _mtp_table(report: dict, drafter: str) -> list[str]:
    """report.md's section on the target's MTP head: each k's τ, tokens/s and speedup per set (the fastest k in
    bold) and whether the drafter decodes more tokens/s than the fastest k. Empty without MTP rows."""
    sections = [(name, s.get("mtp"), s.get("lossless")) for name, s in report["sets"].items()]
    o = report.get("overall")
    if o:
        sections.append(("**all**", o.get("mtp"), o.get("lossless")))
    ks = sorted({int(k) for _, m, _ in sections if m for k in m["by_tokens"]})
    if not ks:
        return []
    rows = []
    for name, m, lossless in sections:
        if not m:
            continue
        row = [name]
        for k in ks:
            s = m["by_tokens"].get(str(k))
            cells = [s["tau"], s["tokens_per_s"], s.get("speedup")] if s else [None] * 3
            cells = [_fmt(c) for c in cells]
            if k == m["fastest"]:
                cells = [f"**{c}**" for c in cells]
            row += cells
        faster = m["drafter_faster"]
        row += [m["fastest"], m["drafter_tokens_per_s"], m["drafter_over_fastest"],
                "–" if faster is None else ("yes" if faster else "**no**"), _mtp_lossless(lossless, ks)]
        rows.append(row)
    header = ["set"] + [f"{h} k={k}" for k in ks for h in ("MTP τ", "MTP tok/s", "MTP speedup")]
    header += ["fastest k", f"{drafter} tok/s", f"{drafter} / fastest MTP", f"{drafter} faster than MTP",
               "MTP lossless"]
    return ["## The target's own MTP head (the number to beat)", "",
            "Every prompt decoded again with the target's MTP head drafting k tokens a verify step (τ, tokens/s and "
            "speedup as above; bold: the fastest k in tokens/s).", "", _table(header, rows), ""]


def _start_table(report: dict, drafter: str) -> list[str]:
    """report.md's before -> after section (``drafter.init_from``): per set the starting drafter's τ and tokens/s, the
    trained drafter's, their ratios with 95% bootstrap intervals over prompts, and the sets whose τ dropped, named.
    Empty without a start."""
    sections = [(name, s) for name, s in report["sets"].items() if s.get("start")]
    o = report.get("overall")
    if o and o.get("start"):
        sections.append(("**all**", o))
    if not sections:
        return []

    def ratio(p: dict) -> str:
        if not p or p.get("ratio") is None:
            return "–"
        low, high = p.get("ratio_low"), p.get("ratio_high")
        return f"{p['ratio']:.3f}x" + ("" if low is None else f" [{low:.3f}, {high:.3f}]")

    rows = []
    for name, s in sections:
        st, p = s["start"], s["start"]["paired"]
        change = st["tau_change"]
        rows.append([name, s["prompts"], st["before"]["tau"], s["dflash"]["tau"],
                     "–" if change is None else f"{change:+.2f}" + (" **dropped**" if st["tau_dropped"] else ""),
                     ratio(p.get("tau")), st["before"]["tokens_per_s"], s["dflash"]["tokens_per_s"],
                     ratio(p.get("tokens_per_s"))])
    drops = start_drops(report)
    verdict = ("τ dropped on " + "; ".join(f"{n} ({b:.2f} -> {a:.2f}, {a - b:+.2f})" for n, b, a in drops)
               + ": training made the drafter worse there (speculators#761: training metrics can improve while "
               "decoding gets worse)" if drops else "τ held or rose on every set.")
    return ["## Before -> after: the drafter training started from (drafter.init_from)", "",
            "Every prompt decoded once more with the starting drafter (same target, prompts and run). τ after / "
            f"before and tokens/s after / before are paired by prompt, with a 95% bootstrap interval over prompts. "
            f"{verdict}",
            "", _table(["set", "prompts", "τ before", f"{drafter} τ after", "τ change", "τ after / before [95%]",
                        "tok/s before", "tok/s after", "tok/s after / before [95%]"], rows), ""]


def _mtp_lossless(lossless: dict | None, ks: list[int]) -> str:
    """``yes`` when every k's greedy MTP output equals the reference, else the k that differ; sampling: n/a."""
    if lossless is None:
        return "n/a (sampling)"
    bad = [f"k={k}: NO ({len(lossless[mtp_method(k)]['mismatches'])})" for k in ks
           if mtp_method(k) in lossless and not lossless[mtp_method(k)]["lossless"]]
    return ", ".join(bad) or "yes"


# ------------------------------------------------------------------------------------------------
# Plots
# ------------------------------------------------------------------------------------------------

def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save_figure(plt, fig, path) -> None:
    """Lay out ``fig``, write it as PNG atomically to ``path``, and free it."""
    from draftsmith.io import atomic_path

    fig.tight_layout()
    with atomic_path(path, suffix=".png") as tmp:
        fig.savefig(tmp, format="png", dpi=110)
    plt.close(fig)


def sample_label(report: dict, name: str) -> str:
    """A set's name with the sample sizes its figures stand on: ``heldout (n=12 prompts, 340 steps)`` (steps: DFlash
    verify steps, what the per-position and histogram figures count)."""
    s = report["sets"][name]
    return f"{name} (n={s['prompts']} prompts, {s['dflash']['steps']} steps)"


def plot_tau(report: dict, path) -> None:
    """Grouped bars: τ per set, DFlash, the prompt-lookup reference and (when the target has one) its MTP head at the
    fastest k, speedups annotated, each set's prompts under it (:func:`tau_figure`)."""
    plt = _pyplot()
    _save_figure(plt, tau_figure(report), path)


def tau_figure(report: dict):
    """The figure of :func:`plot_tau` (a matplotlib ``Figure``)."""
    plt = _pyplot()
    names = list(report["sets"])
    d = [report["sets"][n]["dflash"]["tau"] or 0.0 for n in names]
    p = [report["sets"][n]["prompt_lookup"]["tau"] or 0.0 for n in names]
    mtp = [_fastest_mtp(report["sets"][n]) for n in names]
    has_mtp = any(m is not None for m in mtp)
    fig, ax = plt.subplots(figsize=(max(5, (1.8 if has_mtp else 1.3) * len(names) + 2), 3.8))
    xs = range(len(names))
    w = 0.27 if has_mtp else 0.4
    offsets = (-w, 0.0, w) if has_mtp else (-w / 2, w / 2)
    bars_d = ax.bar([x + offsets[0] for x in xs], d, w, label=f"{drafter_name(report['run'])} drafter")
    bars_p = ax.bar([x + offsets[1] for x in xs], p, w, label="prompt lookup (reference)")
    groups = [(bars_d, [report["sets"][n]["dflash"] for n in names]),
              (bars_p, [report["sets"][n]["prompt_lookup"] for n in names])]
    if has_mtp:
        bars_m = ax.bar([x + offsets[2] for x in xs], [(m or {}).get("tau") or 0.0 for m in mtp], w,
                        label="the target's MTP head (fastest k)")
        groups.append((bars_m, [m or {} for m in mtp]))
        for bar, m in zip(bars_m, mtp):
            if m is not None:
                ax.annotate(f"k={m['k']}", (bar.get_x() + bar.get_width() / 2, 0.05), ha="center", va="bottom",
                            fontsize=7, color="white")
    for bars, summaries in groups:
        for bar, summary in zip(bars, summaries):
            sp = summary.get("speedup")
            if sp is not None:
                ax.annotate(f"{sp:.2f}x", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                            ha="center", va="bottom", fontsize=8)
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.set_xticks(list(xs), [f"{n}\nn={report['sets'][n]['prompts']} prompts" for n in names])
    ax.set_ylabel("acceptance length τ (tokens / target forward)")
    ax.set_title("τ per benchmark set (labels: wall-clock speedup vs target-only)")
    ax.legend(fontsize=8)
    return fig


def _fastest_mtp(section: dict) -> dict | None:
    """The summary of a set's fastest MTP k (with ``k`` added), or None without MTP rows."""
    m = section.get("mtp")
    if not m or m.get("fastest") is None:
        return None
    return {**m["by_tokens"][str(m["fastest"])], "k": m["fastest"]}


def plot_per_position(report: dict, path) -> None:
    """Lines: per-position acceptance rate P(drafts 1..k accepted) against draft slot k, per set, each labelled with
    its prompts and verify steps (:func:`per_position_figure`)."""
    plt = _pyplot()
    _save_figure(plt, per_position_figure(report), path)


def per_position_figure(report: dict):
    """The figure of :func:`plot_per_position` (a matplotlib ``Figure``)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.8))
    for name, s in report["sets"].items():
        rates = s["dflash"]["per_position"]
        ks = [k + 1 for k, r in enumerate(rates) if r is not None]
        ax.plot(ks, [r for r in rates if r is not None], marker="o", ms=3, label=sample_label(report, name))
    ax.set_xlabel("draft position k")
    ax.set_ylabel("P(drafts 1..k accepted)")
    ax.set_ylim(0, 1.02)
    ax.set_title(f"{drafter_name(report['run'])} per-position acceptance")
    ax.legend(fontsize=8)
    return fig


def plot_histogram(report: dict, path) -> None:
    """Bars: fraction of verify steps committing n tokens (n = 1..B), per set, each labelled with its prompts and
    verify steps (:func:`histogram_figure`)."""
    plt = _pyplot()
    _save_figure(plt, histogram_figure(report), path)


def histogram_figure(report: dict):
    """The figure of :func:`plot_histogram` (a matplotlib ``Figure``)."""
    plt = _pyplot()
    names = list(report["sets"])
    width = max((len(report["sets"][n]["dflash"]["acceptance_histogram"]) for n in names), default=1)
    fig, ax = plt.subplots(figsize=(max(6, 0.5 * width + 3), 3.8))
    bar_w = 0.8 / max(len(names), 1)
    for i, n in enumerate(names):
        hist = report["sets"][n]["dflash"]["acceptance_histogram"]
        total = sum(hist) or 1
        ax.bar([k + 1 - 0.4 + bar_w * (i + 0.5) for k in range(len(hist))], [h / total for h in hist],
               bar_w, label=sample_label(report, n))
    ax.set_xticks(range(1, width + 1))
    ax.set_xlabel("tokens committed in a verify step (accepted drafts + bonus)")
    ax.set_ylabel("fraction of steps")
    ax.set_title(f"{drafter_name(report['run'])} acceptance-length histogram")
    ax.legend(fontsize=8)
    return fig
