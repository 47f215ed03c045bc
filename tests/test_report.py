"""report.py on a real 2x2 multirun (one job invalid), on copies with synthetic FID records, and bad input."""
import csv
import json
import shutil

import pytest
import yaml

from conftest import REPO, assert_one_line_error, run_script, tiny_overrides
from dit import DiT_models
from tools.report import model_depth

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


def add_fid(run_dir, fids, every=100, sps=10.0, eval_s=5.0):
    """Synthetic records: `every` steps at `sps` steps/s, then an evaluation taking `eval_s` seconds."""
    lines, t = [], 1000.0
    for i, fid in enumerate(fids, 1):
        t += every / sps
        lines.append({"step": i * every, "time": t, "loss": 1.0 / i, "steps_per_sec": sps, "world_size": 2})
        t += eval_s
        lines.append({"step": i * every, "time": t, "fid": fid, "eval_seconds": eval_s})
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))


def clone(src, dst, **config_changes):
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("checkpoints"))
    cfg = yaml.safe_load((dst / "config.yaml").read_text())
    for key, value in config_changes.items():
        node = cfg
        *path, last = key.split(".")
        for part in path:
            node = node[part]
        node[last] = value
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
    assert "no routing, DiT-D/4 (mean of 1)" in svg and ">32.00<" in svg  # the baseline has a row of its own
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
