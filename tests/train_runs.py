"""Tests only: start train.py (or a tests/train_*.py wrapper of it) in one or several processes, failing with
the run's stderr attached so a failing run says why; read its metrics and checkpoints; compare two runs.

Several processes go through `accelerate launch --multi_gpu` on a free port with CUDA hidden: gloo on the
CPU, whatever the machine has, and no clash with another launch on accelerate's default port 29500.
"""
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import torch

from conftest import REPO, subprocess_env, tiny_overrides
from training.checkpoint import list_checkpoints, load_checkpoint


# Evaluation every 4 steps (with the checkpoint), on the digits preset's scorer and metrics at toy size.
EVAL_ON = ["train.eval.eval_interval=4", "train.eval.fid_num_samples=128", "train.eval.batch_size=64",
           "train.eval.sampler.num_steps=2"]


def run_args(results_dir, run_name, steps=8):
    """The tiny `tread` run of the multi-process tests: a checkpoint every 4 steps, evaluated there."""
    return [f"results_dir={results_dir}", f"run_name={run_name}", *tiny_overrides("tread"), *EVAL_ON,
            f"train.max_steps={steps}", "train.ckpt_every=4", "train.logging.log_interval=2",
            "train.general.num_workers=0"]


def free_port() -> int:
    """A TCP port nothing listens on now (the OS picks it for a bind to port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train_command(*args, script="train.py", processes=1) -> list:
    script = str(REPO / script)
    if processes == 1:
        return [sys.executable, script, *map(str, args)]
    accelerate = shutil.which("accelerate", path=os.path.dirname(sys.executable)) or shutil.which("accelerate")
    # accelerate's `--cpu` starts one process unless MPI is installed; `--multi_gpu` starts them through
    # torchrun, and with no GPU visible train.py joins them on the CPU with gloo.
    return [accelerate, "launch", "--multi_gpu", "--num_processes", str(processes), "--num_machines", "1",
            "--main_process_port", str(free_port()), "--mixed_precision", "no", "--dynamo_backend", "no",
            script, *map(str, args)]


def train_env(processes=1, **extra) -> dict:
    env = {**subprocess_env(), **extra}
    if processes > 1:
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def describe(proc) -> str:
    return (f"{' '.join(map(str, proc.args))}\nexit code {proc.returncode}\n--- stdout (end) ---\n"
            f"{(proc.stdout or '')[-3000:]}\n--- stderr (end) ---\n{(proc.stderr or '')[-5000:]}")


def run_train(*args, script="train.py", processes=1, expect=0, timeout=600, env=None):
    """Run to the end; assert the exit code is `expect` (None: any), showing stdout and stderr if not."""
    proc = subprocess.run(train_command(*args, script=script, processes=processes), cwd=REPO,
                          env={**train_env(processes), **(env or {})}, capture_output=True, text=True,
                          timeout=timeout)
    assert expect is None or proc.returncode == expect, describe(proc)
    return proc


def start_train(*args, script="train.py", processes=1, env=None) -> subprocess.Popen:
    """Start in the background (stdout and stderr piped); finish it with `wait_train`."""
    return subprocess.Popen(train_command(*args, script=script, processes=processes), cwd=REPO,
                            env={**train_env(processes), **(env or {})}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def wait_train(proc: subprocess.Popen, expect=0, timeout=600) -> subprocess.CompletedProcess:
    out, err = proc.communicate(timeout=timeout)
    done = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    assert expect is None or proc.returncode == expect, describe(done)
    return done


def read_metrics(run_dir) -> list:
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def records(run_dir, key) -> dict:
    """{step: value} of one logged metric; each step must be logged once."""
    found = [(r["step"], r[key]) for r in read_metrics(run_dir) if key in r]
    assert len({step for step, _ in found}) == len(found), f"{key} logged twice for a step: {found}"
    return dict(found)


def final_state(run_dir) -> dict:
    return load_checkpoint(list_checkpoints(Path(run_dir) / "checkpoints")[-1][1])


def assert_same_rng(a: dict, b: dict, what: str):
    """Two captured random states (training.checkpoint.capture_rng_state) are equal: torch, CUDA, numpy, Python."""
    assert torch.equal(a["torch"], b["torch"]), f"{what}: torch"
    assert (a["cuda"] is None) == (b["cuda"] is None) and (a["cuda"] is None or torch.equal(a["cuda"], b["cuda"])), \
        f"{what}: cuda"
    assert torch.equal(a["numpy"]["keys"], b["numpy"]["keys"]) and \
        {k: v for k, v in a["numpy"].items() if k != "keys"} == {k: v for k, v in b["numpy"].items() if k != "keys"}, \
        f"{what}: numpy"
    assert a["python"] == b["python"], f"{what}: python"


def assert_bit_identical(a: dict, b: dict):
    """Two checkpoints hold the same step, model, EMA, optimizer state and every rank's random streams."""
    assert a["step"] == b["step"] and a.get("world_size") == b.get("world_size")
    for key in ("model", "ema"):
        assert a[key].keys() == b[key].keys(), key
        for name in a[key]:
            assert torch.equal(a[key][name], b[key][name]), f"{key}.{name}"
    assert a["optimizer"]["state"].keys() == b["optimizer"]["state"].keys()
    for pa, pb in zip(a["optimizer"]["state"].values(), b["optimizer"]["state"].values()):
        for k in pa:
            assert torch.equal(pa[k], pb[k]), f"optimizer {k}"
    assert len(a["rng"]) == len(b["rng"]), "one random state per rank"
    for rank, (ra, rb) in enumerate(zip(a["rng"], b["rng"])):
        assert_same_rng(ra, rb, f"rank {rank}'s random streams")
