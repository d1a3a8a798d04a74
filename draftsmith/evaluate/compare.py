"""Two evaluation reports side by side: τ and tokens/s per set, whole and paired by prompt.

Which drafter is better, DFlash or DFlash2, more data or less, this run or the last? Each evaluate run reports its
own sets, but two runs need not decode the same prompts: a multi-turn set's later prompts hold the target's own
earlier answers, and bf16 greedy decoding of the target is not reproducible across runs or machines, so those
prompts can differ. This module compares two ``report.json`` files on the prompts both decoded, matched by
``prompt_key`` (the hash of a prompt's token ids), with a bootstrap interval over prompts:

    python -m draftsmith.evaluate.compare BASE/report.json NEW/report.json --names dflash,dflash2

For each set found in both reports it gives:

* the whole-set figures each report gives: DFlash τ, tokens/s, speedup over target-only, prompt lookup's τ
  and tokens/s from the same report, and the target's own MTP head at its fastest number of drafts (τ, tokens/s;
  reports since format 3, of targets whose checkpoint has one) with whether the drafter is faster than it;
* the paired figures on the matched prompts: each drafter's τ (committed tokens / verify forwards, summed over the
  prompts) and tokens/s (tokens / seconds), the ratio new / base of each, and a 95% percentile bootstrap interval
  of the ratio. The interval resamples prompts with replacement, the same resample for both reports (Efron and
  Tibshirani, *An Introduction to the Bootstrap*, 1993, ch. 13). The ratio is a ratio of sums, so a long prompt
  weighs as much as its verify forwards.

The ``all`` row pools every set's prompts once each, as the report's own ``overall`` does. Paired figures need the
per-prompt sums (``dflash_committed``, ``dflash_steps``, ``dflash_tokens``) that reports have held since
2026-12-02. An older report gives the whole-set figures only, and the output says so.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from draftsmith.io import write_json, write_text

#: the per-prompt fields the paired figures read (report.json ``sets.<name>.per_prompt[]``)
PAIRED_FIELDS = ("dflash_committed", "dflash_steps", "dflash_tokens", "dflash_s")


def load_report(path: str | Path) -> dict:
    """An evaluate ``report.json``.

    Raises:
        FileNotFoundError: no such file.
        ValueError: the file is not JSON, or not an evaluate report (its ``format`` is not ``draftsmith.eval/*``).
    """
    path = Path(path)
    try:
        report = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: not JSON ({err})") from err
    fmt = report.get("format", "") if isinstance(report, dict) else ""
    if not str(fmt).startswith("draftsmith.eval/"):
        raise ValueError(f"{path}: format {fmt!r} is not an evaluate report (draftsmith.eval/*); give the "
                         "results/eval/report.json an evaluate run wrote")
    return report


def _whole(section: dict) -> dict:
    """A set's (or ``overall``'s) own figures: DFlash τ, tokens/s, speedup; prompt lookup τ and tokens/s; the MTP
    head's at its fastest k (``mtp_k``, ``mtp_tau``, ``mtp_tokens_per_s``, ``mtp_speedup``; None without MTP rows)."""
    d, p = section.get("dflash") or {}, section.get("prompt_lookup") or {}
    mtp = section.get("mtp") or {}
    k = mtp.get("fastest")
    m = (mtp.get("by_tokens") or {}).get(str(k)) or {}
    return {"prompts": section.get("prompts"), "tau": d.get("tau"), "tokens_per_s": d.get("tokens_per_s"),
            "speedup": d.get("speedup"), "lookup_tau": p.get("tau"), "lookup_tokens_per_s": p.get("tokens_per_s"),
            "mtp_k": k, "mtp_tau": m.get("tau"), "mtp_tokens_per_s": m.get("tokens_per_s"),
            "mtp_speedup": m.get("speedup")}


def _prompts(report: dict, sets: list[str]) -> dict[str, dict] | None:
    """prompt_key -> per-prompt row over ``sets`` (a prompt in several sets once); None when a row lacks the
    paired fields (a report written before they existed)."""
    rows: dict[str, dict] = {}
    for name in sets:
        for row in report["sets"][name].get("per_prompt", []):
            if any(f not in row for f in PAIRED_FIELDS):
                return None
            rows.setdefault(row["prompt_key"], row)
    return rows


def _ratio_interval(base: np.ndarray, new: np.ndarray, resamples: int, rng: np.random.Generator
                    ) -> tuple[float | None, float | None]:
    """95% percentile bootstrap interval of sum(new[:, 0]) / sum(new[:, 1]) over sum(base[:, 0]) / sum(base[:, 1])
    (rows: prompts, paired; columns: numerator, denominator), resampling prompts."""
    n = len(base)
    if n < 2 or resamples < 1:
        return None, None
    idx = rng.integers(0, n, size=(resamples, n))
    b, w = base[idx].sum(axis=1), new[idx].sum(axis=1)  # [resamples, 2]
    ok = (b[:, 1] > 0) & (w[:, 1] > 0) & (b[:, 0] > 0)
    ratios = (w[ok, 0] / w[ok, 1]) / (b[ok, 0] / b[ok, 1])
    if len(ratios) == 0:
        return None, None
    lo, hi = np.percentile(ratios, [2.5, 97.5])
    return float(lo), float(hi)


def paired(base_rows: dict[str, dict], new_rows: dict[str, dict], resamples: int = 2000, seed: int = 0, *,
           base_method: str = "dflash", new_method: str = "dflash") -> dict:
    """Paired τ and tokens/s on the prompts both row sets hold (matched by key), and the 95% bootstrap intervals of
    their ratios new / base (:func:`_ratio_interval`).

    Args:
        base_rows, new_rows: ``{key: per-prompt row}`` (report.json ``per_prompt`` rows: ``<method>_committed``,
            ``<method>_steps``, ``<method>_tokens``, ``<method>_s``), e.g. keyed by ``prompt_key``.
        base_method, new_method: the method each side reads (``dflash``; evaluate's before -> after pairs
            ``dflash_start`` against ``dflash`` rows of one report).

    Returns:
        ``{"matched", "base_only", "new_only"}`` prompt counts and, when any matched, per metric (``tau``,
        ``tokens_per_s``) ``{"base", "new", "ratio", "ratio_low", "ratio_high"}`` (None where a sum is 0).
    """
    keys = [k for k in base_rows if k in new_rows]
    out = {"matched": len(keys), "base_only": len(base_rows) - len(keys), "new_only": len(new_rows) - len(keys)}
    if not keys:
        return out
    rng = np.random.default_rng(seed)

    def cols(rows: dict[str, dict], a: str, b: str) -> np.ndarray:  # [prompts, 2] float64
        return np.array([[rows[k][a], rows[k][b]] for k in keys], dtype=np.float64)

    for metric, (num, den) in {"tau": ("committed", "steps"), "tokens_per_s": ("tokens", "s")}.items():
        b = cols(base_rows, f"{base_method}_{num}", f"{base_method}_{den}")
        w = cols(new_rows, f"{new_method}_{num}", f"{new_method}_{den}")
        vb = b[:, 0].sum() / b[:, 1].sum() if b[:, 1].sum() > 0 else None
        vw = w[:, 0].sum() / w[:, 1].sum() if w[:, 1].sum() > 0 else None
        lo, hi = _ratio_interval(b, w, resamples, rng)
        out[metric] = {"base": vb, "new": vw, "ratio": vw / vb if vb and vw is not None else None,
                       "ratio_low": lo, "ratio_high": hi}
    return out


def compare_reports(base: dict, new: dict, *, names: tuple[str, str] = ("base", "new"), resamples: int = 2000,
                    seed: int = 0) -> dict:
    """Compare two evaluate reports set by set (see the module docstring).

    Args:
        base, new: two ``report.json`` dicts (:func:`load_report`); ratios are new / base.
        names: how the output names the two (e.g. ``("dflash", "dflash2")``).
        resamples: bootstrap resamples of the prompts (0: no intervals).
        seed: the bootstrap's random seed (the same seed gives the same intervals).

    Returns:
        ``{"names", "base_drafter", "new_drafter", "sets": {set: {"base": whole, "new": whole, "tau_ratio",
        "tokens_per_s_ratio", "new_faster_than_lookup", "paired": {...} | None}}, "sets_only_in": {...}}``, with
        ``all`` last (and ``new_faster_than_mtp``: None when the new report has no MTP rows). ``whole`` holds
        ``prompts, tau, tokens_per_s, speedup, lookup_tau, lookup_tokens_per_s, mtp_k, mtp_tau, mtp_tokens_per_s,
        mtp_speedup``;
        ``paired`` holds ``matched, base_only, new_only`` prompt counts and, for ``tau`` and ``tokens_per_s``,
        ``base, new, ratio, ratio_low, ratio_high``. ``paired`` is None when a report predates the per-prompt sums.
        ``shared_gpu``: ``{name: processes a GPU}`` for a report decoded by processes sharing a GPU
        (``evaluate.workers_per_gpu``), whose tokens/s compare nothing.
    """
    shared = [s for s in base["sets"] if s in new["sets"]]
    out: dict = {
        "names": list(names),
        "base_drafter": {k: base["run"].get(k) for k in ("drafter", "drafter_architecture", "block_size")},
        "new_drafter": {k: new["run"].get(k) for k in ("drafter", "drafter_architecture", "block_size")},
        "sets": {},
        "sets_only_in": {names[0]: [s for s in base["sets"] if s not in new["sets"]],
                         names[1]: [s for s in new["sets"] if s not in base["sets"]]},
        # reports decoded by processes sharing a GPU (evaluate.workers_per_gpu): their tokens/s are no speed figures
        "shared_gpu": {name: int(r["run"].get("workers_per_gpu") or 1) for name, r in zip(names, (base, new))
                       if int(r["run"].get("workers_per_gpu") or 1) > 1},
    }
    groups = [(s, [s], base["sets"][s], new["sets"][s]) for s in shared]
    if shared and base.get("overall") and new.get("overall"):
        groups.append(("all", shared, base["overall"], new["overall"]))
    for label, members, b_section, n_section in groups:
        b, n = _whole(b_section), _whole(n_section)
        base_rows, new_rows = _prompts(base, members), _prompts(new, members)
        out["sets"][label] = {
            "base": b, "new": n,
            "tau_ratio": n["tau"] / b["tau"] if b["tau"] and n["tau"] is not None else None,
            "tokens_per_s_ratio": (n["tokens_per_s"] / b["tokens_per_s"]
                                   if b["tokens_per_s"] and n["tokens_per_s"] is not None else None),
            "new_faster_than_lookup": (n["tokens_per_s"] > n["lookup_tokens_per_s"]
                                       if None not in (n["tokens_per_s"], n["lookup_tokens_per_s"]) else None),
            "new_faster_than_mtp": (n["tokens_per_s"] > n["mtp_tokens_per_s"]
                                    if None not in (n["tokens_per_s"], n["mtp_tokens_per_s"]) else None),
            "paired": (None if base_rows is None or new_rows is None
                       else paired(base_rows, new_rows, resamples, seed)),
        }
    return out


def _f(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def render_markdown(comparison: dict) -> str:
    """The comparison as two Markdown tables: whole sets, then paired by prompt."""
    a, b = comparison["names"]
    lines = [f"# {b} against {a}", "",
             *(f"- {name}: `{d['drafter']}` ({d['drafter_architecture'] or 'architecture not recorded'}, block size "
               f"{d['block_size']})" for name, d in ((a, comparison["base_drafter"]), (b, comparison["new_drafter"]))),
             *(f"- **{name} was decoded by {k} processes sharing each GPU: its tok/s and speedups are no speed "
               "figures, and the tok/s ratios below compare nothing**"
               for name, k in comparison.get("shared_gpu", {}).items()),
             "",
             "Whole sets, as each report gives them (lookup: prompt lookup in the same report):", "",
             f"| set | τ {a} | τ {b} | τ {b}/{a} | tok/s {a} | tok/s {b} | tok/s {b}/{a} | speedup {a} | "
             f"speedup {b} | lookup τ ({b}'s run) | lookup tok/s | {b} faster than lookup | MTP τ, fastest k "
             f"({b}'s run) | MTP tok/s | {b} faster than MTP |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    yes = {True: "yes", False: "no", None: "-"}
    for name, s in comparison["sets"].items():
        x, y = s["base"], s["new"]
        mtp = "-" if y.get("mtp_k") is None else f"{_f(y['mtp_tau'])} (k={y['mtp_k']})"
        lines.append(f"| {name} | {_f(x['tau'])} | {_f(y['tau'])} | {_f(s['tau_ratio'], 3)}x | "
                     f"{_f(x['tokens_per_s'], 1)} | {_f(y['tokens_per_s'], 1)} | {_f(s['tokens_per_s_ratio'], 3)}x | "
                     f"{_f(x['speedup'])}x | {_f(y['speedup'])}x | {_f(y['lookup_tau'])} | "
                     f"{_f(y['lookup_tokens_per_s'], 1)} | {yes[s['new_faster_than_lookup']]} | {mtp} | "
                     f"{_f(y.get('mtp_tokens_per_s'), 1)} | {yes[s.get('new_faster_than_mtp')]} |")
    lines += ["", "Paired by prompt (`prompt_key`), with a 95% bootstrap interval of the ratio over prompts:", "",
              f"| set | prompts matched ({a} only, {b} only) | τ {a} | τ {b} | τ {b}/{a} [95%] | "
              f"tok/s {b}/{a} [95%] |", "|---|---|---|---|---|---|"]
    for name, s in comparison["sets"].items():
        p = s["paired"]
        if p is None:
            lines.append(f"| {name} | a report has no per-prompt sums (written before 2026-12-02): whole sets only "
                         "| | | | |")
            continue
        if not p["matched"]:
            lines.append(f"| {name} | 0 ({p['base_only']}, {p['new_only']}) | | | | |")
            continue
        t, r = p["tau"], p["tokens_per_s"]
        lines.append(f"| {name} | {p['matched']} ({p['base_only']}, {p['new_only']}) | {_f(t['base'])} | "
                     f"{_f(t['new'])} | {_f(t['ratio'], 3)}x [{_f(t['ratio_low'], 3)}, {_f(t['ratio_high'], 3)}] | "
                     f"{_f(r['ratio'], 3)}x [{_f(r['ratio_low'], 3)}, {_f(r['ratio_high'], 3)}] |")
    only = {k: v for k, v in comparison["sets_only_in"].items() if v}
    if only:
        lines += ["", "Sets in one report only: " + "; ".join(f"{k}: {', '.join(v)}" for k, v in only.items())]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Command line: print the comparison as Markdown; ``--json`` and ``--md`` also write it to files."""
    parser = argparse.ArgumentParser(prog="python -m draftsmith.evaluate.compare", description=__doc__.split("\n")[0])
    parser.add_argument("base", help="the first report.json (ratios are second / first)")
    parser.add_argument("new", help="the second report.json")
    parser.add_argument("--names", default="base,new", help="the two names, comma-separated (default base,new)")
    parser.add_argument("--resamples", type=int, default=2000, help="bootstrap resamples (default 2000; 0: none)")
    parser.add_argument("--seed", type=int, default=0, help="the bootstrap's seed (default 0)")
    parser.add_argument("--json", help="also write the comparison as JSON here")
    parser.add_argument("--md", help="also write the Markdown here")
    args = parser.parse_args(argv)
    names = tuple(n.strip() for n in args.names.split(","))
    if len(names) != 2 or not all(names):
        parser.error(f"--names {args.names!r}: give two names, e.g. dflash,dflash2")
    try:
        base, new = load_report(args.base), load_report(args.new)
    except (OSError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    comparison = compare_reports(base, new, names=names, resamples=args.resamples, seed=args.seed)
    text = render_markdown(comparison)
    print(text, end="")
    if args.json:
        write_json(args.json, comparison)
    if args.md:
        write_text(args.md, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
