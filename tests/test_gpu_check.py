"""scripts/gpu_check.sh --dry-run: every part of the GPU check on the CPU at toy size, so that a broken part
is found before a GPU is lent. One test per part (the whole dry run takes several minutes on two cores)."""
import json
import os
import subprocess
import sys

import pytest

from conftest import save_tiny_vae
from test_bench import write_paper_repo

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Imported by every Python process of the dry run (it is first on PYTHONPATH): the ADM metrics' matrix square
# roots of 2048 x 2048 covariance products (half a minute each on two cores; test_evaluator_cli and
# test_metrics run the real ones) become the identity, so the suite and the evaluator finish in seconds.
SITECUSTOMIZE = '''
import importlib.abc, importlib.util, sys


class IdentitySqrtm(importlib.abc.MetaPathFinder):
    busy = False

    def find_spec(self, name, path, target=None):
        if name != "evaluations.metrics" or self.busy:
            return None
        self.busy = True
        try:
            spec = importlib.util.find_spec(name)
        finally:
            self.busy = False
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            module._sqrtm = lambda a: __import__("numpy").eye(len(a))

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, IdentitySqrtm())
'''


def dry_run(tmp_path, *parts, **env):
    site = tmp_path / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    full_env = dict(os.environ, PYTHON=sys.executable, PYTHONPATH=str(site), OMP_NUM_THREADS="1", **env)
    out = tmp_path / "out"
    proc = subprocess.run(["bash", "scripts/gpu_check.sh", "--dry-run", *parts, str(out)], cwd=REPO, env=full_env,
                          capture_output=True, text=True, timeout=900)
    return proc, out


def stages(summary):
    """{stage: 'rc N ...' or 'skipped ...'} from a part's summary.txt."""
    found = {}
    for line in summary.read_text().splitlines():
        name, _, status = line.partition(": ")
        if status.startswith(("rc ", "skipped")):
            found[name] = status
    return found


def check_part(out, part, expected_stages):
    files = sorted(p.name for p in (out / part).iterdir())
    assert len(files) <= 8, files  # the most one device command brings back
    ran = stages(out / part / "summary.txt")
    assert sorted(ran) == sorted(expected_stages), ran
    for name, status in ran.items():
        assert status.startswith("rc 0 "), (name, status, (out / part / f"{name}.log").read_text()[-3000:])
        assert (out / part / f"{name}.log").read_text().splitlines()[-1].startswith("rc 0 after")
    return files


def test_part1_times_both_backbones_ours_and_the_paper_code(tmp_path):
    proc, out = dry_run(tmp_path, "part1", PAPER_CODE=str(write_paper_repo(tmp_path / "paper")))
    assert proc.returncode == 0, proc.stderr
    check_part(out, "part1", ["bench_b2", "bench_xl2"])
    for name, micro_batch in (("bench_b2", 4), ("bench_xl2", 2)):
        record = json.loads((out / "part1" / f"{name}.json").read_text())
        rows = record["training"]
        assert [(r["code"], r["mode"], r["model"], r["fp32_after_route"]) for r in rows] == [
            ("ours", "compiled", "dit", None), ("ours", "compiled", "tread", True), ("ours", "compiled", "tread", False),
            ("paper", "published", "dit", None), ("paper", "published", "tread", True)]
        assert record["dtype"] == "bf16" and all(r["micro_batch"] == micro_batch and r["batch"] == 4 for r in rows)
        assert all(r["graphs"] > 0 for r in rows if r["code"] == "ours")


def test_part2_times_fid_stage_by_stage_and_the_suite(tmp_path):
    proc, out = dry_run(tmp_path, "part2", BENCH_VAE=save_tiny_vae(tmp_path / "vae", 64))
    assert proc.returncode == 0, proc.stderr
    check_part(out, "part2", ["bench_fid", "bench_suite"])
    fid, = json.loads((out / "part2" / "bench_fid.json").read_text())["fid"]
    assert fid["stages_done"] == ["sampling", "decoding", "features", "statistics", "distance"]
    assert fid["compiled"] and fid["padded_samples"] == 1 and fid["frames"] == 1
    suite, = json.loads((out / "part2" / "bench_suite.json").read_text())["suite"]
    assert suite["stages_done"] == ["writing", "evaluator"] and suite["peak_host_mb"] > 0
    assert "  evaluator: FID:" in (out / "part2" / "bench_suite.log").read_text()


def test_part3_collects_the_cpu_and_cuda_tests_and_trains(tmp_path):
    proc, out = dry_run(tmp_path, "part3")
    assert proc.returncode == 0, proc.stderr
    check_part(out, "part3", ["pytest_cpu", "pytest_cuda", "train_tread", "train_dit"])
    assert "test_cuda.py" in (out / "part3" / "pytest_cuda.log").read_text()
    summary = (out / "part3" / "summary.txt").read_text()
    assert "train_tread: 0 recompile(s)" in summary and "train_dit: 0 recompile(s)" in summary


def test_part4_resumes_bit_identically_and_samples(tmp_path):
    proc, out = dry_run(tmp_path, "part4")
    assert proc.returncode == 0, proc.stderr
    files = check_part(out, "part4", ["resume", "sample_cfg", "sample_routing_guidance", "fid_ref", "fid_calc",
                                      "evaluator"])
    assert "sample_cfg.png" in files
    resume = (out / "part4" / "resume.log").read_text()
    assert "killed: rc 137" in resume
    for part in ("model", "ema"):
        line = next(line for line in resume.splitlines() if line.startswith(f"{part}: "))
        equal, total = line.split()[1].split("/")
        assert equal == total, line


def test_a_spent_budget_skips_stages_and_leaves_their_logs(tmp_path):
    proc, out = dry_run(tmp_path, "part2", PART_BUDGET="1")
    assert proc.returncode == 0, proc.stderr
    assert stages(out / "part2" / "summary.txt") == {name: "skipped, the part's time budget is spent"
                                                     for name in ("bench_fid", "bench_suite")}
    assert (out / "part2" / "bench_fid.log").read_text().startswith("skipped")


@pytest.mark.parametrize("args", [["part5"], ["--dry-run", "part1", "a", "b"], []])
def test_bad_arguments_are_refused(args):
    proc = subprocess.run(["bash", "scripts/gpu_check.sh", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=60, env=dict(os.environ, OUT=""))
    assert proc.returncode == 2 and "usage: bash scripts/gpu_check.sh" in proc.stderr
