"""Summarise training runs and sweeps: a table (report.md, report.csv) and FID plots (PNG + SVG).

    python -m tools.report results/placement results/compare --out results/report

Every directory below the given paths that holds a config.yaml or a status.json is a run (train.py
writes both). Runs that failed, are still running, stopped early or have unreadable files are listed
with their status, never dropped; plots skip runs without FID records and say so. A configuration is
a run's whole resolved config.yaml but its seed and the bookkeeping keys of NOT_CONFIGURATION: runs
are averaged only over seeds of one configuration, and each row names the settings that set it apart
(`settings`). Plots: fid_vs_step, fid_vs_time (training wall-clock) and route_placement (each
configuration's route a bar from its start to its end block, coloured by final FID, labelled with the
difference to the no-routing baseline, model dit, routing off or every ratio 0, same backbone and
dataset, and with the seed noise of that difference where the runs measure one).
"""
import argparse
import csv
import json
import math
import os
import re
import statistics
import sys
from collections import Counter
from pathlib import Path

from dit import DiT_models
from tools.configurations import NOT_CONFIGURATION, flat_config, group_by_configuration, seed_mean, settings_labels
from tools.report_plots import plot_curves, plot_routes, run_label
from tread_utils.errors import exit_with

SKIP_DIRS = {"checkpoints", "tensorboard", "wandb", "samples", "__pycache__"}
COLUMNS = [("run", "run"), ("status", "status"), ("backbone", "backbone"), ("model", "model"),
           ("routes", "routes"), ("ratio", "ratio"), ("settings", "settings"), ("seed", "seed"), ("steps", "steps"),
           ("final_fid", "final FID"), ("best_fid", "best FID"), ("best_fid_step", "best FID step"),
           ("final_class_acc", "final class_acc"), ("final_nn_ratio", "final nn_ratio"),
           ("steps_per_sec", "steps/s (median)"), ("compute_hours", "compute hours"),
           ("final_loss", "loss at end"), ("note", "note")]
RESTART_SLACK_S = 1800  # a gap between two records this much longer than their steps need is a restart


def num(value):
    """A finite float from a metrics value (train.py writes NaN/inf as strings), else None."""
    try:
        value = float(value)
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) else None


def find_runs(roots):
    runs, replaced = [], []
    for root in roots:
        for dirpath, dirnames, filenames in os.walk(root):
            replaced += [Path(dirpath) / n for n in dirnames if ".replaced-" in n]
            dirnames[:] = sorted(n for n in dirnames if n not in SKIP_DIRS and not n.startswith(".")
                                 and ".replaced-" not in n)
            if "config.yaml" in filenames or "status.json" in filenames:
                rel = Path(dirpath).relative_to(root)
                name = root.resolve().name if str(rel) == "." else str(rel)
                runs.append((f"{root.resolve().name}/{name}" if len(roots) > 1 and str(rel) != "." else name,
                             Path(dirpath)))
    natural = lambda item: [float(t) if i % 2 else t for i, t in enumerate(re.split(r"(\d+(?:\.\d+)?)", item[0]))]
    return sorted(runs, key=natural), replaced  # end=4 before end=11, ratio=0.25 before 0.5


def read_metrics(path):
    records, bad = [], 0
    for line in path.read_text(errors="replace").splitlines():
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            record["step"] = int(record["step"])
            records.append(record)
        except (ValueError, TypeError, KeyError):
            bad += 1
    return records, bad


def elapsed_seconds(records):
    """Training wall-clock at each record: differences of `time`, or steps / steps_per_sec where a
    record has no time or a gap holds a restart (resumed runs count only the time they ran)."""
    out, total, prev_step, prev_time = [], 0.0, 0, None
    for r in records:
        sps, t = num(r.get("steps_per_sec")), num(r.get("time"))
        steps = r["step"] - prev_step
        estimate = (steps / sps if sps and steps > 0 else 0.0) + (num(r.get("eval_seconds")) or 0.0)
        dt = t - prev_time if t is not None and prev_time is not None else estimate
        if dt < 0 or dt > 2 * estimate + RESTART_SLACK_S:
            dt = estimate
        total += dt
        out.append(total)
        prev_step, prev_time = max(prev_step, r["step"]), t if t is not None else prev_time
    return out


def model_depth(cfg_model):
    """The run's number of blocks: its model.params.depth, else the registry's (None: a backbone not in it)."""
    params = cfg_model.get("params") or {}
    if isinstance(params.get("depth"), int):
        return params["depth"]
    return DiT_models.get(str(cfg_model.get("backbone_type")), {}).get("depth")


def read_config(run, cfg):
    model = cfg.get("model") or {}
    params = model.get("params") or {}
    depth = model_depth(model)
    routes = []
    for r in params.get("routes") or []:
        s, e = int(r["start_layer_idx"]), int(r["end_layer_idx"])
        if depth:  # negative indices count from the last block
            s, e = s % depth if s < 0 else s, e % depth if e < 0 else e
        routes.append((s, e, float(r.get("selection_ratio", 0.0))))
    if not params.get("enable_routing", bool(routes)):
        routes = []
    run["config"] = {k: v for k, v in flat_config(cfg).items() if not NOT_CONFIGURATION.fullmatch(k)}
    run["fid_samples"] = ((cfg.get("train") or {}).get("eval") or {}).get("fid_num_samples")
    run["variant"] = variant(cfg, params if routes else {})
    run.update(backbone=model.get("backbone_type"), model=model.get("name"), depth=depth, route_list=routes,
               routes="; ".join(f"{s}->{e}" for s, e, _ in routes) or "off",
               ratio="; ".join(f"{r:g}" for _, _, r in routes) or "-", seed=cfg.get("global_seed"),
               dataset=(cfg.get("dataset") or {}).get("name"), max_steps=(cfg.get("train") or {}).get("max_steps"),
               baseline=not routes or all(r == 0 for _, _, r in routes))


def variant(cfg, params) -> str:
    """What else a run changes beyond its routes and ratios, in words: SPRINT fusion, ratio schedules, REPA, routing
    turned off late ('' for plain DiT / TREAD runs). It names runs; it does not group them (configuration_key)."""
    parts = []
    for r in params.get("routes") or []:
        if (r.get("fusion") or "none") != "none":
            parts.append(str(r["fusion"]))
        kind = (r.get("schedule") or {}).get("kind") or "constant"
        if kind != "constant":
            parts.append(f"{kind} schedule")
    repa = cfg.get("repa") or {}
    if repa.get("enabled"):
        parts.append(f"REPA block {repa.get('block')}")
    off = (cfg.get("train") or {}).get("routing_off_after")
    if params.get("routes") and off is not None:
        parts.append(f"routing off after {off}")
    return ", ".join(dict.fromkeys(parts))


def from_dir_name(run, name):
    """A multirun job's dir is named by its overrides (`k=v,k=v`): show what a run without config.yaml ran."""
    pairs = dict(re.findall(r"(?:^|,)[+~]*([\w./]+)=((?:[^,]|,(?![+~]*[\w./]+=))*)", name))
    routes = {}
    for key, value in pairs.items():
        m = re.fullmatch(r"model\.params\.routes\.(\d+)\.(start_layer_idx|end_layer_idx|selection_ratio)", key)
        if m:
            routes.setdefault(int(m.group(1)), {})[m.group(2)] = value
    routes = [r for _, r in sorted(routes.items())]
    run.update(model=pairs.get("model"), seed=pairs.get("global_seed"), backbone=pairs.get("model.backbone_type"),
               routes="; ".join(f"{r.get('start_layer_idx', '?')}->{r.get('end_layer_idx', '?')}" for r in routes),
               ratio="; ".join(r.get("selection_ratio", "?") for r in routes if "selection_ratio" in r))
    run["notes"].append("no config.yaml" + (" (settings from the run dir name)" if pairs else ""))


def mark_broken(run, why):
    run["notes"].append(why)
    run["status"] = "failed" if run["status"] == "failed" else "broken"


def read_run(name, path):
    import yaml

    run = dict(run=name, dir=path, status="unfinished", notes=[], fid=[], route_list=[], baseline=False, config=None,
               fid_samples=None)
    run.update({key: None for key, _ in COLUMNS[2:-1]})
    try:
        info = json.loads((path / "status.json").read_text())
        run["status"] = str(info.get("status", "unfinished"))
        run["notes"] += [str(info["error"])] if info.get("error") else []
    except FileNotFoundError:
        run["notes"].append("no status.json")
    except (OSError, ValueError, AttributeError):
        mark_broken(run, "status.json unreadable")
    try:
        read_config(run, yaml.safe_load((path / "config.yaml").read_text()) or {})
    except FileNotFoundError:  # train.py writes it once training starts; a job that failed before has none
        from_dir_name(run, path.name)
    except Exception as e:  # a damaged or foreign config must not stop the report
        mark_broken(run, f"config.yaml unreadable ({type(e).__name__})")
    try:
        records, bad = read_metrics(path / "metrics.jsonl")
        if bad and not records:
            raise ValueError("no readable record")
        run["notes"] += [f"{bad} unreadable metrics line(s) skipped"] if bad else []
        summarise(run, records)
    except FileNotFoundError:
        run["notes"] += ["no metrics.jsonl"] if run["status"] != "failed" else []
    except Exception as e:  # unreadable file or records of an unexpected shape
        mark_broken(run, f"metrics.jsonl unreadable ({type(e).__name__}: {e})")
    return run


def summarise(run, records):
    if not records:
        return
    elapsed = elapsed_seconds(records)
    losses = [num(r["loss"]) for r in records if "loss" in r]
    speeds = [v for v in (num(r.get("steps_per_sec")) for r in records) if v and v > 0]
    worlds = [int(r["world_size"]) for r in records if isinstance(r.get("world_size"), int)]
    run["fid"] = [(r["step"], t, num(r["fid"])) for r, t in zip(records, elapsed)
                  if "fid" in r and num(r["fid"]) is not None]
    run["steps"] = max(r["step"] for r in records)
    run["final_loss"] = losses[-1] if losses else None
    run["steps_per_sec"] = statistics.median(speeds) if speeds else None
    run["compute_hours"] = elapsed[-1] * (worlds[-1] if worlds else 1) / 3600
    if run["fid"]:
        run["final_fid"] = run["fid"][-1][2]
        run["best_fid_step"], _, run["best_fid"] = min(run["fid"], key=lambda p: p[2])
        final = [r for r in records if "fid" in r and num(r["fid"]) is not None][-1]  # the digits' metrics are logged
        run["final_class_acc"], run["final_nn_ratio"] = num(final.get("class_acc")), num(final.get("nn_ratio"))
    if run["status"] != "completed" and run["max_steps"] and run["steps"] < run["max_steps"]:
        run["notes"].append(f"{run['steps']} of {run['max_steps']} steps")


def cell(value):
    if value is None or value == "":
        return "-"
    if isinstance(value, float):
        return f"{value:.2f}" if abs(value) >= 10 else f"{value:.4g}"
    return str(value)


def baselines(runs):
    """seed_mean of the no-routing runs' final FID per (backbone, dataset): routing off (model dit) if there is
    such a run, else every ratio 0."""
    groups = {}
    for r in runs:
        if r["baseline"] and r["final_fid"] is not None:
            groups.setdefault((r["backbone"], r["dataset"]), []).append(r)
    picked = {key: [r for r in v if not r["route_list"]] or v for key, v in groups.items()}
    return {key: seed_mean(v, [r["final_fid"] for r in v]) for key, v in picked.items()}


def mean_std(values):
    values = [v for v in values if v is not None]
    if not values:
        return "-"
    return cell(statistics.mean(values)) + (f" ± {cell(statistics.stdev(values))}" if len(values) > 1 else "")


def by_configuration(runs):
    """One row per configuration with FID: its columns, `settings`, run count, the final metrics' mean ± std over
    its runs (its seeds), mean best FID and summed compute hours; a note where its runs' last FIDs are at
    different steps (an unfinished seed)."""
    rows = []
    for members in group_by_configuration([r for r in runs if r["final_fid"] is not None]):
        m, ends = members[0], sorted({r["fid"][-1][0] for r in members})
        rows.append([cell(m["backbone"]), cell(m["model"]), cell(m["routes"]), cell(m["ratio"]), m["settings"] or "-",
                     len(members), *(mean_std(r[k] for r in members) for k in ("final_fid", "final_class_acc",
                                                                                 "final_nn_ratio")),
                     cell(statistics.mean(r["best_fid"] for r in members)),
                     cell(sum(r["compute_hours"] or 0 for r in members)),
                     f"final FID at steps {', '.join(map(str, ends))}" if len(ends) > 1 else ""])
    return sorted(rows, key=lambda row: [str(c) for c in row[:5]])


def md_table(header, rows):
    esc = [[str(c).replace("|", "\\|") for c in row] for row in rows]
    return "\n".join(["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
                     + ["| " + " | ".join(row) + " |" for row in esc])


def write_report(runs, out, sources, replaced):
    out.mkdir(parents=True, exist_ok=True)
    configurations = group_by_configuration(runs)
    for members, settings in zip(configurations, settings_labels(configurations)):
        for r in members:
            r["settings"] = settings
    values = [[run["status"] if k == "status" else "; ".join(run["notes"]) if k == "note" else cell(run[k])
               for k, _ in COLUMNS] for run in runs]
    with open(out / "report.csv", "w", newline="") as f:
        csv.writer(f).writerows([[k for k, _ in COLUMNS], *values])
    counts = Counter(run["status"] for run in runs)
    lines = ["# Training report", "",
             f"Sources: {', '.join(f'`{s}`' for s in sources)}. {len(runs)} run(s): "
             + ", ".join(f"{n} {s}" for s, n in sorted(counts.items())) + ".", "",
             "FID: the run's in-training evaluation records (final = the last one; class_acc and nn_ratio from "
             "the same record, logged on the digits). Compute hours: training wall-clock x processes. Routes `i->j`: "
             "tokens skip blocks i..j; ratio: fraction skipped. Settings: the config keys that set a configuration "
             "apart (a value most configurations share is not named).", "",
             md_table([title for _, title in COLUMNS], values), ""]
    grouped = by_configuration(runs)
    if grouped:
        lines += ["## By configuration (runs with FID; mean ± std over seeds)", "",
                  "A configuration: the whole config.yaml but the seed and bookkeeping (output paths, names, "
                  "logging, checkpointing: NOT_CONFIGURATION in tools/configurations.py).", "",
                  md_table(["backbone", "model", "routes", "ratio", "settings", "runs", "final FID", "final class_acc",
                            "final nn_ratio", "best FID", "compute hours", "note"], grouped), ""]
    lines += ["## Plots", ""]
    problems, named = [], [(run_label(g[0]), g) for g in configurations]
    for stem, title, draw in [("fid_vs_step", "FID against step", lambda: plot_curves(runs, out, "fid_vs_step", 0)),
                              ("fid_vs_time", "FID against wall-clock", lambda: plot_curves(runs, out, "fid_vs_time", 1)),
                              ("route_placement", "Route placement", lambda: plot_routes(named, out, baselines(runs)))]:
        try:
            draw()
            lines += [f"![{title}]({stem}.png) ([svg]({stem}.svg))", ""]
        except Exception as e:  # a plot must never cost the table
            problems.append(f"plot {stem} failed: {type(e).__name__}: {e}")
    without = [r["run"] for r in runs if not r["fid"]]
    notes = problems + ([f"{len(without)} run(s) without FID records (FID columns '-', not in the plots): "
                         + ", ".join(f"`{n}`" for n in without)] if without else [])
    notes += [f"skipped {len(replaced)} run(s) moved aside by resume=false: "
              + ", ".join(f"`{p}`" for p in replaced)] if replaced else []
    if notes:
        lines += ["## Notes", ""] + [f"- {n}" for n in notes] + [""]
    (out / "report.md").write_text("\n".join(lines))
    return problems


def build_parser(description=__doc__.split("\n")[0], module="tools.report", paths_help="run directories or "
                 "folders of runs (searched recursively)", outputs="report.md, report.csv") -> argparse.ArgumentParser:
    """Shared by lab/study_report.py: folders of runs in, an output folder out, errors as one line."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("paths", nargs="+", help=paths_help)
    parser.add_argument("--out", default="report", help=f"output folder for {outputs} and plots")
    parser.error = lambda message: exit_with(f"{message} (usage: python -m {module} RUN_OR_SWEEP_DIR [...] --out DIR)")
    return parser


def load_runs(paths):
    """Every run under the given folders, read; a missing folder or no run at all is a one-line error."""
    roots = [Path(p) for p in paths]
    missing = [str(p) for p in roots if not p.is_dir()]
    if missing:
        exit_with(f"not a directory: {', '.join(missing)} (give run directories or folders holding them)")
    found, replaced = find_runs(roots)
    if not found:
        exit_with(f"no run directory (a folder with config.yaml or status.json) under {', '.join(map(str, paths))}")
    return [read_run(name, path) for name, path in found], replaced


def main(argv=None):
    args = build_parser().parse_args(argv)
    runs, replaced = load_runs(args.paths)
    try:
        problems = write_report(runs, Path(args.out), args.paths, replaced)
    except OSError as e:
        exit_with(f"cannot write the report to {args.out}: {e.strerror or e}")
    print(f"{len(runs)} run(s) -> {Path(args.out) / 'report.md'}, report.csv, "
          f"fid_vs_step / fid_vs_time / route_placement (.png, .svg)")
    for p in problems:
        print(f"warning: {p}", file=sys.stderr)


if __name__ == "__main__":
    main()
