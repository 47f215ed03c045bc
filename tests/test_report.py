"""report.py on a real 2x2 multirun (one job invalid), on copies with synthetic FID records, on runs whose
configs differ in one key (one row per configuration, seeds averaged), the placement chart's noise, and bad input."""
import csv
import datetime
import json
import math
import re
import shutil
import statistics

import pytest
import yaml

from conftest import REPO, assert_one_line_error, run_script, tiny_overrides
from dit import DiT_models
from tools.configurations import group_by_configuration, settings_labels
from tools.report import baselines, model_depth
from tools.report_plots import NEUTRAL, SEEDED, fid_noise, value_text

GRID = ["model.params.routes.0.start_layer_idx=1,3", "model.params.routes.0.end_layer_idx=2,3"]
PLOTS = ("fid_vs_step", "fid_vs_time", "route_placement")


def grid_args(results, *sweep):
    base = [o for o in tiny_overrides("tread") if "routes.0" not in o]
    return ["-m", f"results_dir={results}", "run_name=grid", *base, *sweep, "train.max_steps=3",
            "train.logging.log_interval=1"]


def job_dir(results, start, end):
    """The job's run dir: <run_name>/<its overrides, sorted> (Hydra's override_dirname)."""
    found = [d for d in (results / "grid").iterdir()
             if f"start_layer_idx={start}," in d.name + "," and f"end_layer_idx={end}," in d.name + ","]
    assert len(found) == 1, found
    return found[0]


@pytest.fixture(scope="module")
def grid(tmp_path_factory):
    results = tmp_path_factory.mktemp("sweep")
    proc = run_script("train.py", *grid_args(results, *GRID), check=True)
    return results, proc


def read_csv(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def status(run_dir):
    return json.loads((run_dir / "status.json").read_text())["status"]


def test_grid_sweep_gives_one_run_dir_per_job_and_keeps_going_after_a_failure(grid):
    results, proc = grid
    expected = {(1, 2): "completed", (1, 3): "completed", (3, 3): "completed", (3, 2): "failed"}
    for (start, end), want in expected.items():
        assert status(job_dir(results, start, end)) == want, (start, end)
    assert "start block 3 comes after end block 2" in json.loads(
        (job_dir(results, 3, 2) / "status.json").read_text())["error"]
    assert (job_dir(results, 1, 2) / "config.yaml").exists()


def test_rerunning_a_sweep_skips_completed_jobs(grid):
    results, _ = grid
    done = job_dir(results, 1, 2)
    before = (done / "metrics.jsonl").read_text()
    proc = run_script("train.py", *grid_args(results, "model.params.routes.0.start_layer_idx=1",
                                             "model.params.routes.0.end_layer_idx=2"), check=True)
    assert "already complete at step 3" in proc.stdout, proc.stdout[-2000:]
    assert status(done) == "completed" and (done / "metrics.jsonl").read_text() == before


def test_report_lists_every_run_and_draws_the_plots(grid, tmp_path):
    results, _ = grid
    out = tmp_path / "report"
    proc = run_script("tools.report", results / "grid", "--out", out, check=True)
    rows = {(r["routes"], r["status"]) for r in read_csv(out / "report.csv")}
    assert rows == {("1->2", "completed"), ("1->3", "completed"), ("3->3", "completed"), ("3->2", "failed")}, rows
    for row in read_csv(out / "report.csv"):
        assert row["final_fid"] == row["best_fid"] == "-"
        if row["status"] == "completed":
            assert row["steps"] == "3" and row["backbone"] == "DiT-D/4" and float(row["final_loss"]) > 0
            assert float(row["steps_per_sec"]) > 0 and float(row["compute_hours"]) > 0
    md = (out / "report.md").read_text()
    assert md.count("| completed |") == 3 and md.count("| failed |") == 1 and "4 run(s)" in proc.stdout
    for stem in PLOTS:
        assert (out / f"{stem}.png").stat().st_size > 1000 and (out / f"{stem}.svg").exists()
        assert f"{stem}.png" in md
    assert "no run has FID records yet" in (out / "fid_vs_step.svg").read_text()


def add_fid(run_dir, fids, every=100, sps=10.0, eval_s=5.0, **digits_metrics):
    """Synthetic records: `every` steps at `sps` steps/s, then an evaluation taking `eval_s` seconds (with the
    values of `digits_metrics`, {name: one per evaluation}, as train.py logs class_acc and nn_ratio)."""
    lines, t = [], 1000.0
    for i, fid in enumerate(fids, 1):
        t += every / sps
        lines.append({"step": i * every, "time": t, "loss": 1.0 / i, "steps_per_sec": sps, "world_size": 2})
        t += eval_s
        lines.append({"step": i * every, "time": t, "fid": fid, "eval_seconds": eval_s,
                      **{name: values[i - 1] for name, values in digits_metrics.items()}})
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))


def set_keys(cfg, changes):
    """Dotted keys (`model.params.routes.0.selection`) set in a config; a list's index is a number."""
    for key, value in changes.items():
        node = cfg
        *path, last = key.split(".")
        for part in path:
            node = node[int(part)] if isinstance(node, list) else node[part]
        node[last] = value
    return cfg


def clone(src, dst, **config_changes):
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("checkpoints"))
    cfg = set_keys(yaml.safe_load((dst / "config.yaml").read_text()), config_changes)
    (dst / "config.yaml").write_text(yaml.safe_dump(cfg))
    return dst


def test_report_with_fid_records_baseline_and_broken_runs(grid, tmp_path):
    results, _ = grid
    root = tmp_path / "runs"
    a = clone(job_dir(results, 1, 2), root / "tread-a")
    b = clone(job_dir(results, 1, 3), root / "tread-b", global_seed=1)
    base = clone(job_dir(results, 1, 2), root / "dit", **{"model.name": "dit", "model.params.routes": [],
                                                         "model.params.enable_routing": False})
    add_fid(a, [30.0, 20.0, 22.0])
    add_fid(b, [28.0, 25.0])
    add_fid(base, [40.0, 35.0, 32.0])
    broken = clone(job_dir(results, 3, 3), root / "broken")
    (broken / "metrics.jsonl").write_text("{not json\n\x00\x01\n")
    running = clone(job_dir(results, 3, 3), root / "running")
    (running / "status.json").write_text(json.dumps({"status": "running", "time": 0}))
    shutil.copytree(job_dir(results, 3, 2), root / "failed")
    (root / "nothing-yet").mkdir()
    (root / "nothing-yet" / "config.yaml").write_text((a / "config.yaml").read_text())
    (root / "old.replaced-20250101-000000").mkdir()
    (root / "old.replaced-20250101-000000" / "status.json").write_text("{}")

    from tools import report

    out = tmp_path / "out"
    report.main([str(root), "--out", str(out)])
    rows = {r["run"]: r for r in read_csv(out / "report.csv")}
    assert set(rows) == {"tread-a", "tread-b", "dit", "broken", "running", "failed", "nothing-yet"}
    assert (rows["tread-a"]["final_fid"], rows["tread-a"]["best_fid"], rows["tread-a"]["best_fid_step"]) == \
        ("22.00", "20.00", "200")
    assert rows["dit"]["routes"] == "off" and rows["dit"]["model"] == "dit"
    assert rows["broken"]["status"] == "broken" and "unreadable" in rows["broken"]["note"]
    assert rows["running"]["status"] == "running" and rows["failed"]["status"] == "failed"
    assert rows["nothing-yet"]["status"] == "unfinished" and rows["nothing-yet"]["final_fid"] == "-"
    # 3 x (100 steps at 10 steps/s + a 5 s evaluation) = 45 s on 2 processes
    assert float(rows["tread-a"]["compute_hours"]) == pytest.approx(45 * 2 / 3600, rel=1e-2)
    md = (out / "report.md").read_text()
    assert "moved aside by resume=false" in md and "By configuration" in md
    svg = (out / "route_placement.svg").read_text()
    assert "22.00 (-10.00)" in svg and "25.00 (-7.00)" in svg  # against the dit run's final FID 32
    assert "no routing, DiT-D/4 (1 run)" in svg and ">32.00<" in svg  # the baseline has a row of its own
    report.main([str(root), "--out", str(tmp_path / "again")])
    assert (tmp_path / "again" / "route_placement.svg").read_text() == svg  # SVGs are reproducible: clean diffs
    for stem in PLOTS:
        assert (out / f"{stem}.png").exists() and (out / f"{stem}.svg").exists()
    assert "without FID records not shown" in (out / "fid_vs_step.svg").read_text()


def test_elapsed_time_from_timestamps_or_speeds():
    from tools import report

    with_time = [{"step": 10, "time": 105.0, "steps_per_sec": 2.0}, {"step": 20, "time": 110.0, "steps_per_sec": 2.0},
                 {"step": 30, "time": 99999.0, "steps_per_sec": 2.0}]  # a restart before the third record
    assert report.elapsed_seconds(with_time) == [5.0, 10.0, 15.0]
    assert report.elapsed_seconds([{"step": 10, "steps_per_sec": 5.0}, {"step": 30, "steps_per_sec": 4.0},
                                   {"step": 30, "fid": 3.0, "eval_seconds": 1.5}]) == [2.0, 7.0, 8.5]


def test_bad_input_is_one_line(tmp_path):
    assert_one_line_error(run_script("tools.report", tmp_path / "missing", "--out", tmp_path / "o"), "not a directory")
    (tmp_path / "empty" / "sub").mkdir(parents=True)
    proc = run_script("tools.report", tmp_path / "empty", "--out", tmp_path / "o")
    assert proc.returncode == 2
    assert_one_line_error(proc, "no run directory")
    assert_one_line_error(run_script("tools.report"), "usage")


def test_model_depth_knows_every_registry_backbone():
    """Negative route indices resolve against the depth read from the backbone name: a registry family the
    report does not know (DiT-D/* once) would leave the placement chart without its routes."""
    for name, spec in DiT_models.items():
        assert model_depth({"backbone_type": name, "params": {}}) == spec["depth"], name


# Runs that differ in one config key. Their config is a run's config.yaml as train.py resolved it (the study's
# archived tread run): settings are read from the whole file, not from keys the report knows about.
RESOLVED = REPO / "docs" / "results" / "runs" / "compare" / "global_seed=0,model=tread" / "config.yaml"
SELECTION = "model.params.routes.0.selection"
MIX = "model.params.routes.0.importance_mix"
RATIO = "model.params.routes.0.selection_ratio"
VARIANTS = {  # run dir: (config changes, final FIDs, class_acc, nn_ratio), seed 0 unless the name says
    "random_seed0": ({}, [20.0, 14.0], [0.5, 0.8], [2.0, 1.4]),
    "random_seed1": ({"global_seed": 1, "train.logging.log_interval": 7}, [21.0, 18.0, 16.5], [0.6, 0.65, 0.7],
                     [2.1, 1.8, 1.3]),  # one more evaluation than seed 0
    "random_ratio0.25": ({RATIO: 0.25}, [19.0, 12.0], [0.5, 0.85], [2.0, 1.5]),
    "importance_mix1": ({SELECTION: "importance", MIX: 1.0}, [18.0, 13.0], [0.6, 0.9], [1.9, 1.2]),
    "importance_mix0.5": ({SELECTION: "importance", MIX: 0.5}, [18.5, 13.5], [0.6, 0.88], [1.9, 1.25]),
    "new_rule": ({SELECTION: "new_rule"}, [22.0, 15.0], [0.4, 0.75], [2.2, 1.35]),
    "dit": ({"model.name": "dit", "model.params.enable_routing": False, "model.params.routes": []},
            [23.0, 17.0], [0.45, 0.7], [2.3, 1.45]),
}


@pytest.fixture(scope="module")
def one_key_apart(tmp_path_factory):
    """The VARIANTS' run dirs (each also with its own run_name and results_dir, as a sweep writes them) and the
    report over them: report.csv's rows by run and report.md's by-configuration table as dicts."""
    from tools import report

    root = tmp_path_factory.mktemp("one_key_apart")
    for name, (changes, fids, acc, nn) in VARIANTS.items():
        cfg = set_keys(yaml.safe_load(RESOLVED.read_text()), {"run_name": f"ablation/{name}",
                                                               "results_dir": f"/elsewhere/{name}", **changes})
        (root / name).mkdir()
        (root / name / "config.yaml").write_text(yaml.safe_dump(cfg))
        (root / name / "status.json").write_text(json.dumps({"status": "completed"}))
        add_fid(root / name, fids, class_acc=acc, nn_ratio=nn)
    report.main([str(root), "--out", str(root / "report")])
    md = (root / "report" / "report.md").read_text()
    table = md.split("## By configuration")[1].split("\n\n")[2].splitlines()
    header = [c.strip() for c in table[0].strip("|").split("|")]
    grouped = [dict(zip(header, (c.strip() for c in line.strip("|").split("|")))) for line in table[2:]]
    return {r["run"]: r for r in read_csv(root / "report" / "report.csv")}, grouped, root


def rows_of(grouped, **match):
    return [r for r in grouped if all(r[k] == v for k, v in match.items())]


def test_runs_that_differ_only_in_the_ratio_are_separate_rows(one_key_apart):
    _, grouped, _ = one_key_apart
    quarter, half = rows_of(grouped, ratio="0.25"), rows_of(grouped, ratio="0.5", settings="selection=random")
    assert len(quarter) == len(half) == 1, grouped
    assert (quarter[0]["runs"], quarter[0]["final FID"]) == ("1", "12.00")
    assert half[0]["runs"] == "2"  # the two seeds of ratio 0.5, not the 0.25 run


def test_runs_that_differ_only_in_the_selection_rule_or_an_option_are_separate_rows(one_key_apart):
    runs, grouped, _ = one_key_apart
    settings = {name: runs[name]["settings"] for name in VARIANTS}
    assert settings == {"random_seed0": "selection=random", "random_seed1": "selection=random",
                        "random_ratio0.25": "selection=random",
                        "importance_mix1": "importance_mix=1, selection=importance",
                        "importance_mix0.5": "importance_mix=0.5, selection=importance",
                        "new_rule": "selection=new_rule",
                        "dit": "-"}  # 0 is most runs' importance_mix: it sets nothing apart; dit has no route
    for name in ("importance_mix1", "importance_mix0.5", "new_rule"):
        row = rows_of(grouped, settings=settings[name])
        assert len(row) == 1 and row[0]["runs"] == "1", (name, grouped)
        assert row[0]["final FID"] == f"{VARIANTS[name][1][-1]:.2f}"
    assert len(grouped) == len(VARIANTS) - 1  # seven runs, six configurations


def test_seeds_of_one_configuration_are_one_row_with_mean_and_std(one_key_apart):
    """The two seeds also differ in run_name, results_dir and log interval, which change nothing trained."""
    runs, grouped, _ = one_key_apart
    row, = rows_of(grouped, ratio="0.5", settings="selection=random")
    finals = [VARIANTS[f"random_seed{s}"][1][-1] for s in (0, 1)]
    assert row["final FID"] == f"{statistics.mean(finals):.2f} ± {statistics.stdev(finals):.4g}" == "15.25 ± 1.768"
    assert row["final class_acc"] == "0.75 ± 0.07071" and row["final nn_ratio"] == "1.35 ± 0.07071"
    assert (runs["random_seed0"]["seed"], runs["random_seed1"]["seed"]) == ("0", "1")
    assert row["note"] == "final FID at steps 200, 300"  # said, since seed 1 is one evaluation further


def test_class_acc_and_nn_ratio_of_the_final_evaluation_are_columns(one_key_apart):
    runs, grouped, _ = one_key_apart
    for name, (_, fids, acc, nn) in VARIANTS.items():
        assert (float(runs[name]["final_class_acc"]), float(runs[name]["final_nn_ratio"])) == (acc[-1], nn[-1]), name
    assert rows_of(grouped, model="dit")[0]["final class_acc"] == "0.7"


def test_settings_name_a_key_an_older_config_lacks_and_skip_routes_a_run_has_not():
    def group(config):
        return [{"config": config, "run": "r"}]

    new = {SELECTION: "random", RATIO: 0.5, "model.name": "tread"}
    old = {RATIO: 0.5, "model.name": "tread"}  # written before `selection` existed
    dit = {"model.params.routes": [], "model.name": "dit"}
    assert settings_labels([group(new), group(old), group(dit)]) == ["selection=random", "selection=unset", ""]
    assert settings_labels([group(new), group(dict(new, **{MIX: 1}))]) == ["importance_mix=unset", "importance_mix=1"]
    dated = [group({"note": datetime.date(2025, 1, 2)}), group({"note": "x"})]  # YAML reads dates: no crash
    assert group_by_configuration([g[0] for g in dated]) == dated and settings_labels(dated) == ["note=2025-01-02",
                                                                                                "note=x"]


def test_a_key_added_later_groups_at_its_default_and_splits_at_another_value():
    """A run saved before `train.attention` existed ran the code its default keeps (configs/config.yaml's sdpa):
    one configuration with a run that saved the default, another with a run that chose another kernel."""
    before = {"model.name": "tread", RATIO: 0.5}
    at_default, other = dict(before, **{"train.attention": "sdpa"}), dict(before, **{"train.attention": "math"})
    runs = [{"config": c, "run": name} for name, c in (("before", before), ("default", at_default), ("math", other))]
    groups = group_by_configuration(runs)
    assert [[r["run"] for r in g] for g in groups] == [["before", "default"], ["math"]]
    assert settings_labels(groups) == ["attention=sdpa", "attention=math"]


def test_placement_chart_states_the_noise_it_has(one_key_apart):
    """Single-seed routes against a 3-seed baseline: one hue, the baseline's seed std stated, each difference ±
    its standard error; seeds everywhere: mean ± std and red to green; no seeds at all: no error claimed."""
    base = {("DiT-D/4", "digits"): (12.0, 3, 0.4)}
    scale, caption, pooled = fid_noise([(16.41, None, 1), (11.5, None, 1)], base, {512})
    assert scale == NEUTRAL and pooled == pytest.approx(0.4)
    assert "2 of 3 value(s) without a seed spread" in caption
    assert "FID at 512 samples varies between seeds by 0.40 (sample std pooled over the 1 configuration(s)" in caption
    assert value_text(16.41, None, 1, base[("DiT-D/4", "digits")], pooled) == \
        f"16.41 (+4.41 ± {math.sqrt(0.4 ** 2 + 0.4 ** 2 / 3):.2f})"
    seeded = [(8.69, 0.18, 3), (9.0, 0.3, 2)]
    scale, caption, pooled = fid_noise(seeded, base, {256, 512})
    assert scale == SEEDED and "FID at 256-512 samples: mean ± std over seeds" in caption
    assert pooled == pytest.approx(math.sqrt((2 * 0.18 ** 2 + 0.3 ** 2 + 2 * 0.4 ** 2) / 5))
    assert value_text(8.69, 0.18, 3, (8.08, 3, 0.25), pooled) == \
        f"8.69 ± 0.18 (+0.61 ± {math.sqrt(0.18 ** 2 / 3 + 0.25 ** 2 / 3):.2f})"
    scale, caption, pooled = fid_noise([(16.41, None, 1)], {("DiT-D/4", "digits"): (12.0, 1, None)}, {512})
    assert scale == NEUTRAL and pooled is None and "not measured" in caption
    assert value_text(16.41, None, 1, (12.0, 1, None), None) == "16.41 (+4.41)"
    _, _, root = one_key_apart  # drawn from runs: one 2-seed route, the rest and the dit baseline single seeds
    svg = (root / "report" / "route_placement.svg").read_text()
    text = " ".join(re.findall(r"<text[^>]*>([^<]*)</text>", svg))  # the caption's lines are texts of their own
    std = statistics.stdev([14.0, 16.5])
    assert f"5 of 6 value(s) without a seed spread, so one colour hue. FID at 512 samples varies between seeds by " \
           f"{std:.2f}" in text
    assert f"15.25 ± {std:.2f} (-1.75 ± {math.sqrt(std ** 2 / 2 + std ** 2):.2f})" in text and "(2 seeds)" in text


def test_a_baseline_of_two_configurations_has_no_seed_spread():
    def dit(name, fid, lr):
        return dict(run=name, baseline=True, final_fid=fid, backbone="DiT-D/4", dataset="digits", route_list=[],
                    config={"model.name": "dit", "train.optimizer.lr": lr})

    assert baselines([dit("a", 10.0, 1e-3), dit("b", 12.0, 1e-3)])[("DiT-D/4", "digits")] == \
        (11.0, 2, pytest.approx(math.sqrt(2)))
    assert baselines([dit("a", 10.0, 1e-3), dit("b", 12.0, 3e-3)])[("DiT-D/4", "digits")] == (11.0, 2, None)
