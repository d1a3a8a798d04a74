"""The warm-start run's verdict (docs/warm-start/run.sh wait): base, adapted and from-scratch drafters per set.

    python docs/warm-start/verdict.py ADAPTED/report.json SCRATCH/report.json [--domain mmath]
        [--general heldout,mtbench] [--md verdict.md]

The adapted run's report holds the base's figures too (evaluate decoded every prompt with the start drafter: its
``start`` sections, paired by prompt). The from-scratch run's report is paired with the adapted one by prompt
(``draftsmith.evaluate.compare``). Printed: τ and tokens/s of the three per set, the ratios with their 95% bootstrap
intervals, and the goal of issue 44: on the domain set the adapted τ above the base's and above the from-scratch
one's; on the general sets every τ drop of more than 0.05 named with its size.
"""

from __future__ import annotations

import argparse
import sys

from draftsmith.evaluate.compare import compare_reports, load_report

DROP = 0.05  # a general set's τ drop worth naming


def _f(x, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _ratio(p: dict | None) -> str:
    if not p or p.get("ratio") is None:
        return "-"
    low, high = p.get("ratio_low"), p.get("ratio_high")
    return f"{p['ratio']:.3f}x" + ("" if low is None else f" [{low:.3f}, {high:.3f}]")


def verdict(adapted: dict, scratch: dict, domain: str, general: list[str]) -> tuple[str, bool]:
    """The verdict as Markdown, and whether the goal is met (domain τ above both; general drops are reported, not
    failed)."""
    comparison = compare_reports(scratch, adapted, names=("scratch", "adapted"))
    lines = ["| set | prompts | τ base | τ adapted | τ scratch | adapted / base [95%] | adapted / scratch [95%] | "
             "tok/s base | tok/s adapted | tok/s scratch |", "|---|---|---|---|---|---|---|---|---|---|"]
    met, notes = True, []
    for name in [*adapted["sets"], "all"]:
        section = adapted["overall"] if name == "all" else adapted["sets"][name]
        start = section.get("start") or {}
        before = start.get("before") or {}
        other = (scratch["overall"] if name == "all" else scratch["sets"].get(name)) or {}
        pair = (comparison["sets"].get(name) or {}).get("paired") or {}
        lines.append(f"| {name} | {section['prompts']} | {_f(before.get('tau'))} | {_f(section['dflash']['tau'])} | "
                     f"{_f((other.get('dflash') or {}).get('tau'))} | {_ratio((start.get('paired') or {}).get('tau'))} "
                     f"| {_ratio(pair.get('tau'))} | {_f(before.get('tokens_per_s'), 1)} | "
                     f"{_f(section['dflash']['tokens_per_s'], 1)} | "
                     f"{_f((other.get('dflash') or {}).get('tokens_per_s'), 1)} |")
        tau, base_tau = section["dflash"]["tau"], before.get("tau")
        scratch_tau = (other.get("dflash") or {}).get("tau")
        if name == domain:
            above_base = None not in (tau, base_tau) and tau > base_tau
            above_scratch = None not in (tau, scratch_tau) and tau > scratch_tau
            met = met and above_base and above_scratch
            notes.append(f"- **{domain}** (the domain): adapted τ {_f(tau)} against the base's {_f(base_tau)} "
                         f"({'above' if above_base else 'NOT above'}) and the from-scratch drafter's {_f(scratch_tau)} "
                         f"({'above' if above_scratch else 'NOT above'})")
        elif name in general and None not in (tau, base_tau):
            change = tau - base_tau
            notes.append(f"- {name} (general): τ {_f(base_tau)} -> {_f(tau)} ({change:+.2f})"
                         + (f": **a drop of {-change:.2f}**, more than {DROP}" if change < -DROP else ""))
    lossless = all(check["lossless"] for s in [*adapted["sets"].values(), *scratch["sets"].values()]
                   for check in (s.get("lossless") or {}).values())
    notes.append(f"- lossless (every method, both runs): {'yes' if lossless else 'NO'}")
    text = "\n".join(["# Warm start: base -> adapted, and from scratch", "",
                      f"- adapted: `{adapted['run']['drafter']}` from `{adapted['run'].get('start_drafter')}`",
                      f"- from scratch: `{scratch['run']['drafter']}`", "", *lines, "",
                      f"Goal (issue 44): {'**met**' if met else '**not met**'}", "", *notes, ""])
    return text, met


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("adapted", help="the adapted run's report.json (with its start sections)")
    parser.add_argument("scratch", help="the from-scratch run's report.json")
    parser.add_argument("--domain", default="mmath", help="the domain's set (default mmath)")
    parser.add_argument("--general", default="heldout,mtbench", help="the general sets (default heldout,mtbench)")
    parser.add_argument("--md", help="also write the verdict here")
    args = parser.parse_args(argv)
    adapted, scratch = load_report(args.adapted), load_report(args.scratch)
    if not any(s.get("start") for s in adapted["sets"].values()):
        print(f"{args.adapted}: no start sections: not a run with drafter.init_from", file=sys.stderr)
        return 2
    text, _ = verdict(adapted, scratch, args.domain, [s for s in args.general.split(",") if s])
    print(text, end="")
    if args.md:
        with open(args.md, "w", encoding="utf-8") as fh:
            fh.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
