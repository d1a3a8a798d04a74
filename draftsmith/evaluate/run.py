"""The evaluate stage: decode every benchmark prompt three ways (or more) in the same run and write the report.

For each prompt of each set: target-only decoding (the baseline and the lossless reference), DFlash
speculative decoding with the exported drafter, prompt-lookup speculative decoding (reference
drafter), with ``drafter.init_from`` the drafter training started from (method ``dflash_start``: the report's before
-> after) and, when the target's checkpoint carries an MTP head, speculative decoding with it once per
``evaluate.mtp.num_speculative_tokens`` entry, in an order rotated from prompt to prompt so that no method is
always timed first.

Resume: each decoding process saves the conversations it has decoded under ``partial_dir/<set>/`` (atomically, at
most ``evaluate.checkpoint_interval`` seconds apart and at the end of each set, keyed by a fingerprint of the
drafter weights, target, set, sampling and template kwargs), so a killed job loses at most that many seconds of
decoding; a rerun, with any number of decoding workers, reuses every saved conversation, and a process with
nothing left to decode never loads the target. The folder is removed once the report is written.

:func:`run_evaluate` reads top to bottom; the parts live beside it: :mod:`.settings` (the keys it reads),
:mod:`.drafter` (the exported drafter), :mod:`.decoders` (the decoders and how they decode a set), :mod:`.resume`
(saved conversations and their keys), :mod:`.workers` and :mod:`.worker` (one decoding process per GPU) and
:mod:`.report` (report.json's sections, report.md, plots).
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import torch

from draftsmith.evaluate.decoders import (
    EvaluateInputs,
    aggregate,
    decode_set,
    decoding_path,
    prepare_decoders,
    read_sets,
)
from draftsmith.evaluate.report import (
    REPORT_FORMAT,
    overall_report,
    plot_histogram,
    plot_per_position,
    plot_tau,
    render_markdown,
    run_metadata,
    set_report,
    start_drops,
    training_summary,
)
from draftsmith.evaluate.resume import load_saved, run_key, save_conversations, saved_file, set_key, unsaved
from draftsmith.evaluate.settings import EvaluateSettings
from draftsmith.evaluate.workers import deal_conversations, decoding_workers, on_cuda, run_workers
from draftsmith.io import read_json, write_json, write_text
from draftsmith.progress import progress

log = logging.getLogger("draftsmith.evaluate")


def run_evaluate(*, target_dir: str, drafter_dir: str, curated_eval: str, tokenized_eval: str,
                 outputs: dict[str, str], settings: EvaluateSettings, sources: list[dict],
                 device: torch.device | str | None = None,
                 partial_dir: str | None = None, drafter_implementation: str = "draftsmith",
                 trainer_state: str | None = None, workers: int | None = None) -> dict:
    """Run the evaluate stage and write report.json, report.md and the three plots.

    Steps: prepare the decoders (:func:`~draftsmith.evaluate.decoders.prepare_decoders`; the models load with the
    first prompt decoded) -> read the sets (first prompts that fit) -> per set, reuse the conversations an
    interrupted run saved and decode the others (:func:`~draftsmith.evaluate.decoders.decode_set`, saving as it
    goes), or with several workers start those with conversations left and join their saved results -> the report
    (per set, and "all" counting a prompt in several sets once) -> report.md and plots.

    Args:
        target_dir: the target's Hugging Face folder.
        drafter_dir: the exported drafter folder (``results/drafter/final``).
        curated_eval: ``results/curated/eval.parquet`` (benchmark conversations).
        tokenized_eval: ``results/tokenized/eval.parquet`` (its metadata: chat template kwargs and
            tokenizer fingerprint used for training).
        outputs: paths ``json``, ``md``, ``tau``, ``positions``, ``histogram``.
        settings: config ``evaluate`` (sets, sampling, prompt lookup, ...) and ``target`` (dtype,
            attn_implementation, trust_remote_code).
        sources: config ``data.sources`` (``split: both`` sources form the ``heldout`` set).
        device: default: ``cuda`` if available else ``cpu``.
        partial_dir: where decoded conversations are kept until the report is written (resume; default
            ``partial/`` beside the report).
        trainer_state: the training run's ``trainer_state.json``: its held-out (teacher-forced) block τ is
            reported beside the decoded τ.
        workers: decoding processes (default :func:`~draftsmith.evaluate.workers.decoding_workers`:
            ``evaluate.workers_per_gpu`` on each GPU of ``evaluate.gpus`` when that many GPUs are visible). With
            more than one, each decodes the conversations
            :func:`~draftsmith.evaluate.workers.deal_conversations` gives it on its GPU
            (:func:`~draftsmith.evaluate.workers.gpu_of`) or the CPU
            (``python -m draftsmith.evaluate.worker``), and this process merges their results in the sets' order
            and writes the report as from one process.

    Returns:
        The report dict (also written to ``outputs["json"]``).

    Raises:
        ValueError: drafter / target mismatch, tokenizer differing from the one training used, bad sets.
        RuntimeError: a decoding worker failed (its traceback is in the log) or left a set undone.
    """
    options = settings.evaluate
    inputs = EvaluateInputs(target_dir=str(target_dir), drafter_dir=str(drafter_dir), curated_eval=str(curated_eval),
                            tokenized_eval=str(tokenized_eval), sources=sources,
                            drafter_implementation=drafter_implementation)
    partial = Path(partial_dir) if partial_dir else Path(outputs["json"]).parent / "partial"
    workers = decoding_workers(options.gpus, device, options.workers_per_gpu) if workers is None else int(workers)
    # processes sharing a GPU: their τ is one process's, their timings are not
    shared = min(int(options.workers_per_gpu), workers) if workers > 1 and on_cuda(device) else 1

    # the decoders (the target and drafter load with the first prompt decoded) and the sets' prompts
    decoders = prepare_decoders(inputs, settings, device)
    sets = read_sets(decoders, inputs, options.sets)
    base_key = run_key(decoders, inputs.target_dir, inputs.drafter_dir)
    keys = {bset.name: set_key(base_key, bset) for bset in sets}

    # decode: every worker with conversations left decodes its share on its own GPU, then exits
    if workers > 1:
        deal = deal_conversations(sets, workers)
        left = sorted({deal[c.id] for bset in sets
                       for c in unsaved(bset, load_saved(partial, bset.name, keys[bset.name]))})
        if left:
            run_workers(workers, inputs, settings, partial, device, left)
        else:
            log.info("evaluate: every conversation was saved by an earlier run: no decoding worker started")
    bar = progress(sum(len(c.user_turns) for b in sets for c in b.conversations), "evaluate", unit="prompt",
                   logger=log, interval=float(options.progress_interval))
    done: dict[str, dict] = {}  # set -> its prompts' results in order (decoders.aggregate)
    set_reports: dict[str, dict] = {}
    decoded: dict = {}  # a prompt in several sets is decoded once (decode_set)
    try:  # a failed decoding stops the heartbeat too (its thread would log on after the job's error)
        for bset in sets:
            key = keys[bset.name]
            saved = load_saved(partial, bset.name, key)
            if workers > 1:  # the workers' saved conversations, in the set's order (RuntimeError if one is missing)
                done[bset.name] = aggregate(bset, saved)
                bar.update(done[bset.name]["planned"])
            else:  # decoded here, after the conversations an interrupted run saved
                reused = len(bset.conversations) - len(unsaved(bset, saved))
                if reused:
                    log.info("set %s: %d of its %d conversations were saved by an interrupted run (%s): reused",
                             bset.name, reused, len(bset.conversations), partial / bset.name)
                path = saved_file(partial, bset.name, "main")
                done[bset.name] = decode_set(decoders, bset, decoded, bar, saved,
                                             lambda records, key=key, path=path: save_conversations(path, key, records),
                                             float(options.checkpoint_interval))
                if decoders.target is not None and not (partial / "decoding.json").is_file():
                    write_json(partial / "decoding.json", decoding_path(decoders))  # a resumed run's report needs it
            set_reports[bset.name] = set_report(bset, done[bset.name], decoders.sampling, decoders.block_size)
    finally:
        bar.close()

    # aggregate: the report, "all" counting a prompt in several sets once
    path_file = partial / "decoding.json"
    if decoders.target is None and path_file.is_file():  # nothing decoded here: how the decoders ran
        how = read_json(path_file)
    else:
        how = decoding_path(decoders)
    report = {
        "format": REPORT_FORMAT,
        "run": {**run_metadata(decoders, target_dir, drafter_dir, base_key["drafter"], drafter_implementation, how),
                "decoding_workers": workers, "workers_per_gpu": shared},
        "sets": set_reports,
        "overall": overall_report(sets, done, set_reports, decoders.sampling, decoders.block_size),
        "training": training_summary(trainer_state),
    }

    # write it
    write_json(outputs["json"], report)
    write_text(outputs["md"], render_markdown(report))
    plot_tau(report, outputs["tau"])
    plot_per_position(report, outputs["positions"])
    plot_histogram(report, outputs["histogram"])
    shutil.rmtree(partial, ignore_errors=True)
    if decoders.start_dir:  # before -> after: name every set whose τ the training lowered, with its size
        drops = start_drops(report)
        for name, before, after in drops:
            log.warning("!!! τ dropped on set %s: %.2f with the drafter training started from (%s), %.2f after "
                        "training (%+.2f); report.md's before -> after section pairs them by prompt", name, before,
                        decoders.start_dir, after, after - before)
        if not drops:
            log.info("before -> after (%s): τ held or rose on every set: %s", decoders.start_dir, ", ".join(
                f"{n} {s['start']['before']['tau']:.2f} -> {s['dflash']['tau']:.2f}"
                for n, s in set_reports.items() if s.get("start") and s["start"]["before"]["tau"] is not None))
    bad = [n for n, s in set_reports.items() if s["lossless"] is not None
           and not all(check["lossless"] for check in s["lossless"].values())]
    if bad:
        log.warning("!" * 20 + " greedy speculative output differs from target-only output in set(s) %s "
                    "(see report.json lossless.mismatches; bf16 kernels whose results depend on the number of "
                    "tokens per forward can flip near-tied argmaxes)", ", ".join(bad))
    return report
