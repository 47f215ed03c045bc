"""Does the route probe predict anything? Its damage ranking against the toy study's trained outcomes.

    python -m lab.route_probe_validate docs/results/route_probe/placement_step*/probe.json \
        --out docs/results/route_probe/validation

For each probe (one checkpoint step each): Spearman's rho between the damage of the study's placement routes
and their final FIDs, read from the study's runs (docs/results/runs, each run's metrics.jsonl, as lab.study_report
reads them for docs/results/study.md), with an exact permutation p-value (all n! orderings); beside it, the same
for the FLOP-bound speed-up alone, the baseline a probe must beat to say more than "longer routes cost more". Then
the ratio question: the damage of one placement at each ratio of the study's ratio sweep against that sweep's final
FIDs.
"""
import itertools
import json
import re
import sys
from pathlib import Path

import numpy as np
from scipy import stats

from lab.study_report import borrow_compare_runs, configurations, evaluations, final_values
from tools.report import load_runs
from tread_utils.cli import ArgumentParser
from tread_utils.errors import UserError, report_user_errors

REPO = Path(__file__).resolve().parents[1]
RUNS = REPO / "docs" / "results" / "runs"
STUDY_PARTS = ("placement", "ratio", "compare")  # compare lends the ratio sweep its ratio-0.5 runs, as in study.md
ROUTE = re.compile(r"^tread (\d+)->(\d+) @ ([\d.]+)$")


def route_key(label: str):
    m = ROUTE.match(label)
    return None if m is None else (int(m.group(1)), int(m.group(2)), float(m.group(3)))


def study_fids(runs_dir: Path) -> tuple:
    """({(start, end, ratio): final FID} of the placement sweep, the same of the ratio sweep (seed means)), from the
    study's runs (each run's metrics.jsonl), read and grouped as lab.study_report reads them for study.md."""
    parts = {}
    for part in STUDY_PARTS:
        if not (runs_dir / part).is_dir():
            raise UserError(f"--runs {runs_dir} has no {part}/ folder of the toy study's runs (scripts/toy_study.sh)")
        parts[part], _ = load_runs([str(runs_dir / part)])
        for run in parts[part]:
            run["evals"], run["untimed"] = evaluations(run), False
    parts = borrow_compare_runs(parts)
    placement, ratio = ({key: final_values(group, "fid")[0] for name, group in configurations(parts[part]).items()
                         if (key := route_key(name))} for part in ("placement", "ratio"))
    return placement, ratio


def spearman_exact(x, y) -> tuple:
    """(Spearman's rho, two-sided exact permutation p-value: the share of all orderings of y whose |rho| is at
    least the observed one)."""
    rx, ry = stats.rankdata(x), stats.rankdata(y)
    rho = float(np.corrcoef(rx, ry)[0, 1])
    perms = np.array(list(itertools.permutations(ry)))
    centred = perms - perms.mean(1, keepdims=True)
    rhos = (centred @ (rx - rx.mean())) / (np.linalg.norm(centred, axis=1) * np.linalg.norm(rx - rx.mean()))
    return rho, float(np.mean(np.abs(rhos) >= abs(rho) - 1e-12))


def validate(probes: list, runs_dir: Path) -> dict:
    placement, ratio = study_fids(runs_dir)
    where = runs_dir.resolve()
    out = {"study": str(where.relative_to(REPO) if where.is_relative_to(REPO) else where), "placement": [], "ratio": []}
    for path, probe in probes:
        rows = {(r["start"], r["end"], r["ratio"]): r for r in probe["routes"]}
        missing = sorted(set(placement) - set(rows))
        if missing:
            raise UserError(f"{path} has no probe of the study's route(s) {missing}: probe them with --routes")
        keys = sorted(placement)
        fid = [placement[k] for k in keys]
        rho, p = spearman_exact([rows[k]["damage"] for k in keys], fid)
        rho_speed, p_speed = spearman_exact([rows[k]["flop_speedup_bound"] for k in keys], fid)
        step = int(re.search(r"step (\d+)", probe["model"]).group(1))
        out["placement"].append({"probe": str(path), "step": step, "routes": len(keys), "rho": rho, "p": p,
                                 "rho_speedup": rho_speed, "p_speedup": p_speed,
                                 "damage_order": [f"{k[0]}->{k[1]}" for k in sorted(keys, key=lambda k: rows[k]["damage"])],
                                 "fid_order": [f"{k[0]}->{k[1]}" for k in sorted(keys, key=placement.get)]})
        swept = [k for k in sorted(ratio, key=lambda k: k[2]) if k in rows]
        if swept:
            out["ratio"].append({"probe": str(path), "step": step, "route": f"{swept[0][0]}->{swept[0][1]}",
                                 "ratios": [k[2] for k in swept], "damage": [rows[k]["damage"] for k in swept],
                                 "damage_ci": [rows[k]["damage_ci"] for k in swept],
                                 "fid": [ratio[k] for k in swept],
                                 "damage_rises": all(a["damage"] < b["damage"] for a, b in
                                                     zip(*[[rows[k] for k in swept][i:] for i in (0, 1)]))})
    out["placement"].sort(key=lambda r: r["step"])
    out["ratio"].sort(key=lambda r: r["step"])
    return out


def markdown(result: dict) -> str:
    lines = ["# Route probe against the toy study", "", f"Command: `{result['command']}`", "",
             f"Final FIDs from `{result['study']}`. Spearman's rho over the placement sweep's routes (all at "
             "ratio 0.5): probe damage against final FID, and, as the baseline, the FLOP-bound speed-up alone "
             "against final FID; p: exact two-sided permutation p-value.", "",
             "| checkpoint step | routes | rho (damage, FID) | p | rho (speed-up, FID) | p | damage order, least first | "
             "FID order, best first |", "|---|---|---|---|---|---|---|---|"]
    for r in result["placement"]:
        lines.append(f"| {r['step']} | {r['routes']} | {r['rho']:.3f} | {r['p']:.3f} | {r['rho_speedup']:.3f} | "
                     f"{r['p_speedup']:.3f} | {', '.join(r['damage_order'])} | {', '.join(r['fid_order'])} |")
    if result["ratio"]:
        lines += ["", "The ratio sweep: damage of one placement at each ratio against the sweep's final FID "
                  "(mean over its seeds).", "", "| checkpoint step | route | ratio | damage | 95% interval | final FID |",
                  "|---|---|---|---|---|---|"]
        for r in result["ratio"]:
            for ratio, d, ci, fid in zip(r["ratios"], r["damage"], r["damage_ci"], r["fid"]):
                lines.append(f"| {r['step']} | {r['route']} | {ratio:g} | {d:+.4f} | [{ci[0]:+.4f}, {ci[1]:+.4f}] | "
                             f"{fid:.2f} |")
    return "\n".join(lines) + "\n"


def build_parser() -> ArgumentParser:
    p = ArgumentParser(prog="python -m lab.route_probe_validate", description=__doc__.split("\n\n")[0])
    p.add_argument("probes", nargs="+", help="probe.json files written by python -m tools.route_probe")
    p.add_argument("--out", required=True, help="folder for validation.json and validation.md")
    p.add_argument("--runs", type=Path, default=RUNS,
                   help="the toy study's runs, a folder per part (default: the committed ones, docs/results/runs)")
    return p


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    probes = []
    for path in map(Path, args.probes):
        if not path.is_file():
            raise UserError(f"{path} does not exist; give the probe.json files of python -m tools.route_probe")
        probes.append((path, json.loads(path.read_text())))
    result = {"command": "python -m lab.route_probe_validate " + " ".join(argv),
              **validate(probes, args.runs)}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "validation.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / "validation.md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    report_user_errors(main)()
