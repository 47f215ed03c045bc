"""scripts/gpu_check.sh --dry-run: every row of the GPU check on the CPU at toy size, so that a broken row is
found before a GPU is lent; and its budget, which skips a row whose estimate no longer fits."""
import importlib.util
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


def dry_run(tmp_path, *args, **env):
    site = tmp_path / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    full_env = dict(os.environ, PYTHON=sys.executable, PYTHONPATH=str(site), OMP_NUM_THREADS="1", **env)
    out = tmp_path / "out"
    proc = subprocess.run(["bash", "scripts/gpu_check.sh", "--dry-run", *args, str(out)], cwd=REPO, env=full_env,
                          capture_output=True, text=True, timeout=900)
    return proc, out


def rows_run(out):
    """{row: 'rc N ...' or 'skipped ...'} from summary.txt."""
    found = {}
    for line in (out / "summary.txt").read_text().splitlines():
        name, _, status = line.partition(": ")
        if status.startswith(("rc ", "skipped")):
            found[name] = status
    return found


def check_rows(proc, out, expected):
    assert proc.returncode == 0, proc.stderr
    assert len(list(out.iterdir())) <= 8  # the most one device command brings back
    ran = rows_run(out)
    assert list(ran) == expected, ran
    logs = (out / "logs.txt").read_text()
    for name, status in ran.items():
        assert status.startswith("rc 0 "), (name, status, logs[-3000:])
    assert str(out) not in logs and "/tmp/tmp." not in logs and "/site-packages/" not in logs  # no machine paths
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith(f"gpu_check summary: {len(expected)} passed"), last
    return logs


def test_training_rows_time_ours_and_the_paper_code_and_profile_ours(tmp_path):
    proc, out = dry_run(tmp_path, "flux", "xl2", PAPER_CODE=str(write_paper_repo(tmp_path / "paper")))
    check_rows(proc, out, ["flux", "xl2"])
    flux = json.loads((out / "flux.json").read_text())  # the FLUX.1-dev LoRA row: its host-cost proxy on a CPU
    assert [(r["blocks"], r["compiled"]) for r in flux["rows"]] == [(57, False)] and flux["rows"][0]["flop_bound"] > 1
    # xl2 times ours compiled block by block, as the paper code, each with its warm-up (compilation) time (b2 runs
    # the same with its own sizes: the next test reads its command)
    record = json.loads((out / "xl2.json").read_text())
    rows = record["training"]
    assert [(r["code"], r["compile_scope"], r["model"]) for r in rows] == [
        ("ours", "blocks", "dit"), ("ours", "blocks", "tread"), ("paper", "blocks", "dit"), ("paper", "blocks", "tread")]
    assert [r["mode"] for r in rows] == ["compiled"] * 2 + ["published"] * 2
    assert record["dtype"] == "bf16" and all(r["micro_batch"] == 2 and r["batch"] == 4 for r in rows)
    assert all(r["graphs"] > 0 and r["warmup_s"] > 0 for r in rows if r["code"] == "ours")
    # 12 blocks share one graph, routed: the full, the routed and the float32 block's shapes; and the final layer's
    assert [r["graphs"] for r in rows[:2]] == [2, 4]
    for r in rows:
        assert ("profile" in r) == (r["code"] == "ours")
    profile = rows[1]["profile"]
    assert profile["ms_by_category"]["matmul"] > 0 and profile["top"]
    assert profile["host_syncs"] is None and profile["fp32_kernel_ms"] is None  # GPU-only readings
    assert not (out / "xl2.md").exists()  # the tables are in the log


def test_the_other_xl2_and_b2_rows_are_xl2_with_one_bench_option_each(tmp_path):
    """b2, xl2model, xl2bf16, xl2fp32math, xl2static and xl2flash4 run what xl2 runs (its dry run above) but for
    one or two bench options, which the bench's own tests run (tests/test_bench_gpu_readiness.py,
    tests/test_attention_backends.py, tests/test_compile_scope.py): read here from the commands the script gives a
    stand-in interpreter, parsed by the bench's parser; without flash-attn-4, xl2flash4 is skipped in one line."""
    from lab.bench import build_parser

    log, fake = tmp_path / "calls", tmp_path / "fake-python"
    fake.write_text(f'#!/usr/bin/env bash\nprintf "%s\\n" "$@" --- >> {log}\n')
    fake.chmod(0o755)
    proc = subprocess.run(["bash", "scripts/gpu_check.sh", "--dry-run", "xl2", "b2", "xl2model", "xl2bf16", "xl2fp32math",
                           "xl2static", "xl2flash4",
                           str(tmp_path / "o")],
                          cwd=REPO, env=dict(os.environ, PYTHON=str(fake)), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    calls = [c.strip("\n").split("\n") for c in log.read_text().split("---\n") if c.strip()]
    bench = {c[c.index("--out") + 1].rsplit("/", 1)[-1]: vars(build_parser().parse_args(c[2:]))
             for c in calls if c[:2] == ["-m", "lab.bench"]}
    differs = lambda a, b: {k for k in a if a[k] != b[k] and k not in ("out", "paper_code", "paper_modes", "profile")}
    xl2, b2, model, bf16 = bench["xl2.json"], bench["b2.json"], bench["xl2model.json"], bench["xl2bf16.json"]
    assert differs(xl2, b2) == {"micro_batch"} and b2["micro_batch"] == b2["batch_sizes"][0]  # one micro-batch
    assert (xl2["compile_scope"], model["compile_scope"]) == ("blocks", "model") and differs(xl2, model) == {"compile_scope"}
    assert xl2["profile"] and model["profile"]  # kernel time by category in both scopes: where the whole graph gains
    assert bf16["fp32_after_route"] == "off" and differs(xl2, bf16) == {"fp32_after_route", "compile_scope"}
    assert differs(xl2, bench["xl2flash4.json"]) == {"attention"} and bench["xl2flash4.json"]["attention"] == "flash4"
    fp32math = bench["xl2fp32math.json"]
    assert differs(xl2, fp32math) == {"attention_fp32"} and fp32math["attention_fp32"] == "math"
    static = bench["xl2static.json"]
    assert differs(xl2, static) == {"compile_dynamic"} and static["compile_dynamic"] == "false"
    if importlib.util.find_spec("flash_attn") is None:  # as in CI: the row says why it did not run
        proc = subprocess.run(["bash", "scripts/gpu_check.sh", "--dry-run", "xl2flash4", str(tmp_path / "p")],
                              cwd=REPO, env=dict(os.environ, PYTHON=sys.executable), capture_output=True, text=True,
                              timeout=60)
        assert proc.returncode == 0 and "xl2flash4: skipped, the flash-attn-4 package is not installed" in proc.stdout


def test_evaluation_rows_time_fid_stage_by_stage_and_the_suite(tmp_path):
    proc, out = dry_run(tmp_path, "fid", "suite", BENCH_VAE=save_tiny_vae(tmp_path / "vae", 64))
    logs = check_rows(proc, out, ["fid", "suite"])
    fid, = json.loads((out / "fid.json").read_text())["fid"]
    assert fid["stages_done"] == ["sampling", "decoding", "features", "statistics", "distance"]
    assert fid["compiled"] and fid["padded_samples"] == 1 and fid["frames"] == 1
    suite, = json.loads((out / "suite.json").read_text())["suite"]
    assert suite["stages_done"] == ["writing", "evaluator"] and suite["peak_host_mb"] > 0
    assert "  evaluator: FID:" in logs


def test_cuda_tests_are_collected_and_training_logs_its_metrics(tmp_path):
    proc, out = dry_run(tmp_path, "cuda", "train", "cudnn")
    logs = check_rows(proc, out, ["cuda", "train", "cudnn"])
    assert "test_cuda.py" in logs and "cannot run: no CUDA GPU" in logs  # cudnn: the fault check, on a CPU
    records = [json.loads(line) for line in (out / "train_metrics.jsonl").read_text().splitlines()]
    assert any("loss" in r for r in records) and any("fid" in r for r in records)


def test_the_256_token_study_trains_dit_and_tread_at_patch_1_and_archives_them(tmp_path):
    import tarfile

    import yaml

    proc, out = dry_run(tmp_path, "study256")
    check_rows(proc, out, ["study256"])
    with tarfile.open(out / "study256.tar.gz") as tar:
        tar.extractall(tmp_path / "archive")
    runs = sorted(p.name for p in (tmp_path / "archive" / "runs").iterdir())
    assert runs == ["global_seed=0,model=dit", "global_seed=0,model=tread"]
    for run in runs:
        folder = tmp_path / "archive" / "runs" / run
        config = yaml.safe_load((folder / "config.yaml").read_text())
        assert config["model"]["params"]["patch_size"] == 1 and config["dataset"]["input_size"] == 16  # 256 tokens
        assert config["results_dir"] == "results/study256"
        assert any("fid" in json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines())
        assert json.loads((folder / "status.json").read_text())["status"] == "completed"


@pytest.mark.parametrize("exit_status, passed", [(0, True), (1, True), (2, False), (3, False)])
def test_a_cudnn_fault_is_a_result_and_a_crash_a_failed_row(tmp_path, exit_status, passed):
    """On a GPU lab.cudnn_attention_fault exits 1 when a case faulted (the record says which): the row passed; 2
    (it cannot run) or anything else fails it. A stand-in interpreter gives the exit status."""
    fake = tmp_path / "fake-python"
    fake.write_text(f"#!/usr/bin/env bash\n[ \"$1\" = -m ] && [ \"$2\" = lab.cudnn_attention_fault ] && exit {exit_status}\n"
                    "exit 0\n")
    fake.chmod(0o755)
    proc = subprocess.run(["bash", "scripts/gpu_check.sh", "cudnn", "--budget", "200", str(tmp_path / "o")], cwd=REPO,
                          env=dict(os.environ, PYTHON=str(fake), WHEELS=str(tmp_path)), capture_output=True, text=True,
                          timeout=60)
    summary = proc.stdout.strip().splitlines()[-1]
    assert ("1 passed (cudnn)" if passed else "1 failed (cudnn)") in summary, proc.stdout


def test_a_row_that_no_longer_fits_the_budget_is_skipped_and_the_next_runs(tmp_path):
    proc, out = dry_run(tmp_path, "suite", "train", "--budget", "150")  # suite: 300 s estimated, train: 70
    assert proc.returncode == 0, proc.stderr
    ran = rows_run(out)
    assert ran["suite"].startswith("skipped, estimated 300 s and ") and ran["train"].startswith("rc 0 ")
    assert "1 passed (train), 0 failed (), 1 skipped (suite)" in proc.stdout.strip().splitlines()[-1]


@pytest.mark.parametrize("args", [["row5"], ["--dry-run", "xl2", "a", "b"], [], ["all"], ["all", "--budget", "x"]])
def test_bad_arguments_are_refused(args):
    proc = subprocess.run(["bash", "scripts/gpu_check.sh", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=60, env=dict(os.environ, OUT=""))
    assert proc.returncode == 2 and "usage: bash scripts/gpu_check.sh" in proc.stderr
