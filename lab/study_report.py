"""The toy study's report: mean ± std curves per configuration, a per-step Welch test of each routed
configuration against the no-routing one, the step cost measured in the same runs, the route placement
chart and the selection-ratio table. A part named `cost` (toy_study.sh's cost stage: one run at a time, no
evaluation) gives only a step-cost table, measured with the machine to itself, and a second equal-time table
where every step costs what it cost alone (runs that share the cores slow each other unevenly).

    python -m lab.study_report results/study/compare results/study/placement results/study/ratio --out docs/results

Each given folder is one part of the study (its runs are grouped and compared only with each other).
Runs are found and read by tools/report.py. A configuration is (model, routes, ratio); its seeds make
the band (sample std, ddof 1) and the t-test; one seed gives a line without band and no p-value.
Evaluations where a run of the pair has nn_ratio < 0.8 (samples closer to training digits than
held-out digits are) are marked "copying: comparison stopped", and so is every later evaluation.
Runs that are unfinished, failed or without records are listed, never dropped.
`--untimed PATTERN` (fnmatch on a run's folder name, or on PART/NAME to pick one part's, repeatable) compares the
matching runs per step only: they are left out of the wall-clock plots, the equal-time tables and the step cost,
for runs whose clock is not comparable with the others' (trained later on another machine, or two at a time
beside a cost part timed alone: `--untimed 'compare/*'`), and study.md names them.
Given compare, the ratio and platform parts borrow its configurations they lack (dit, as ratio 0 too, and tread)
up to their own last evaluation: a ratio-0 route is the dit computation and equal seeds and settings train equal
runs, so scripts/toy_study.sh trains only the other ratios and the successors.
"""
import csv
import fnmatch
import re
import shutil
import statistics
import sys
from pathlib import Path

import numpy as np
from scipy import stats

from tools import report
from tools.configurations import group_by_configuration, seed_mean, settings_labels
from tools.report import cell, elapsed_seconds, load_runs, md_table, num, read_metrics
from tools.report_plots import new_figure, plot_routes, save
from tread_utils.errors import exit_with

METRICS = [("fid", "FID"), ("class_acc", "class_acc"), ("nn_ratio", "nn_ratio")]
TESTED = ["fid", "class_acc"]
COPYING = 0.8  # nn_ratio below this: the samples copy training digits
CSV_HEADER = ["part", "baseline", "routed", "step", "metric", "baseline_n", "baseline_mean", "baseline_std",
              "routed_n", "routed_mean", "routed_std", "difference", "p_welch", "note"]


def evaluations(run):
    """{step: {"time": training seconds, metric: value}} from the run's evaluation records. The time leaves
    the evaluations out (each costs every configuration the same: it samples without routing)."""
    try:
        records, _ = read_metrics(run["dir"] / "metrics.jsonl")
    except OSError:
        return {}
    out, evaluating = {}, 0.0
    for r, t in zip(records, elapsed_seconds(records)):
        evaluating += num(r.get("eval_seconds")) or 0.0
        if "fid" in r:
            out[r["step"]] = {"time": t - evaluating, **{k: num(r.get(k)) for k, _ in METRICS}}
    return out


def label(run):
    return run["model"] + (f" {run['routes']} @ {run['ratio']}" if run["route_list"] else "") + \
        (f" ({run['variant']})" if run.get("variant") else "")


def configurations(runs):
    """{label: [runs]}, the no-routing configuration first, then by routes and ratio. A configuration is the whole
    config but the seed (tools/configurations.py); two with one label get the settings that tell them apart."""
    groups = group_by_configuration(sorted(runs, key=lambda r: (not r["baseline"], r["route_list"], str(r["seed"]))))
    names = [label(g[0]) for g in groups]
    return {name + (f" [{settings}]" if settings and names.count(name) > 1 else ""): g
            for name, settings, g in zip(names, settings_labels(groups, hidden=None), groups)}


def band(members, metric):
    """[(step, mean time, mean, std or None, n)] over the seeds that have that evaluation."""
    steps = sorted({s for r in members for s in r["evals"]})
    out = []
    for s in steps:
        points = [r["evals"][s] for r in members if s in r["evals"] and r["evals"][s][metric] is not None]
        if points:
            vals = np.array([p[metric] for p in points])
            out.append((s, float(np.mean([p["time"] for p in points])), float(vals.mean()),
                        float(vals.std(ddof=1)) if len(vals) > 1 else None, len(vals)))
    return out


def plot_part(part, groups, out, x_index, colours):
    """FID, class_acc and nn_ratio against step (x_index 0) or wall-clock (1): one line + band per configuration,
    coloured by `colours` ({name: colour}, the same for a part's two plots)."""
    plt, fig, _ = new_figure(15, 4.2)
    fig.clf()
    axes = fig.subplots(1, len(METRICS))
    longest = max((e["time"] for g in groups.values() for r in g for e in r["evals"].values()), default=0)
    scale, unit = (1.0, "") if x_index == 0 else (3600.0, "hours") if longest > 7200 else (60.0, "minutes")
    for ax, (metric, title) in zip(axes, METRICS):
        for name, members in groups.items():
            points = band(members, metric)
            if not points:
                continue
            x = np.array([p[x_index] for p in points]) / scale
            mean = np.array([p[2] for p in points])
            line, = ax.plot(x, mean, marker="o", ms=3, color=colours[name], label=f"{name} ({len(members)} seed(s))")
            std = np.array([np.nan if p[3] is None else p[3] for p in points])
            if np.isfinite(std).any():
                ax.fill_between(x, mean - std, mean + std, color=line.get_color(), alpha=0.2, linewidth=0)
        if metric == "fid":  # log: the late differences of a few FID are the ones that matter
            ax.set_yscale("log")
        if metric == "nn_ratio":
            ax.axhline(COPYING, color="0.3", linestyle=":", linewidth=1, label=f"copying below {COPYING}")
        ax.set(xlabel="training step" if x_index == 0 else f"training wall-clock, evaluations left out ({unit})",
               ylabel=title)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle(f"{part}: mean ± std over seeds", fontsize=10)
    stem = f"study_{part}_vs_{'step' if x_index == 0 else 'time'}"
    save(plt, fig, out, stem)
    return stem


def welch_rows(part, base_name, base, name, routed):
    """Per evaluation step both configurations have: means, stds, routed - baseline and Welch's p."""
    rows, stopped = [], None
    steps = sorted({s for r in base for s in r["evals"]} & {s for r in routed for s in r["evals"]})
    for s in steps:
        pair = [r["evals"][s] for r in base + routed if s in r["evals"]]
        ratios = [e["nn_ratio"] for e in pair]
        if stopped is None and any(v is not None and v < COPYING for v in ratios):
            stopped = s
        note = ("copying: comparison stopped" + (f" (at step {stopped})" if stopped != s else "")
                if stopped is not None else "nn_ratio not logged" if None in ratios else "")
        for metric in TESTED:
            a = [r["evals"][s][metric] for r in base if s in r["evals"] and r["evals"][s][metric] is not None]
            b = [r["evals"][s][metric] for r in routed if s in r["evals"] and r["evals"][s][metric] is not None]
            p = (float(stats.ttest_ind(b, a, equal_var=False).pvalue)
                 if stopped is None and len(a) > 1 and len(b) > 1 else None)
            mean_a, mean_b = (statistics.mean(v) if v else None for v in (a, b))
            std_a, std_b = (statistics.stdev(v) if len(v) > 1 else None for v in (a, b))
            diff = mean_b - mean_a if a and b else None
            rows.append([part, base_name, name, s, metric, len(a), mean_a, std_a, len(b), mean_b, std_b, diff, p, note])
    return rows


def pm(mean, std):
    return "-" if mean is None else cell(mean) + (f" ± {cell(std)}" if std is not None else "")


def pm_of(values):
    """mean ± sample std of `values` as a cell ('-' for none, no ± for one)."""
    return pm(statistics.mean(values), statistics.stdev(values) if len(values) > 1 else None) if values else "-"


def welch_section(rows):
    lines = []
    for key in dict.fromkeys((r[0], r[1], r[2]) for r in rows):
        part, base_name, name = key
        by_step = {}
        for r in (r for r in rows if tuple(r[:3]) == key):
            by_step.setdefault(r[3], {})[r[4]] = r
        table = []
        for step, m in by_step.items():
            cells = [step]
            for metric in TESTED:
                r = m[metric]
                cells += [pm(r[6], r[7]), pm(r[9], r[10]), cell(r[11]), "-" if r[12] is None else f"{r[12]:.3g}"]
            table.append(cells + [m[TESTED[0]][13] or ""])
        header = ["step"] + [f"{t} {h}" for t in ("FID", "class_acc")
                             for h in (f"{base_name} (n={m[TESTED[0]][5]})", f"{name} (n={m[TESTED[0]][8]})",
                                       "difference", "Welch p")] + ["note"]
        lines += [f"### {part}: {name} against {base_name}", "", md_table(header, table), ""]
    return lines


def step_cost(part, groups):
    """Median steps/s per configuration and its ratio to the no-routing configuration's."""
    medians = {n: statistics.median(v) for n, g in groups.items()
               if (v := [r["steps_per_sec"] for r in g if r["steps_per_sec"]])}
    base = next((n for n, g in groups.items() if g[0]["baseline"] and n in medians), None)
    return [[part, n, len(groups[n]), cell(v), f"{v / medians[base]:.2f}x" if base else "-"] for n, v in medians.items()]


def equal_time_rows(part, groups):
    """Each configuration at the training time the fastest one needed for all its steps (its runs' mean): FID and
    class_acc interpolated in time between each run's evaluations, then mean ± std over seeds."""
    ends = [statistics.mean(r["evals"][max(r["evals"])]["time"] for r in g if r["evals"])
            for g in groups.values() if any(r["evals"] for r in g)]
    if len(ends) < 2:
        return []
    at = min(ends)
    rows = []
    for name, members in groups.items():
        cells = [part, name, sum(1 for r in members if r["evals"] and r["evals"][max(r["evals"])]["time"] >= at),
                 f"{at / 60:.1f}"]
        for metric in ("step", *TESTED):
            vals = []
            for r in members:
                points = sorted((e["time"], s if metric == "step" else e[metric]) for s, e in r["evals"].items()
                                if metric == "step" or e[metric] is not None)
                if points and points[0][0] <= at <= points[-1][0]:
                    vals.append(float(np.interp(at, *zip(*points))))
            cells.append(pm_of(vals))
        rows.append(cells)
    return rows


def sample_grids(part, groups, out):
    """Each configuration's sample grid at its last evaluation (train.py's own, lowest seed), copied next to the
    report so that the page shows what the numbers score."""
    lines = []
    for name, members in groups.items():
        run = next((r for r in members if r["evals"]), None)
        grid = run and run["dir"] / "samples" / f"step_{max(run['evals']):08d}.png"
        if grid and grid.is_file():
            stem = f"study_{part}_{re.sub(r'[^A-Za-z0-9.]+', '_', name).strip('_')}_samples"
            shutil.copyfile(grid, out / f"{stem}.png")
            lines += [f"{name}, seed {run['seed']}, step {max(run['evals'])}:", "", f"![{name} samples]({stem}.png)", ""]
    return lines


def equal_cost_rows(part, groups, rates):
    """Each configuration at equal training time with every step costing what the cost part measured alone
    (`rates`: {label: steps/s}): the time the fastest configuration needs for its last evaluated step, the step
    each run reaches in it, FID and class_acc interpolated there (mean ± std over seeds)."""
    last = {n: min(max(r["evals"]) for r in g if r["evals"]) for n, g in groups.items() if any(r["evals"] for r in g)}
    timed = {n: s / rates[n] for n, s in last.items() if n in rates}
    if len(timed) < 2:
        return []
    at = min(timed.values())
    rows = []
    for name, members in groups.items():
        if name not in timed:
            rows.append([part, name, "-", f"{at / 60:.1f}", "-", "-", "-"])
            continue
        step = at * rates[name]
        cells = []
        for metric in TESTED:
            vals = [float(np.interp(step, *zip(*sorted((s, e[metric]) for s, e in r["evals"].items()
                                                          if e[metric] is not None))))
                    for r in members if r["evals"] and min(r["evals"]) <= step <= max(r["evals"])]
            cells.append(pm_of(vals))
        rows.append([part, name, f"{rates[name]:.3g}", f"{at / 60:.1f}", f"{step:.0f}", *cells])
    return rows


def final_values(members, metric):
    vals = [r["evals"][max(r["evals"])][metric] for r in members if r["evals"]]
    vals = [v for v in vals if v is not None]
    return (statistics.mean(vals) if vals else None, statistics.stdev(vals) if len(vals) > 1 else None)


def placement_baseline(placement_runs, runs):
    """seed_mean of the no-routing runs' FID at the step the placement runs ended (their budgets differ from
    compare's), per (backbone, dataset)."""
    ends = {max(r["evals"]) for r in placement_runs if r["evals"]}
    out = {}
    for r in runs:
        if r["baseline"] and not r["route_list"] and ends and max(ends) in r["evals"]:
            out.setdefault((r["backbone"], r["dataset"]), []).append(r)
    fids = {k: [r["evals"][max(ends)]["fid"] for r in v] for k, v in out.items()}
    return {k: seed_mean(v, fids[k]) for k, v in out.items() if None not in fids[k]}


def placement_table(part, groups, baseline):
    """Each route's final evaluation, best FID first, under a line giving the no-routing baseline at that step."""
    rows = sorted(([n, len(g), *(pm(*final_values(g, m)) for m, _ in METRICS),
                    cell(max((max(r["evals"]) for r in g if r["evals"]), default=None)), final_values(g, "fid")[0]]
                   for n, g in groups.items() if g[0]["route_list"]), key=lambda row: (row[-1] is None, row[-1] or 0))
    base = "; ".join(f"{backbone} on {dataset}: FID {cell(fid)} ({n} run(s))"
                     for (backbone, dataset), (fid, n, _) in baseline.items()) or "no no-routing run at that step"
    return [f"### {part}: each route at its final evaluation, best FID first", "", f"Baseline, no routing: {base}.", "",
            md_table(["route", "runs", *(f"final {name}" for _, name in METRICS), "step"], [r[:-1] for r in rows]), ""]


ALONE = "cost"  # the part whose runs only time steps, one run at a time (scripts/toy_study.sh's cost stage)
BORROWING = ("ratio", "platform")  # parts that compare their runs with compare's dit and tread


def borrow_compare_runs(parts):
    """Each borrowing part plus compare's runs of configurations it has none of (no routes, or the part's routes
    at another ratio or without its variant), each cut at the part's last evaluation step."""
    compare = parts.get("compare")
    out = dict(parts)
    for name in BORROWING:
        own_runs = parts.get(name)
        if not own_runs or not compare:
            continue
        own, routes = {label(r) for r in own_runs}, {r["routes"] for r in own_runs}
        end = max((s for r in own_runs for s in r["evals"]), default=0)
        out[name] = own_runs + [dict(r, evals={s: e for s, e in r["evals"].items() if s <= end},
                                     run=f"{r['run']} (to step {end})")
                                for r in compare if label(r) not in own and (not r["route_list"] or r["routes"] in routes)]
    return out


def timed(members):
    """The runs whose clock the wall-clock plots, equal-time tables and step cost may use (not --untimed)."""
    return [r for r in members if not r["untimed"]]


def write_study(parts, runs, out, sources, replaced=()):
    out.mkdir(parents=True, exist_ok=True)
    lines = ["# Toy study report", "", f"Sources: {', '.join(f'`{s}`' for s in sources)}; {len(runs)} run(s).", "",
             "Bands: mean ± sample std over seeds. Difference: routed - baseline. Welch p: "
             "scipy.stats.ttest_ind(equal_var=False); '-' with fewer than 2 seeds on a side or after copying "
             f"(any run of the pair with nn_ratio < {COPYING}).", ""]
    untimed = sorted(r["run"] for r in runs if r["untimed"])
    lines += [f"Compared per step only (--untimed; not in the wall-clock plots, equal-time tables or step cost): "
              f"{', '.join(untimed)}.", ""] if untimed else []
    csv_rows, cost, cost_alone, ratio_table, same_time, same_cost = [], [], [], [], [], []
    rates = {n: statistics.median(v) for n, g in configurations(timed(parts.get(ALONE, []))).items()
             if (v := [r["steps_per_sec"] for r in g if r["steps_per_sec"]])}
    for part, members in parts.items():
        groups, clocked = configurations(members), configurations(timed(members))
        colours = {name: f"C{i % 10}" for i, name in enumerate(groups)}
        if part == ALONE:  # timing runs, no evaluations
            cost_alone += step_cost(part, clocked)
            continue
        lines += [f"## {part}", ""]
        for x_index in (0, 1) if clocked else (0,):  # every run --untimed: no wall-clock plot
            stem = plot_part(part, groups if x_index == 0 else clocked, out, x_index, colours)
            lines += [f"![{part} against {'step' if x_index == 0 else 'wall-clock'}]({stem}.png)", ""]
        base = next(((n, g) for n, g in groups.items() if g[0]["baseline"] and not g[0]["route_list"]), None) or \
            next(((n, g) for n, g in groups.items() if g[0]["baseline"]), None) or \
            (next(iter(groups.items())) if len(groups) == 2 else None)  # two routed settings (precision): one against the other
        rows = [row for n, g in groups.items() if base and n != base[0]
                for row in welch_rows(part, base[0], base[1], n, g)]
        csv_rows += rows
        lines += welch_section(rows)
        grids = sample_grids(part, groups, out) if part != "placement" else []
        lines += [f"### {part}: samples", "", *grids] if grids else []
        cost += step_cost(part, clocked)
        same_time += equal_time_rows(part, clocked)
        same_cost += equal_cost_rows(part, groups, rates)  # steps and the cost part's clock: no run's own
        if part == "placement" or (len(groups) > 1 and all(len(g) == 1 for g in groups.values())):
            baseline = placement_baseline(members, runs)
            plot_routes(list(groups.items()), out, baseline, stem=f"study_{part}_routes")
            lines += [f"![route placement](study_{part}_routes.png) (baseline: no-routing runs at the same step)", ""]
            lines += placement_table(part, groups, baseline)
        if len({r["ratio"] for r in members if r["route_list"]}) > 1:
            ratio_table += [[part, n, len(g), pm(*final_values(g, "fid")), pm(*final_values(g, "class_acc")),
                             cell(max((max(r["evals"]) for r in g if r["evals"]), default=None))] for n, g in groups.items()]
    if ratio_table:
        lines += ["## Selection ratio (final evaluation, mean ± std over seeds)", "",
                  md_table(["part", "configuration", "runs", "final FID", "final class_acc", "step"], ratio_table), ""]
    if same_time:
        lines += ["## At equal training time (the fastest configuration's end; evaluations left out)", "",
                  "Each run's FID and class_acc interpolated linearly in training time between its evaluations; "
                  "step: the step it had reached. '-': the configuration's runs had not reached that time.", "",
                  md_table(["part", "configuration", "runs there", "minutes", "step", "FID", "class_acc"], same_time), ""]
    lines += ["## Step cost measured in these runs (median of the runs' median steps/s)", "",
              md_table(["part", "configuration", "runs", "steps/s", "over no-routing"], cost), ""] if cost else []
    if cost_alone:
        lines += ["## Step cost with the machine to itself (one run at a time, no evaluation; median steps/s)", "",
                  md_table(["part", "configuration", "runs", "steps/s", "over no-routing"], cost_alone), ""]
    if same_cost:
        lines += ["## At equal training time, each step costing what it cost alone", "",
                  "The time the fastest configuration needs for its last evaluated step at the steps/s measured alone "
                  "(cost part); the step each configuration reaches in that time at its own steps/s; FID and class_acc "
                  "interpolated linearly in step between evaluations. '-': no cost run of that configuration.", "",
                  md_table(["part", "configuration", "steps/s alone", "minutes", "step", "FID", "class_acc"],
                           same_cost), ""]
    odd = [r for r in runs if r["status"] != "completed" or r["notes"] or not (r["evals"] or r.get("part") == ALONE)]
    lines += ["## Runs not complete or with problems", ""] + ([
        md_table(["run", "status", "steps", "evaluations", "note"],
                 [[r["run"], r["status"], cell(r["steps"]), len(r["evals"]), "; ".join(r["notes"])] for r in odd])]
        if odd else ["none: every run completed with evaluation records"]) + [""]
    lines += [f"Skipped {len(replaced)} run(s) moved aside by resume=false: " + ", ".join(map(str, replaced)), ""] \
        if replaced else []
    with open(out / "study.csv", "w", newline="") as f:
        csv.writer(f).writerows([CSV_HEADER, *csv_rows])
    (out / "study.md").write_text("\n".join(lines))


def build_parser():
    parser = report.build_parser(__doc__.split("\n")[0], "lab.study_report", "one folder of runs per part of the "
                                 "study (compare, placement, ratio)", "study.md, study.csv")
    parser.add_argument("--untimed", action="append", default=[], metavar="PATTERN",
                        help="runs whose folder name, or PART/NAME, matches (fnmatch) are compared per step only, their "
                             "clock unused")
    return parser


def main(argv=None):
    args = build_parser().parse_args(argv)
    runs, replaced = load_runs(args.paths)
    roots = [Path(p).resolve() for p in args.paths]
    parts, unmatched = {}, []
    for r in runs:
        r["evals"] = evaluations(r)
        root = next(p for p in roots if r["dir"].resolve().is_relative_to(p))
        r["part"] = root.name
        r["untimed"] = False
        parts.setdefault(root.name, []).append(r)
    for pattern in args.untimed:
        for r in (matched := [r for r in runs if fnmatch.fnmatchcase(r["dir"].name, pattern)
                              or fnmatch.fnmatchcase(f"{r['part']}/{r['dir'].name}", pattern)]):
            r["untimed"] = True
        if not matched:
            unmatched.append(pattern)
    if unmatched:
        exit_with(f"--untimed {' '.join(unmatched)} matches no run folder name (e.g. --untimed "
                  f"'*routing_off_after=2400'; the names are Hydra's override_dirname)")
    try:
        write_study(borrow_compare_runs(parts), runs, Path(args.out), args.paths, replaced)
    except OSError as e:
        exit_with(f"cannot write the report to {args.out}: {e.strerror or e}")
    print(f"{len(runs)} run(s) in {len(parts)} part(s) -> {Path(args.out) / 'study.md'}, study.csv, plots")


if __name__ == "__main__":
    sys.exit(main())
