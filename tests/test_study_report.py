"""lab/study_report.py on synthetic run dirs written as train.py writes them (config.yaml, status.json,
metrics.jsonl with log and evaluation records): its bands and Welch p-values equal numpy/scipy on the same
numbers, copying stops the comparison, one seed gets no band or p-value, bad input is a one-line error;
and scripts/toy_study.sh's stages launch jobs that compose with the expected settings."""
import csv
import json
import os
import re

import numpy as np
import pytest
import yaml
from scipy import stats

from conftest import REPO, assert_one_line_error, compose_cfg, expand, run_script, script_calls
from lab import study_report
from tools.report import load_runs

STEPS = [250, 500, 750]
ROUTE = "model.params.routes.0"


def fid_of(model, seed, step):
    return 100.0 - step / 10 + (3 if model == "dit" else 0) + [0.0, 2.5, -1.7][seed] * (1 + step / 500)


def acc_of(model, seed, step):
    return 0.5 + step / 2000 + 0.01 * seed + (0.02 if model == "tread" else 0) - (0.015 * seed * seed if model == "dit" else 0)


def write_run(root, name, model="tread", seed=0, route=(2, 8, 0.5), nn=lambda step: 1.3, speed=4.0,
              status="completed", evals=STEPS, route_extra=None, fid=fid_of, **config):
    """A run dir like train.py's: config.yaml (the model section's shape, `config` merged in), status.json,
    metrics.jsonl."""
    run = root / name
    run.mkdir(parents=True)
    routed = model == "tread"
    params = dict(num_classes=10, in_channels=1, input_size=16, enable_routing=routed,
                  routes=[dict(selection_ratio=route[2], start_layer_idx=route[0], end_layer_idx=route[1],
                               **(route_extra or {}))])
    cfg = dict(run_name=root.name, global_seed=seed, train=dict(max_steps=evals[-1] if evals else 750),
               model=dict(name=model, backbone_type="DiT-D/4", params=params), dataset=dict(name="digits"))
    for key, value in config.items():
        cfg[key] = {**cfg.get(key, {}), **value}
    (run / "config.yaml").write_text(yaml.safe_dump(cfg))
    (run / "status.json").write_text(json.dumps({"status": status, "time": 1.0}))
    lines, t = [], 1_795_469_494.0
    for step in range(50, (evals[-1] if evals else 100) + 1, 50):
        t += 50 / speed
        lines.append(dict(step=step, time=t, loss=0.3, steps_per_sec=speed, world_size=1))
        if step in evals:
            lines.append(dict(step=step, time=t + 5, fid=fid(model, seed, step), class_acc=acc_of(model, seed, step),
                              nn_ratio=nn(step), eval_seconds=5.0))
            t += 5
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    return run


def compare_root(tmp_path, nn_tread_seed1=lambda step: 1.3):
    root = tmp_path / "compare"
    for model in ("dit", "tread"):
        for seed in range(3):
            write_run(root, f"global_seed={seed},model={model}", model, seed, speed=2.0 if model == "dit" else 3.0,
                      nn=nn_tread_seed1 if (model, seed) == ("tread", 1) else lambda step: 1.3)
    return root


def read_parts(*roots):
    runs, _ = load_runs([str(r) for r in roots])
    for r in runs:
        r["evals"] = study_report.evaluations(r)
    return runs


def study_csv(out):
    with open(out / "study.csv") as f:
        return list(csv.DictReader(f))


def test_bands_are_mean_and_sample_std_over_seeds(tmp_path):
    groups = study_report.configurations(read_parts(compare_root(tmp_path)))
    assert list(groups) == ["dit", "tread 2->8 @ 0.5"]
    for model, members in zip(("dit", "tread"), groups.values()):
        for metric in ("fid", "class_acc"):
            points = study_report.band(members, metric)
            assert [p[0] for p in points] == STEPS and all(p[4] == 3 for p in points)
            for step, _, mean, std, _ in points:
                by_hand = [(fid_of if metric == "fid" else acc_of)(model, s, step) for s in range(3)]
                assert mean == pytest.approx(np.mean(by_hand)) and std == pytest.approx(np.std(by_hand, ddof=1))


def test_welch_table_equals_scipy_and_step_cost_is_measured(tmp_path):
    out = tmp_path / "out"
    run_script("lab.study_report", compare_root(tmp_path), "--out", out, check=True)
    rows = study_csv(out)
    assert [(int(r["step"]), r["metric"]) for r in rows] == [(s, m) for s in STEPS for m in ("fid", "class_acc")]
    for r in rows:
        step = int(r["step"])
        dit, tread = ([(fid_of if r["metric"] == "fid" else acc_of)(m, s, step) for s in range(3)]
                      for m in ("dit", "tread"))
        assert float(r["difference"]) == pytest.approx(np.mean(tread) - np.mean(dit))
        assert float(r["routed_std"]) == pytest.approx(np.std(tread, ddof=1))
        assert float(r["p_welch"]) == pytest.approx(stats.ttest_ind(tread, dit, equal_var=False).pvalue)
        assert r["note"] == ""
    md = (out / "study.md").read_text()
    assert "| compare | tread 2->8 @ 0.5 | 3 | 3 | 1.50x |" in md  # 3.0 over 2.0 steps/s
    assert "none: every run completed" in md
    for stem in ("study_compare_vs_step", "study_compare_vs_time"):
        assert (out / f"{stem}.png").stat().st_size > 0


def test_copying_stops_the_comparison_from_that_step_on(tmp_path):
    root = compare_root(tmp_path, nn_tread_seed1=lambda step: 0.7 if step == 500 else 1.3)
    runs = read_parts(root)
    groups = study_report.configurations(runs)
    rows = study_report.welch_rows("compare", "dit", groups["dit"], "tread", groups["tread 2->8 @ 0.5"])
    notes = {(r[3], r[4]): (r[12], r[13]) for r in rows}
    assert notes[(250, "fid")][0] is not None and notes[(250, "fid")][1] == ""
    for step in (500, 750):  # nn_ratio 0.7 at 500; 750 stays stopped although it recovered
        assert notes[(step, "fid")][0] is None and notes[(step, "class_acc")][0] is None
        assert notes[(step, "fid")][1].startswith("copying: comparison stopped")


def test_each_configurations_last_grid_is_copied_and_shown(tmp_path):
    root = compare_root(tmp_path)
    for run in root.iterdir():
        (run / "samples").mkdir()
        for step in STEPS:
            (run / "samples" / f"step_{step:08d}.png").write_bytes(f"{run.name} {step}".encode())
    out = tmp_path / "out"
    run_script("lab.study_report", root, "--out", out, check=True)
    md = (out / "study.md").read_text()
    for name, stem in (("global_seed=0,model=dit", "study_compare_dit_samples"),
                       ("global_seed=0,model=tread", "study_compare_tread_2_8_0.5_samples")):
        assert (out / f"{stem}.png").read_bytes() == f"{name} 750".encode()
        assert f"({stem}.png)" in md
    assert "dit, seed 0, step 750:" in md


def test_cost_part_gives_the_step_cost_alone_and_no_evaluations_are_expected_of_it(tmp_path):
    cost = tmp_path / "cost"
    write_run(cost, "global_seed=0,model=dit", "dit", evals=[], speed=2.0)
    write_run(cost, "global_seed=0,model=tread", "tread", evals=[], speed=3.0)
    out, compare = tmp_path / "out", compare_root(tmp_path)
    run_script("lab.study_report", compare, cost, "--out", out, check=True)
    md = (out / "study.md").read_text()
    alone = md.split("## Step cost with the machine to itself")[1]
    assert "| cost | dit | 1 | 2 | 1.00x |" in alone and "| cost | tread 2->8 @ 0.5 | 1 | 3 | 1.50x |" in alone
    assert "## cost" not in md and "none: every run completed" in md
    assert not list(out.glob("study_cost_*"))
    # equal time at those costs: tread's 750 steps take 250 s at 3 steps/s, when dit at 2 steps/s is at step 500
    equal = md.split("## At equal training time, each step costing what it cost alone")[1].split("##")[0]
    dit, tread = ([fid_of(m, s, step) for s in range(3)] for m, step in (("dit", 500), ("tread", 750)))
    assert f"| compare | dit | 2 | 4.2 | 500 | {study_report.pm(np.mean(dit), np.std(dit, ddof=1))} |" in equal
    assert f"| compare | tread 2->8 @ 0.5 | 3 | 4.2 | 750 | {study_report.pm(np.mean(tread), np.std(tread, ddof=1))} |" \
        in equal
    # compare's runs trained two at a time, their clocks unused: the table at the cost part's clock stays
    run_script("lab.study_report", compare, cost, "--out", out, "--untimed", "compare/*", check=True)
    md = (out / "study.md").read_text()
    assert md.split("## At equal training time, each step costing what it cost alone")[1].split("##")[0] == equal
    assert "## Step cost measured in these runs" not in md and "## At equal training time (the fastest" not in md


def test_one_seed_gets_no_band_and_no_p_value(tmp_path):
    root = tmp_path / "ratio"
    write_run(root, "a", "tread", 0, route=(2, 8, 0.0))
    for seed in range(3):
        write_run(root, f"b{seed}", "tread", seed, route=(2, 8, 0.5))
    groups = study_report.configurations(read_parts(root))
    assert list(groups) == ["tread 2->8 @ 0", "tread 2->8 @ 0.5"]
    assert all(p[3] is None and p[4] == 1 for p in study_report.band(groups["tread 2->8 @ 0"], "fid"))
    rows = study_report.welch_rows("ratio", "a", groups["tread 2->8 @ 0"], "b", groups["tread 2->8 @ 0.5"])
    assert rows and all(r[12] is None and r[7] is None for r in rows)
    mean, std = study_report.final_values(groups["tread 2->8 @ 0.5"], "fid")
    finals = [fid_of("tread", s, 750) for s in range(3)]
    assert (mean, std) == (pytest.approx(np.mean(finals)), pytest.approx(np.std(finals, ddof=1)))


def test_placement_chart_and_unfinished_runs_are_listed(tmp_path):
    compare = compare_root(tmp_path)
    placement = tmp_path / "placement"
    for s in (0, 2, 4):
        for e in (5, 8, 10):
            write_run(placement, f"start={s},end={e}", route=(s, e, 0.5), evals=[250, 500])
    write_run(placement, "still_going", route=(1, 9, 0.5), status="running", evals=[250])
    write_run(placement, "failed", route=(1, 6, 0.5), status="failed", evals=[])
    runs = read_parts(compare, placement)
    base = study_report.placement_baseline([r for r in runs if r["dir"].parent == placement], runs)
    dit_500 = [fid_of("dit", s, 500) for s in range(3)]
    assert base == {("DiT-D/4", "digits"): (pytest.approx(np.mean(dit_500)), 3, pytest.approx(np.std(dit_500, ddof=1)))}
    out = tmp_path / "out"
    run_script("lab.study_report", compare, placement, "--out", out, check=True)
    assert (out / "study_placement_routes.png").stat().st_size > 0
    chart = " ".join(re.findall(r"<text[^>]*>([^<]*)</text>", (out / "study_placement_routes.svg").read_text()))
    assert f"10 of 11 value(s) without a seed spread, so one colour hue. FID varies between seeds by " \
           f"{np.std(dit_500, ddof=1):.2f}" in chart  # the single-seed routes against the 3 dit seeds' spread
    md = (out / "study.md").read_text()
    assert "| placement/still_going | running | 250 | 1 |" in md and "| placement/failed | failed |" in md
    table = md.split("### placement: each route at its final evaluation, best FID first")[1].split("\n\n")
    assert table[1] == f"Baseline, no routing: DiT-D/4 on digits: FID {study_report.cell(base[('DiT-D/4', 'digits')][0])} (3 run(s))."
    rows = [line.split(" | ") for line in table[2].splitlines()[2:]]
    finals = [float(r[2]) for r in rows[:-1]]
    assert len(rows) == 11 and finals == sorted(finals)  # 9 routes + the running one, sorted; then the failed one
    assert rows[-1][0] == "| tread 1->6 @ 0.5" and rows[-1][2] == "-"
    assert rows[0][0].startswith("| tread") and rows[0][-1] == "500 |"


@pytest.mark.parametrize("case", ["missing", "empty"])
def test_bad_input_is_one_error_line(tmp_path, case):
    path = tmp_path / "nothing"
    if case == "empty":
        path.mkdir()
    proc = run_script("lab.study_report", path, "--out", tmp_path / "out")
    assert proc.returncode == 2
    assert_one_line_error(proc, "not a directory" if case == "missing" else "no run directory")


def study_jobs(calls, results):
    """{run dir: (model, seed, route or None)} of every job the script's train.py calls launch, each job's
    settings checked against the issue's (compare 3000 steps, placement and ratio 2000, eval every 250; the cost
    runs 400 steps without evaluation)."""
    jobs = {}
    for call in calls:
        name = next(a for a in call if a.startswith("run_name=")).split("=")[1]
        steps, every = {"compare": (3000, 250), "platform": (3000, 250), "precision": (3000, 250),
                        "cost": (400, 0)}.get(name, (2000, 250))
        for job in expand(call[2:]):
            cfg = compose_cfg(job)
            assert (cfg.train.max_steps, cfg.train.eval.eval_interval, cfg.train.eval.fid_num_samples,
                    cfg.train.ckpt_every) == (steps, every, 512, every or steps)
            assert cfg.model.backbone_type == "DiT-D/4" and cfg.dataset.name == "digits"
            key = f"{cfg.results_dir}/{cfg.run_name}/{cfg.hydra.job.override_dirname}"
            routes = [(r.start_layer_idx, r.end_layer_idx, r.selection_ratio) for r in cfg.model.params.routes]
            assert key not in jobs and len(routes) == (1 if cfg.model.params.enable_routing else 0)
            variant = (cfg.model.params.routes[0].get("fusion", "none") if routes else None, cfg.repa.enabled,
                       cfg.train.routing_off_after)
            jobs[key] = (cfg.model.name, cfg.global_seed, routes[0] if cfg.model.params.enable_routing else None) + \
                ((variant,) if variant != ("none", False, None) and routes else ())
    return jobs


def test_toy_study_stages_compose_with_the_issue_settings(tmp_path):
    results = tmp_path / "res"
    (results / "compare").mkdir(parents=True)  # only compare has runs: the report reads only that part
    calls, proc = script_calls("scripts/toy_study.sh", tmp_path, RESULTS=str(results), REPORT="rep",
                               ARCHIVE=str(tmp_path / "archive"))
    assert proc.returncode == 0, proc.stderr
    assert [c[:2] for c in calls] == [["train.py", "-m"]] * 12 + [["-m", "lab.guidance_eval"],
                                                                 ["-m", "lab.study_report"], ["-m", "lab.digits_reference_limit"]]
    assert calls[-2][2:] == [str(results / "compare"), "--out", "rep"]
    assert calls[-1][2:] == ["--num-samples", "512", "--out", "rep/reference_limit"]
    jobs = study_jobs(calls[:8], results)
    by_repr = lambda values: sorted(values, key=repr)  # None and a step share a place: no natural order
    part = lambda name: by_repr(v for k, v in jobs.items() if k.startswith(f"{results}/{name}/"))
    assert part("compare") == by_repr([("dit", s, None) for s in range(3)] + [("tread", s, (2, 8, 0.5)) for s in range(3)])
    assert part("placement") == by_repr(("tread", 0, (s, e, 0.5)) for s in (0, 2, 4) for e in (5, 8, 10))
    assert part("ratio") == by_repr(("tread", s, (2, 8, r)) for s in range(3) for r in (0.25, 0.75))
    assert part("platform") == by_repr([("tread", s, (2, 9, 0.75), ("sprint", False, None)) for s in range(3)] +
                                       [("tread", s, (2, 8, 0.5), ("none", True, None)) for s in range(3)] +
                                       [("tread", s, (2, 8, 0.5), ("none", False, 2400)) for s in range(3)] +
                                       [("tread", s, (2, 9, 0.75), ("sprint", False, 2400)) for s in range(3)])
    assert len(jobs) == 6 + 9 + 6 + 12 + 6  # every run its own dir; ratios 0 and 0.5 are compare's runs
    precision = [c for c in calls[:8] if "run_name=precision" in c]
    assert len(precision) == 1 and {"train.mixed_precision=bf16", "model.params.fp32_after_route=true,false",
                                     "global_seed=0,1,2", "model=tread"} <= set(precision[0])
    sprint_seed0 = next(k for k, v in jobs.items() if v[1:] == (0, (2, 9, 0.75), ("sprint", False, None)))
    cost = study_jobs(calls[8:12], results)  # one train.py call at a time, so one run at a time
    assert sorted(cost.values()) == sorted([("dit", 0, None)] + [("tread", 0, (2, 8, r)) for r in (0.25, 0.5, 0.75)] +
                                           [("tread", 0, (2, 9, 0.75), ("sprint", False, None)),
                                            ("tread", 0, (2, 8, 0.5), ("none", True, None))])
    assert all(k.startswith(f"{results}/cost/") for k in cost)
    guidance = calls[12][2:]
    assert guidance[0] == sprint_seed0 and guidance[-2:] == ["--out", "rep/guidance"]
    assert guidance[1:9] == ["--cfg-scales", "1.5", "2", "3", "--pdg-scales", "1.5", "2", "3"]
    assert guidance[9:11] == ["--num-samples", "512"]


def test_parallel_workers_launch_the_same_runs_one_job_per_call(tmp_path):
    results = str(tmp_path / "res")
    stages = "compare,placement,ratio,platform"
    calls, proc = script_calls("scripts/toy_study.sh", tmp_path, RESULTS=results, STAGES=stages)
    (tmp_path / "jobs2").mkdir()
    split, proc2 = script_calls("scripts/toy_study.sh", tmp_path / "jobs2", RESULTS=results, JOBS="2", STAGES=stages,
                                ARCHIVE=str(tmp_path / "no-archive"))  # the committed archive's runs would be skipped
    assert proc.returncode == 0 and proc2.returncode == 0, proc2.stderr
    assert len(split) == 33 and all(len(expand(c[2:])) == 1 for c in split)
    threads = max(1, (os.cpu_count() or 1) // 2)  # train.py would take every core in each of the two
    assert all(f"train.cpu_threads={threads}" in c for c in split)
    assert study_jobs(split, results) == study_jobs(calls, results)  # the same run dirs as the whole sweeps
    (tmp_path / "bad").mkdir()
    calls, proc = script_calls("scripts/toy_study.sh", tmp_path / "bad", JOBS="two")
    assert proc.returncode == 2 and "JOBS=two is not a positive integer" in proc.stderr and not calls


def test_parallel_workers_skip_a_run_an_earlier_session_archived_complete(tmp_path):
    """A study trained over several sessions: a run whose archive says it completed its steps is not trained again
    (its folder under RESULTS is gone with its session); one archived short of the steps is."""
    archive = tmp_path / "archive" / "compare"
    for name, step in (("global_seed=0,model=dit", 3000), ("global_seed=1,model=dit", 2750)):
        (archive / name).mkdir(parents=True)
        (archive / name / "status.json").write_text('{"status": "completed", "time": 1}')
        (archive / name / "metrics.jsonl").write_text(f'{{"step": {step}, "fid": 9.0}}\n')
    (tmp_path / "fake").mkdir()
    calls, proc = script_calls("scripts/toy_study.sh", tmp_path / "fake", STAGES="compare", JOBS="2",
                               RESULTS=str(tmp_path / "res"), ARCHIVE=str(tmp_path / "archive"))
    assert proc.returncode == 0, proc.stderr
    jobs = [sorted(o for o in c if o.startswith(("model=", "global_seed="))) for c in calls]
    assert len(calls) == 5 and ["global_seed=0", "model=dit"] not in jobs and ["global_seed=1", "model=dit"] in jobs
    assert "complete: model=dit global_seed=0" in proc.stdout


def test_toy_study_runs_only_the_chosen_stages(tmp_path):
    calls, proc = script_calls("scripts/toy_study.sh", tmp_path, STAGES="ratio", RATIO_STEPS="900", RESULTS="r")
    assert proc.returncode == 0 and len(calls) == 1 and "run_name=ratio" in calls[0]
    assert "train.max_steps=900" in calls[0]
    (tmp_path / "bad").mkdir()
    calls, proc = script_calls("scripts/toy_study.sh", tmp_path / "bad", STAGES="compare,ratoi")
    assert proc.returncode == 2 and "unknown stage 'ratoi'" in proc.stderr and not calls
    (tmp_path / "one").mkdir()
    calls, proc = script_calls("scripts/toy_study.sh", tmp_path / "one", STAGES="platform", PLATFORM="sprint_off",
                               RESULTS="r")
    assert proc.returncode == 0 and len(calls) == 1 and "run_name=platform" in calls[0]
    assert {"model.params.routes.0.fusion=sprint", "train.routing_off_after=2400"} <= set(calls[0])
    (tmp_path / "r" / "platform").mkdir(parents=True)
    (tmp_path / "timed").mkdir()
    calls, proc = script_calls("scripts/toy_study.sh", tmp_path / "timed", STAGES="report", RESULTS=str(tmp_path / "r"),
                               UNTIMED="*routing_off_after* global_seed=0,*")
    assert proc.returncode == 0 and calls[0][-4:] == ["--untimed", "*routing_off_after*", "--untimed", "global_seed=0,*"]
    (tmp_path / "pdg").mkdir()
    calls, proc = script_calls("scripts/toy_study.sh", tmp_path / "pdg", STAGES="guidance", GUIDANCE_RUN="sprint_off",
                               RESULTS="r", REPORT="rep")
    assert proc.returncode == 0 and calls[0][:2] == ["-m", "lab.guidance_eval"]
    assert calls[0][2] == ("r/platform/global_seed=0,model.params.routes.0.end_layer_idx=9,model.params.routes.0.fusion="
                           "sprint,model.params.routes.0.selection_ratio=0.75,model=tread,train.routing_off_after=2400")
    assert calls[0][-2:] == ["--out", "rep/guidance_sprint_off"]
    calls, proc = script_calls("scripts/toy_study.sh", tmp_path / "pdg", STAGES="guidance", GUIDANCE_RUN="tread")
    assert proc.returncode == 2 and "GUIDANCE_RUN=tread is not a variant" in proc.stderr
    (tmp_path / "cost").mkdir()
    calls, proc = script_calls("scripts/toy_study.sh", tmp_path / "cost", STAGES="cost", COST="dit,tread",
                               COST_RATIOS="0.5", RESULTS="r")
    assert proc.returncode == 0 and len(calls) == 2 and "model=dit" in calls[0]
    assert {"model=tread", "model.params.routes.0.selection_ratio=0.5"} <= set(calls[1])
    (tmp_path / "badcost").mkdir()
    calls, proc = script_calls("scripts/toy_study.sh", tmp_path / "badcost", STAGES="compare,cost", COST="dit,trad")
    assert proc.returncode == 2 and "unknown cost run 'trad'" in proc.stderr and not calls
    (tmp_path / "badvariant").mkdir()
    calls, proc = script_calls("scripts/toy_study.sh", tmp_path / "badvariant", PLATFORM="sprint,rep")
    assert proc.returncode == 2 and "unknown variant 'rep'" in proc.stderr and not calls
    (tmp_path / "none").mkdir()
    calls, proc = script_calls("scripts/toy_study.sh", tmp_path / "none", STAGES="report", RESULTS=str(tmp_path / "x"))
    assert proc.returncode == 2 and proc.stderr.startswith("error: no study runs under") and not calls


def test_archive_keeps_what_the_report_reads_and_the_report_rebuilds_from_it(tmp_path):
    """The archive stage copies config, status, metrics and the newest sample grid of every run, not the
    checkpoints; a second pass replaces the grid; the report made from the archive equals the one from the runs."""
    results, archive = tmp_path / "res", tmp_path / "archive"
    compare = compare_root(results)
    runs = sorted(p for p in compare.iterdir() if p.is_dir())
    for run in runs[1:]:  # the first without samples, as a run without evaluation
        (run / "samples").mkdir()
        for step in (250, 500):
            (run / "samples" / f"step_{step:08d}.png").write_bytes(b"png")
        (run / "checkpoints").mkdir()
        (run / "checkpoints" / "latest.pt").write_bytes(b"weights")
    (compare.parent / "placement").mkdir()  # a part with no run yet
    config = runs[0] / "config.yaml"  # launched with an absolute RESULTS inside the checkout
    config.write_text(f"results_dir: {REPO}/results/study\n" + config.read_text())
    env = dict(RESULTS=str(results), ARCHIVE=str(archive), STAGES="archive")
    calls, proc = script_calls("scripts/toy_study.sh", tmp_path, **env)
    assert proc.returncode == 0 and not calls, proc.stderr
    (runs[1] / "samples" / "step_00000750.png").write_bytes(b"newer")
    calls, proc = script_calls("scripts/toy_study.sh", tmp_path, **env)
    assert proc.returncode == 0, proc.stderr
    kept = sorted(str(p.relative_to(archive)) for p in archive.rglob("*") if p.is_file())
    assert kept == sorted(f"compare/{run.name}/{f}" for run in runs for f in (
        "config.yaml", "status.json", "metrics.jsonl") + ((f"samples/step_{750 if run == runs[1] else 500:08d}.png",)
                                                           if run != runs[0] else ()))
    assert (archive / "compare" / runs[1].name / "samples" / "step_00000750.png").read_bytes() == b"newer"
    archived = (archive / "compare" / runs[0].name / "config.yaml").read_text()
    assert archived == config.read_text().replace(f"{REPO}/", "", 1) and archived.startswith("results_dir: results/")
    assert (archive / "compare" / runs[1].name / "config.yaml").read_text() == (runs[1] / "config.yaml").read_text()
    study_report.main([str(compare), "--out", str(tmp_path / "from_runs")])
    study_report.main([str(archive / "compare"), "--out", str(tmp_path / "from_archive")])
    from_runs = (tmp_path / "from_runs" / "study.md").read_text().replace(str(compare), str(archive / "compare"))
    assert from_runs == (tmp_path / "from_archive" / "study.md").read_text()  # but the source it names


def test_ratio_part_borrows_compares_runs_up_to_its_own_last_step(tmp_path):
    """Ratios 0 (dit) and 0.5 come from compare, cut at the ratio runs' last evaluation (500, not 750)."""
    compare, ratio = compare_root(tmp_path), tmp_path / "ratio"
    for r in (0.25, 0.75):
        for seed in range(3):
            write_run(ratio, f"global_seed={seed},ratio={r}", "tread", seed, route=(2, 8, r), evals=[250, 500])
    parts = {"compare": read_parts(compare), "ratio": read_parts(ratio)}
    borrowed = study_report.borrow_compare_runs(parts)
    groups = study_report.configurations(borrowed["ratio"])
    assert list(groups) == ["dit", "tread 2->8 @ 0.25", "tread 2->8 @ 0.5", "tread 2->8 @ 0.75"]
    assert all(sorted(r["evals"]) == [250, 500] for g in groups.values() for r in g)
    assert study_report.final_values(groups["dit"], "fid")[0] == pytest.approx(np.mean([fid_of("dit", s, 500)
                                                                                        for s in range(3)]))
    assert max(parts["compare"][0]["evals"]) == 750  # compare itself is untouched
    assert study_report.borrow_compare_runs({"ratio": parts["ratio"]}) == {"ratio": parts["ratio"]}
    out = tmp_path / "out"
    run_script("lab.study_report", compare, ratio, "--out", out, check=True)
    md = (out / "study.md").read_text()
    table = md[md.index("## Selection ratio"):]
    assert "| ratio | dit | 3 |" in table and "| ratio | tread 2->8 @ 0.5 | 3 |" in table and "| 500 |" in table


def test_sprint_repa_schedule_and_late_routing_off_are_configurations_of_their_own(tmp_path):
    root = tmp_path / "platform"
    write_run(root, "tread", seed=0)
    write_run(root, "sprint", seed=0, route=(2, 8, 0.75), route_extra=dict(fusion="sprint"))
    write_run(root, "repa", seed=0, repa=dict(enabled=True, block=3))
    write_run(root, "off", seed=0, train=dict(max_steps=750, routing_off_after=600))
    write_run(root, "cosine", seed=0, route_extra=dict(schedule=dict(kind="cosine", end_ratio=0.25)))
    write_run(root, "dit", "dit", seed=0, train=dict(max_steps=750, routing_off_after=600))
    groups = study_report.configurations(read_parts(root))
    assert list(groups)[0] == "dit" and sorted(groups) == sorted([
        "dit", "tread 2->8 @ 0.5", "tread 2->8 @ 0.5 (REPA block 3)", "tread 2->8 @ 0.5 (cosine schedule)",
        "tread 2->8 @ 0.5 (routing off after 600)", "tread 2->8 @ 0.75 (sprint)"])


def test_two_routed_settings_without_a_baseline_are_compared_with_each_other(tmp_path):
    """The precision part: tread under bf16 with the block after the route in float32 and in bf16, no dit."""
    root = tmp_path / "precision"
    worse = lambda model, seed, step: fid_of(model, seed, step) + 0.5 * seed + 1.0
    for seed in range(3):
        for fp32, fid in ((True, fid_of), (False, worse)):
            run = write_run(root, f"global_seed={seed},model.params.fp32_after_route={fp32}", seed=seed, fid=fid,
                            train={"max_steps": STEPS[-1], "mixed_precision": "bf16"})
            cfg = yaml.safe_load((run / "config.yaml").read_text())
            cfg["model"]["params"]["fp32_after_route"] = fp32
            (run / "config.yaml").write_text(yaml.safe_dump(cfg))
    out = tmp_path / "out"
    run_script("lab.study_report", root, "--out", out, check=True)
    rows = [r for r in study_csv(out) if r["metric"] == "fid"]
    assert len(rows) == len(STEPS) and len({(r["baseline"], r["routed"]) for r in rows}) == 1
    flip = 1 if "False" in rows[0]["routed"] else -1  # routed - baseline, whichever way round the report put them
    for r in rows:
        a, b = ([f(m, s, int(r["step"])) for s in range(3)] for f, m in ((fid_of, "tread"), (worse, "tread")))
        assert float(r["difference"]) == pytest.approx(flip * (np.mean(b) - np.mean(a)))
        assert float(r["p_welch"]) == pytest.approx(stats.ttest_ind(b, a, equal_var=False).pvalue)


def test_equal_training_time_table_interpolates_at_the_fastest_configurations_end(tmp_path):
    """tread (3 steps/s) ends its 750 steps at 250 s of training (evaluations left out); dit (2 steps/s) is then
    at step 500: its FID there is the one at step 500, tread's the one at 750."""
    groups = study_report.configurations(read_parts(compare_root(tmp_path)))
    ev = groups["dit"][0]["evals"]
    assert ev[250]["time"] == pytest.approx(125.0) and ev[750]["time"] == pytest.approx(375.0)
    rows = {r[1]: r for r in study_report.equal_time_rows("compare", groups)}
    assert rows["dit"][3] == f"{250 / 60:.1f}" and rows["dit"][4].startswith("500")
    dit_500 = [fid_of("dit", s, 500) for s in range(3)]
    assert rows["dit"][5] == study_report.pm(np.mean(dit_500), np.std(dit_500, ddof=1))
    tread_750 = [fid_of("tread", s, 750) for s in range(3)]
    assert rows["tread 2->8 @ 0.5"][5] == study_report.pm(np.mean(tread_750), np.std(tread_750, ddof=1))


def test_untimed_runs_are_compared_per_step_only(tmp_path):
    """--untimed: the matching runs (here tread, clocked 10x faster elsewhere) keep their Welch rows but leave the
    step cost, the equal-time table and the wall-clock plot, and study.md names them."""
    root = tmp_path / "compare"
    for seed in range(3):
        write_run(root, f"global_seed={seed},model=dit", "dit", seed, speed=2.0)
        write_run(root, f"global_seed={seed},model=tread", "tread", seed, speed=30.0)
    plain, untimed = tmp_path / "plain", tmp_path / "untimed"
    run_script("lab.study_report", root, "--out", plain, check=True)
    run_script("lab.study_report", root, "--out", untimed, "--untimed", "*model=tread", check=True)
    assert study_csv(untimed) == study_csv(plain)  # the per-step comparison is unchanged
    run_script("lab.study_report", root, "--out", tmp_path / "part", "--untimed", "compare/*=tread", check=True)
    assert (tmp_path / "part" / "study.md").read_text() == (untimed / "study.md").read_text()  # PART/NAME too
    md, before = (untimed / "study.md").read_text(), (plain / "study.md").read_text()
    assert "| compare | tread 2->8 @ 0.5 | 3 | 30.00 | 15.00x |" in before
    assert "## At equal training time" in before  # tread's row there, and its step cost, are gone:
    assert "| compare | tread 2->8 @ 0.5 |" not in md and "| compare | dit | 3 | 2 | 1.00x |" in md
    assert "Compared per step only" in md and "global_seed=2,model=tread" in md
    assert_one_line_error(run_script("lab.study_report", root, "--out", tmp_path / "typo", "--untimed", "*model=traed"),
                          "--untimed *model=traed matches no run")
    time_svg = (untimed / "study_compare_vs_time.svg").read_text()
    assert "tread 2-&gt;8 @ 0.5 (3 seed(s))" not in time_svg and "dit (3 seed(s))" in time_svg
    assert "tread 2-&gt;8 @ 0.5 (3 seed(s))" in (untimed / "study_compare_vs_step.svg").read_text()
    run_script("lab.study_report", root, "--out", tmp_path / "none", "--untimed", "*", check=True)
    assert (tmp_path / "none" / "study_compare_vs_step.png").is_file()  # every run untimed: no empty clock plot
    assert not (tmp_path / "none" / "study_compare_vs_time.png").exists()


def test_runs_that_differ_only_in_the_selection_rule_are_configurations_of_their_own(tmp_path):
    root = tmp_path / "selection"
    for seed in range(2):
        write_run(root, f"random{seed}", seed=seed, route_extra=dict(selection="random", importance_mix=0.0))
    write_run(root, "importance", route_extra=dict(selection="importance", importance_mix=1.0))
    write_run(root, "importance_half", route_extra=dict(selection="importance", importance_mix=0.5))
    groups = study_report.configurations(read_parts(root))
    assert {name: len(g) for name, g in groups.items()} == {  # importance is most configurations' rule: not named
        "tread 2->8 @ 0.5 [importance_mix=0, selection=random]": 2, "tread 2->8 @ 0.5 [importance_mix=1]": 1,
        "tread 2->8 @ 0.5 [importance_mix=0.5]": 1}
