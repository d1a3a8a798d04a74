"""Writers from a draftsmith run's merged features to the peers' offline layouts (a benchmark, never a dependency of
the product). The peers' readers, with file:line in their wheels: docs/peers/README.md, "How each peer reads its
data".

Inputs: ``results/features/index.json`` (+ chunks; :class:`draftsmith.features.FeatureIndex`) and
``results/tokenized/train.parquet`` (every row's ids and loss mask are checked against the features' copy). The rows
written are those draftsmith's trainer uses (:func:`peerlib.draftsmith_split`: ``train.eval_fraction`` and
``train.seed`` of the run's config), so every trainer sees the same rows.

**SpecForge 0.2.0** (``specforge``): one ``torch.save`` dict per training row,
``OUT/part-{row // 1000:05d}/row-{row:08d}.ckpt`` (SpecForge lists ``*.ckpt`` recursively, sorted by path: row
order):

==================  ==================  ==========================================================
key                 shape               dtype / meaning
==================  ==================  ==========================================================
``input_ids``       [T]                 int64
``loss_mask``       [T]                 int64, 0/1
``hidden_states``   [T, n_taps * H]     bfloat16, the taps in ``layer_ids`` order (z-lab ids)
==================  ==================  ==========================================================

A row without two consecutive supervised tokens in its first ``--max-length`` tokens (SpecForge's
``data.max_length``) would make SpecForge raise: it is dropped and counted (rows in = written + dropped).

**speculators 0.9.0** (``speculators``, file backend): ``OUT/`` an HF ``datasets`` folder (``save_to_disk``,
torch format) with columns ``input_ids`` (int64 list), ``loss_mask`` (int64 list), ``seq_len`` (int64), and
``OUT/hidden_states/hs_{i}.safetensors`` for dataset row i:

==================  ======================  ======================================================
tensor              shape                   dtype / meaning
==================  ======================  ======================================================
``hidden_states``   [T, n_taps + 1, H]      bfloat16: slots 0..n-1 the taps (draftsmith's features,
                                            the same bytes); slot n the last decoder layer's output
                                            **before** the final norm (speculators applies the
                                            target's final norm and LM head to it for its labels)
``token_ids``       [T]                     int64, equal to the dataset row's ``input_ids``
==================  ======================  ======================================================

Dataset rows: draftsmith's training rows first (row order), then its held-out rows, so ``--train-data-ratio``
(:func:`peerlib.speculators_train_ratio`, in the writer's report) gives speculators exactly draftsmith's split (it
always holds some rows out). Rows with no supervised token are dropped (speculators' prepare-data drops them too).
The tap ids speculators is told are z-lab's + 1 (report ``speculators_target_layer_ids``).

The pre-norm slot is not in draftsmith's features (its last-layer tap, when there is one, is after the norm): the
writer computes it (``--prenorm target``) by running the target over the same rows with draftsmith's own extraction
forward (:class:`draftsmith.extract.extractor.FeatureExtractor`, right-padded batches of ``extract.token_budget``
tokens, :func:`draftsmith.extract.shard.make_batches`) plus one forward hook on the last decoder layer. The same
forward re-extracts the taps and the target's greedy tokens, which are compared with the stored features and
``target_token`` (report ``prenorm_check``). ``--prenorm random`` writes N(0, 1) values instead: for throughput runs
on random features only (the labels are then meaningless).

    python bench/peers/writers.py specforge --features results/features/index.json \
        --tokenized results/tokenized/train.parquet --config config/gpu-proof.yaml --out /tmp/peers/specforge
    python bench/peers/writers.py speculators --features results/features/index.json \
        --tokenized results/tokenized/train.parquet --config config/gpu-proof.yaml --out /tmp/peers/speculators \
        --target resources/targets/smollm2-135m-instruct --device cuda
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from peerlib import (
    SPECFORGE_SUFFIX,
    SPECULATORS_HS_DIR,
    disk_room,
    draftsmith_split,
    has_supervised_pair,
    human_bytes,
    json_ready,
    load_config,
    speculators_hs_name,
    speculators_layer_ids,
    speculators_train_ratio,
)

log = logging.getLogger("peers.writers")
SPECFORGE_REPORT = "specforge-writer.json"
SPECULATORS_REPORT = "speculators-writer.json"
FORMAT = "draftsmith.peers.writer/1"


class WriterError(ValueError):
    """The inputs disagree (a row's ids or loss mask differ between the features and the tokenized parquet, a row
    is missing): the message names the file, row and field."""


# --------------------------------------------------------------------------------------------------------------
# reading draftsmith's rows
# --------------------------------------------------------------------------------------------------------------

class Rows:
    """draftsmith's features and tokenized rows, read together and checked against each other.

    Args:
        index_path: ``results/features/index.json``.
        tokenized_path: ``results/tokenized/train.parquet`` (the rows the features were extracted from).
    """

    def __init__(self, index_path: str | os.PathLike, tokenized_path: str | os.PathLike):
        from draftsmith.features import FeatureIndex
        from draftsmith.tokenized import read_tokenized

        self.index = FeatureIndex(index_path)
        self.tokenized = read_tokenized(tokenized_path)
        self.layer_ids = list(self.index.layer_ids)
        self.hidden = int(self.index.hidden_size)
        self.num_taps = len(self.layer_ids)
        beyond = [s.row for s in self.index.samples if s.row >= self.tokenized.num_rows]
        if beyond:
            raise WriterError(f"{index_path}: holds tokenized rows {beyond[:3]} but {tokenized_path} has "
                              f"{self.tokenized.num_rows} rows: features of another tokenized set")

    def read(self, row: int) -> dict[str, torch.Tensor]:
        """Row ``row``: ``features [T, n * H]`` bf16, ``input_ids`` / ``loss_mask`` ``[T]`` int64 and, when
        stored, ``target_token [T]`` int64 (the target's greedy next token at each position).

        Raises:
            WriterError: the features' ids or loss mask differ from the tokenized parquet's (row, id, field named).
        """
        part = self.index.read(self.index.ref(row), dtype=torch.bfloat16)
        ids, mask = self.tokenized.row(row)
        where = f"{self.index.path}: {self.tokenized.describe(row)}"
        if part["input_ids"].numel() != len(ids) or not np.array_equal(part["input_ids"].numpy(), ids):
            raise WriterError(f"{where}: field input_ids of the features differs from {self.tokenized.path}")
        if not np.array_equal(part["loss_mask"].numpy().astype(np.int8), mask):
            raise WriterError(f"{where}: field loss_mask of the features differs from {self.tokenized.path}")
        out = {"features": part["features"], "input_ids": part["input_ids"].to(torch.int64),
               "loss_mask": part["loss_mask"].to(torch.int64)}
        if "target_token" in part:
            out["target_token"] = part["target_token"].to(torch.int64)
        return out


def _save_atomic(path: Path, write) -> int:
    """``write(tmp)`` then rename onto ``path`` (a name the peers' readers skip while it is written); its size."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    write(tmp)
    os.replace(tmp, path)
    return path.stat().st_size


class _Pool:
    """A thread pool with at most ``depth`` writes in flight (bounds the memory of rows waiting to be written)."""

    def __init__(self, threads: int, depth: int = 64):
        self.pool = ThreadPoolExecutor(max_workers=max(1, threads))
        self.depth = depth
        self.pending: list[Future] = []
        self.bytes = 0

    def submit(self, fn, *args) -> None:
        self.pending.append(self.pool.submit(fn, *args))
        if len(self.pending) >= self.depth:
            self.drain(self.depth // 2)

    def drain(self, keep: int = 0) -> None:
        while len(self.pending) > keep:
            self.bytes += self.pending.pop(0).result()

    def close(self) -> int:
        self.drain()
        self.pool.shutdown()
        return self.bytes


# --------------------------------------------------------------------------------------------------------------
# SpecForge
# --------------------------------------------------------------------------------------------------------------

def specforge_path(out: Path, row: int) -> Path:
    return out / f"part-{row // 1000:05d}" / f"row-{row:08d}{SPECFORGE_SUFFIX}"


def write_specforge(rows: Rows, out: str | os.PathLike, train_rows: list[int], *, max_length: int,
                    threads: int = 8, heldout_rows: list[int] | None = None) -> dict:
    """Write SpecForge's offline files for ``train_rows`` into ``out`` (see the module docstring).

    Args:
        max_length: SpecForge's ``data.max_length``: it cuts every sample there before its two-consecutive-
            supervised-tokens check, so the filter here looks at that prefix only.
        heldout_rows: draftsmith's held-out rows, recorded in the report (not written).

    Returns:
        The report (also ``out/specforge-writer.json``): rows in / written / dropped by reason (with the rows),
        tokens and bytes written, the layer ids, the seconds taken.
    """
    out = Path(out)
    t0 = time.perf_counter()
    lengths = {r: int(rows.tokenized.num_tokens[r]) for r in train_rows}
    disk_room(out, sum(lengths.values()) * (rows.num_taps * rows.hidden * 2 + 16) + 1500 * len(train_rows),
              "SpecForge files")
    pool = _Pool(threads)
    written, dropped, tokens = [], {"no_consecutive_supervised_pair": []}, 0
    for row in train_rows:
        sample = rows.read(row)
        if not has_supervised_pair(sample["loss_mask"].tolist(), max_length):
            dropped["no_consecutive_supervised_pair"].append(row)
            continue
        record = {"input_ids": sample["input_ids"].clone(), "loss_mask": sample["loss_mask"].clone(),
                  "hidden_states": sample["features"].clone()}  # clones: never a view of the mapped chunk
        pool.submit(_save_atomic, specforge_path(out, row), lambda tmp, record=record: torch.save(record, tmp))
        written.append(row)
        tokens += record["input_ids"].numel()
    nbytes = pool.close()
    report = {
        "format": FORMAT, "peer": "specforge", "out": str(out), "features": str(rows.index.path),
        "tokenized": str(rows.tokenized.path), "layer_ids": rows.layer_ids, "hidden_size": rows.hidden,
        "max_length": int(max_length), "rows_in": len(train_rows), "rows_written": len(written),
        "rows_dropped": {k: len(v) for k, v in dropped.items()}, "dropped_rows": dropped,
        "tokens_written": tokens, "truncated_rows": sum(1 for r in written if lengths[r] > max_length),
        "bytes_written": nbytes, "heldout_rows": len(heldout_rows or []), "seconds": time.perf_counter() - t0,
    }
    _check_counts(report)
    (out / SPECFORGE_REPORT).write_text(json.dumps(json_ready(report), indent=1) + "\n")
    log.info("SpecForge: %d rows in = %d written + %d dropped (%s), %d tokens, %s in %.1f s -> %s",
             len(train_rows), len(written), sum(report["rows_dropped"].values()), report["rows_dropped"], tokens,
             human_bytes(nbytes), report["seconds"], out)
    return report


def _check_counts(report: dict) -> None:
    if report["rows_in"] != report["rows_written"] + sum(report["rows_dropped"].values()):
        raise AssertionError(f"rows in {report['rows_in']} != written {report['rows_written']} + dropped "
                             f"{report['rows_dropped']}")


# --------------------------------------------------------------------------------------------------------------
# speculators: the pre-norm slot
# --------------------------------------------------------------------------------------------------------------

class TargetPrenorm:
    """The last decoder layer's output before the final norm, per row, from the target itself.

    Runs draftsmith's extraction forward (:class:`~draftsmith.extract.extractor.FeatureExtractor`: the decoder on
    right-padded batches, the tapped layers hooked, the target's greedy token per position) with one more forward
    hook on the last decoder layer (``FeatureExtractor`` normalises that layer's output, as the z-lab convention
    wants; speculators wants it raw).

    Args:
        target_dir: the target's folder (``resources/targets/...``).
        layer_ids: the taps (z-lab ids), re-extracted to check the stored features.
        device / dtype: where and in which precision the target runs (the run's ``target.dtype``).
        token_budget: padded tokens per forward (``extract.token_budget``).
        padding_mask: pass the attention mask (``extract.padding_mask``).
    """

    def __init__(self, target_dir: str | os.PathLike, layer_ids: list[int], *, device: str, dtype: str,
                 token_budget: int, padding_mask: bool = True):
        from draftsmith.extract.extractor import FeatureExtractor
        from draftsmith.target import decoder_layers, load_target

        self.model = load_target(target_dir, dtype=dtype, device=device)
        self.token_budget = int(token_budget)
        self.extractor = FeatureExtractor(self.model, list(layer_ids), target_tokens=True,
                                          padding_mask=padding_mask)
        self.last = decoder_layers(self.model)[-1]
        self.hidden = int(self.extractor.hidden)
        self._pre: torch.Tensor | None = None
        self.forwards = 0

    def _grab(self, module, args, output) -> None:
        self._pre = output[0] if isinstance(output, (tuple, list)) else output

    def batches(self, rows: list[int], tokenized) -> list:
        from draftsmith.extract.shard import make_batches

        return make_batches(rows, [int(tokenized.num_tokens[r]) for r in rows], self.token_budget)

    @torch.inference_mode()
    def __call__(self, samples: list[np.ndarray]) -> tuple[list[torch.Tensor], list[torch.Tensor],
                                                            list[torch.Tensor]]:
        """``(pre-norm [T, H] bf16, taps [T, n * H] bf16, greedy tokens [T] int64)`` per sample, on the CPU."""
        handle = self.last.register_forward_hook(self._grab)
        try:
            with self.extractor:
                taps, tokens = self.extractor(samples)
        finally:
            handle.remove()
        self.forwards += 1
        pre, self._pre = self._pre, None
        lengths = [len(s) for s in samples]
        seq = max(lengths)
        pre = pre.reshape(len(samples) * seq, -1)
        index = torch.cat([b * seq + torch.arange(n) for b, n in enumerate(lengths)]).to(pre.device)
        pre = pre.index_select(0, index)
        splits = [int(n) for n in lengths]
        return ([p.to(torch.bfloat16).cpu() for p in pre.split(splits)],
                [t.to(torch.bfloat16).cpu() for t in taps.split(splits)],
                [t.to(torch.int64).cpu() for t in tokens.split(splits)])


class RandomPrenorm:
    """N(0, 1) bf16 values in place of the pre-norm slot (seeded per row): for throughput runs on random features,
    where no target exists; speculators' labels (argmax of its norm and LM head) are then random too."""

    def __init__(self, hidden: int, seed: int = 0):
        self.hidden, self.seed = int(hidden), int(seed)

    def row(self, row: int, length: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + row)
        return torch.randn(length, self.hidden, generator=g).to(torch.bfloat16)


class _Check:
    """Running comparison of the re-extracted taps / greedy tokens with the stored ones."""

    def __init__(self):
        self.tokens = self.agree = 0
        self.max_rel = 0.0
        self.sum_sq_err = self.sum_sq = 0.0

    def add(self, stored: dict, taps: torch.Tensor, greedy: torch.Tensor) -> None:
        if "target_token" in stored:
            self.tokens += greedy.numel()
            self.agree += int((greedy == stored["target_token"]).sum())
        a, b = taps.float(), stored["features"].float()
        err = (a - b).pow(2).sum().item()
        self.sum_sq_err += err
        self.sum_sq += b.pow(2).sum().item()
        self.max_rel = max(self.max_rel, float(((a - b).abs().max() / b.abs().max().clamp_min(1e-6)).item()))

    def summary(self) -> dict:
        return {"greedy_token_agreement": (self.agree / self.tokens) if self.tokens else None,
                "tokens_compared": self.tokens,
                "taps_relative_rms_error": (self.sum_sq_err / self.sum_sq) ** 0.5 if self.sum_sq else None,
                "taps_max_abs_error_over_max": self.max_rel}


# --------------------------------------------------------------------------------------------------------------
# speculators
# --------------------------------------------------------------------------------------------------------------

def write_speculators(rows: Rows, out: str | os.PathLike, train_rows: list[int], heldout_rows: list[int], *,
                      prenorm: TargetPrenorm | RandomPrenorm, threads: int = 8,
                      min_greedy_agreement: float = 0.95) -> dict:
    """Write speculators' dataset folder and hidden-state files into ``out`` (see the module docstring).

    Args:
        train_rows / heldout_rows: draftsmith's split; dataset rows are the training rows then the held-out ones.
        prenorm: where the pre-norm last-layer slot comes from.
        min_greedy_agreement: with ``TargetPrenorm`` and stored target tokens, the least fraction of positions
            whose re-computed greedy token (from the pre-norm slot through the final norm and LM head: what
            speculators trains on) must equal the stored one; below it the writer fails (a wrong target, or a
            wrong slot).

    Returns:
        The report (also ``out/speculators-writer.json``): rows in / written / dropped (by reason, rows listed),
        ``train_rows`` / ``val_rows`` and the ``train_data_ratio`` that splits them, ``speculators_target_layer_ids``,
        tokens and bytes, the pre-norm source and its check against the stored features.

    Raises:
        WriterError: see :meth:`Rows.read`; ValueError: the re-computed greedy tokens agree with the stored ones on
        fewer than ``min_greedy_agreement`` of the positions.
    """
    import datasets
    import pyarrow as pa
    from safetensors.torch import save_file

    out = Path(out)
    t0 = time.perf_counter()
    order = list(train_rows) + list(heldout_rows)
    lengths = {r: int(rows.tokenized.num_tokens[r]) for r in order}
    per_token = (rows.num_taps + 1) * rows.hidden * 2 + 8 + 16
    disk_room(out, sum(lengths.values()) * per_token + 200 * len(order), "speculators files")
    hs_dir = out / SPECULATORS_HS_DIR
    hs_dir.mkdir(parents=True, exist_ok=True)

    keep, dropped = [], {"no_supervised_token": []}
    for r in order:
        if int(rows.tokenized.row(r)[1].sum()) == 0:
            dropped["no_supervised_token"].append(r)
        else:
            keep.append(r)
    position = {r: i for i, r in enumerate(keep)}  # dataset row (= hs file index) of each kept tokenized row
    train_set = set(train_rows)
    n_train = sum(1 for r in keep if r in train_set)
    pool = _Pool(threads)
    check = _Check()
    source = type(prenorm).__name__

    def emit(row: int, sample: dict, pre: torch.Tensor) -> None:
        T = sample["input_ids"].numel()
        if pre.shape != (T, rows.hidden):
            raise AssertionError(f"row {row}: pre-norm slot {tuple(pre.shape)} != ({T}, {rows.hidden})")
        hs = torch.cat([sample["features"].reshape(T, rows.num_taps, rows.hidden), pre[:, None, :]], dim=1)
        tensors = {"hidden_states": hs.contiguous(), "token_ids": sample["input_ids"].clone()}
        pool.submit(_save_atomic, hs_dir / speculators_hs_name(position[row]),
                    lambda tmp, tensors=tensors: save_file(tensors, str(tmp)))

    if isinstance(prenorm, TargetPrenorm):
        for batch in prenorm.batches(keep, rows.tokenized):
            samples = [rows.tokenized.row(r)[0] for r in batch.rows]
            pres, taps, greedy = prenorm(samples)
            for r, p, t, g in zip(batch.rows, pres, taps, greedy):
                sample = rows.read(r)
                check.add(sample, t, g)
                emit(r, sample, p)
    else:
        for r in keep:
            emit(r, rows.read(r), prenorm.row(r, lengths[r]))
    nbytes = pool.close()

    offsets = np.zeros(len(keep) + 1, dtype=np.int64)
    offsets[1:] = np.cumsum([lengths[r] for r in keep])
    ids = np.concatenate([rows.tokenized.row(r)[0] for r in keep]).astype(np.int64)
    mask = np.concatenate([rows.tokenized.row(r)[1] for r in keep]).astype(np.int64)
    table = pa.table({
        "input_ids": pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), pa.array(ids)),
        "loss_mask": pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), pa.array(mask)),
        "seq_len": pa.array([lengths[r] for r in keep], pa.int64()),
    })
    dataset = datasets.Dataset(table)
    dataset.set_format("torch")
    dataset.save_to_disk(str(out))

    summary = check.summary() if isinstance(prenorm, TargetPrenorm) else None
    report = {
        "format": FORMAT, "peer": "speculators", "out": str(out), "features": str(rows.index.path),
        "tokenized": str(rows.tokenized.path), "layer_ids": rows.layer_ids,
        "speculators_target_layer_ids": speculators_layer_ids(rows.layer_ids), "hidden_size": rows.hidden,
        "rows_in": len(order), "rows_written": len(keep), "rows_dropped": {k: len(v) for k, v in dropped.items()},
        "dropped_rows": dropped, "train_rows": n_train, "val_rows": len(keep) - n_train,
        "train_data_ratio": speculators_train_ratio(n_train, len(keep)),
        "dataset_rows": {"first_train": keep[:3], "first_val": keep[n_train:n_train + 3]},
        "tokens_written": int(offsets[-1]), "bytes_written": nbytes, "prenorm": source,
        "prenorm_check": summary, "seconds": time.perf_counter() - t0,
    }
    _check_counts(report)
    (out / SPECULATORS_REPORT).write_text(json.dumps(json_ready(report), indent=1) + "\n")
    log.info("speculators: %d rows in = %d written (%d train + %d val, ratio %.6f) + %d dropped, %d tokens, %s, "
             "pre-norm slot: %s %s, %.1f s -> %s", len(order), len(keep), n_train, len(keep) - n_train,
             report["train_data_ratio"], sum(report["rows_dropped"].values()), report["tokens_written"],
             human_bytes(nbytes), source, summary or "", report["seconds"], out)
    agree = (summary or {}).get("greedy_token_agreement")
    if agree is not None and agree < min_greedy_agreement:
        raise ValueError(f"{out}: the greedy tokens recomputed from the pre-norm slot agree with {rows.index.path}'s "
                         f"target_token on {agree:.4f} of the positions (< {min_greedy_agreement}): wrong target, "
                         "or a wrong layer captured")
    return report


# --------------------------------------------------------------------------------------------------------------
# command line
# --------------------------------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("peer", choices=["specforge", "speculators"])
    ap.add_argument("--features", required=True, type=Path, help="results/features/index.json")
    ap.add_argument("--tokenized", required=True, type=Path, help="results/tokenized/train.parquet")
    ap.add_argument("--config", nargs="*", default=[], help="the run's --configfile files (train.eval_fraction, "
                    "train.seed, target.dtype, extract.token_budget / padding_mask); config.yaml is read first")
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--max-length", type=int, default=None,
                    help="SpecForge's data.max_length (default: the run's tokenize.max_length)")
    ap.add_argument("--prenorm", choices=["target", "random"], default="target")
    ap.add_argument("--target", type=Path, help="the target folder (--prenorm target)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--threads", type=int, default=8, help="files written in parallel")
    ap.add_argument("--all-rows", action="store_true",
                    help="write every indexed row as training data (no held-out split; random-feature benches)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")

    config = load_config(args.config)
    rows = Rows(args.features, args.tokenized)
    if args.all_rows:
        train_rows, heldout = sorted(s.row for s in rows.index.samples), []
    else:
        train_rows, heldout = draftsmith_split(rows.index, float(config["train"]["eval_fraction"]),
                                               int(config["train"]["seed"]))
    log.info("draftsmith's split: %d training rows, %d held out (train.eval_fraction %s, seed %s)",
             len(train_rows), len(heldout), config["train"]["eval_fraction"], config["train"]["seed"])
    if args.peer == "specforge":
        write_specforge(rows, args.out, train_rows, heldout_rows=heldout, threads=args.threads,
                        max_length=args.max_length or int(config["tokenize"]["max_length"]))
        return 0
    if args.all_rows:  # speculators always validates on some rows: the last one then
        train_rows, heldout = train_rows[:-1], train_rows[-1:]
    if args.prenorm == "target":
        if args.target is None:
            ap.error("--prenorm target needs --target")
        prenorm = TargetPrenorm(args.target, rows.layer_ids, device=args.device, dtype=config["target"]["dtype"],
                                token_budget=int(config["extract"]["token_budget"]),
                                padding_mask=bool(config["extract"]["padding_mask"]))
    else:
        prenorm = RandomPrenorm(rows.hidden)
    write_speculators(rows, args.out, train_rows, heldout, prenorm=prenorm, threads=args.threads)
    return 0


if __name__ == "__main__":
    sys.exit(main())
