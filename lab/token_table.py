"""One table by token count: `dit` against `tread` on the embedded digits at every token count whose runs are
archived, FID and class_acc at fixed steps and at equal training time, each with Welch's p (docs/results.md,
"By token count"):

    python -m lab.token_table 16=docs/results/runs 64=docs/results/tokens64/runs --out docs/results/tokens.md

Each TOKENS=FOLDER names a study archive (scripts/toy_study.sh's ARCHIVE, or lab/token_study.py's unpacked):
its `compare/` holds the `dit` and `tread` runs of every seed (a folder of runs directly works too), its
`cost/`, where present, the step cost of `dit` and `tread` measured one run at a time. Equal time is the time
`tread` needs for its last evaluated step at its steps/s; `dit` is read at the step its own steps/s reach in that
time, each run's metric interpolated linearly between its evaluations. The steps/s come from `cost/` where it
holds both configurations ("alone"), else from the compare runs themselves ("shared": runs that shared the
machine, a rougher clock).
"""
import argparse
import statistics
import sys
from pathlib import Path

import numpy as np
from scipy import stats

from lab.study_report import ALONE, TESTED, configurations, evaluations, pm_of
from tools.report import cell, load_runs, md_table
from tread_utils.cli import ArgumentParser
from tread_utils.errors import exit_with

STEPS = (1000, 2000, 3000)  # the fixed steps of the table, where a token count's runs have them


def welch(a, b):
    return float(stats.ttest_ind(b, a, equal_var=False).pvalue) if len(a) > 1 and len(b) > 1 else None


def at_step(run, step, metric):
    """The run's metric at `step`, linear between its evaluations; None outside them."""
    points = sorted((s, e[metric]) for s, e in run["evals"].items() if e[metric] is not None)
    if not points or not points[0][0] <= step <= points[-1][0]:
        return None
    return float(np.interp(step, *zip(*points)))


def name(group):
    """"dit" for the no-routing configuration, "tread" for the preset's route (2 -> 8 at 0.5), else None."""
    first = group[0]
    if first["baseline"] and not first["route_list"]:
        return "dit"
    return "tread" if (first["routes"], str(first["ratio"]), first.get("variant") or "") == ("2->8", "0.5", "") else None


def pair(folder: Path):
    """({"dit": [runs], "tread": [runs]}, {"dit": steps/s, "tread": steps/s}, clock) of one archive."""
    compare = folder / "compare" if (folder / "compare").is_dir() else folder
    runs, _ = load_runs([compare])
    for r in runs:
        r["evals"] = evaluations(r)
    groups = {name(g): g for g in configurations(runs).values() if name(g)}
    rates, clock = {}, "shared"
    if (folder / ALONE).is_dir():
        alone, _ = load_runs([folder / ALONE])
        found = {name(g): statistics.median(r["steps_per_sec"] for r in g)
                 for g in configurations(alone).values() if name(g)}
        if len(found) == 2:
            rates, clock = found, "alone"
    if not rates:
        rates = {k: statistics.median(r["steps_per_sec"] for r in g if r["steps_per_sec"]) for k, g in groups.items()}
    return groups, rates, clock


def row(tokens, where, groups, dit_step, tread_step):
    """[tokens, where, n, then per metric: dit, tread, difference, p] with dit read at dit_step, tread at tread_step."""
    cells = [tokens, where, f"{len(groups['dit'])} / {len(groups['tread'])}"]
    for metric in TESTED:
        a = [v for r in groups["dit"] if (v := at_step(r, dit_step, metric)) is not None]
        b = [v for r in groups["tread"] if (v := at_step(r, tread_step, metric)) is not None]
        p = welch(a, b)
        cells += [pm_of(a), pm_of(b),
                  cell(statistics.mean(b) - statistics.mean(a)) if a and b else "-", "-" if p is None else f"{p:.3g}"]
    return cells


def table(archives) -> list:
    rows, notes = [], []
    for tokens, folder in archives:
        groups, rates, clock = pair(folder)
        if set(groups) != {"dit", "tread"}:
            exit_with(f"{folder} holds no dit and tread (route 2 -> 8 at 0.5) runs to compare; give a study archive")
        common = set.intersection(*({s for s in r["evals"]} for g in groups.values() for r in g))
        rows += [row(tokens, f"step {s:,}", groups, s, s) for s in STEPS if s in common]
        last = min(max(r["evals"]) for r in groups["tread"])
        seconds = last / rates["tread"]
        dit_step = seconds * rates["dit"]
        rows.append(row(tokens, f"{seconds / 60:.1f} min ({clock}): dit step {dit_step:,.0f}, tread {last:,}",
                        groups, dit_step, last))
        notes.append(f"{tokens} tokens: `{folder}`, steps/s dit {rates['dit']:.3g}, tread {rates['tread']:.3g} "
                     f"({rates['tread'] / rates['dit']:.2f}x, {clock})")
    header = ["tokens", "at", "seeds (dit / tread)"] + [f"{m} {h}" for m in ("FID", "class_acc")
                                                         for h in ("dit", "tread", "difference", "Welch p")]
    return ["# dit against tread by token count", "",
            "Mean ± sample std over seeds; difference: tread - dit; Welch p: scipy.stats.ttest_ind(equal_var=False). "
            "Equal time: the time tread needs for its last evaluated step, dit read at the step it reaches in that "
            "time (linear between evaluations).", "", md_table(header, rows), "", *(f"- {n}" for n in notes), ""]


def parse_archive(text):
    tokens, sep, folder = text.partition("=")
    if not sep or not tokens.isdigit() or not Path(folder).is_dir():
        raise argparse.ArgumentTypeError(f"{text!r}: give TOKENS=FOLDER, an existing study archive, e.g. 64=docs/results/tokens64/runs")
    return int(tokens), Path(folder)


def build_parser():
    parser = ArgumentParser(prog="python -m lab.token_table", description=__doc__.split("\n\n")[0])
    parser.add_argument("archives", nargs="+", type=parse_archive, metavar="TOKENS=FOLDER")
    parser.add_argument("--out", default=None, help="write the table to this markdown file too")
    return parser


def main(argv=None):
    args = build_parser().parse_args(argv)
    text = "\n".join(table(sorted(args.archives)))
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    sys.exit(main())
