"""Multi-process resume, the path of every pre-empted multi-GPU job, on the CPU (2 gloo processes, CUDA hidden,
a free port): a 2-process run killed with kill -9 and restarted equals an uninterrupted one bit for bit, with
in-training evaluation on; resuming under another process count re-seeds the random streams; the 2-process
in-training FID is the 1-process FID of the same EMA weights and seeds."""

from pathlib import Path

import pytest
import torch
from accelerate import Accelerator
from omegaconf import OmegaConf

from train_runs import assert_bit_identical, final_state, records, run_args, run_train
from training import checkpoint as ckpt
from training.in_training_eval import TrainingEvaluator
from tread_utils.distributed import set_cpu_threads


def test_two_processes_killed_mid_step_resume_bit_identical(tmp_path, straight):
    """Every rank SIGKILLs itself inside step 6 (tests/train_killed_at.py: after its weight and EMA update),
    after the checkpoint and evaluation of step 4; the same launch again ends where the uninterrupted run
    ends: model, EMA, optimizer, both ranks' torch, numpy and Python streams, logged losses and FIDs."""
    killed = run_train("mid_step", 6, *run_args(tmp_path, "killed"), script="tests/train_killed_at.py",
                       processes=2, expect=None)
    assert killed.returncode != 0 and "SIGKILL" in killed.stderr, killed.stderr[-3000:]  # torchrun names it
    assert final_state(tmp_path / "killed")["step"] == 4 and 4 in records(tmp_path / "killed", "fid")
    resumed = run_train(*run_args(tmp_path, "killed"), processes=2)
    assert "at step 4" in resumed.stdout and "re-seeded" not in resumed.stdout, resumed.stdout
    done = final_state(tmp_path / "killed")
    assert done["world_size"] == 2 and len(done["rng"]) == 2
    assert not torch.equal(done["rng"][0]["torch"], done["rng"][1]["torch"]), "each rank has its own stream"
    assert_bit_identical(final_state(straight), done)
    assert records(tmp_path / "killed", "loss") == records(straight, "loss"), "redone steps are logged once"
    fids = records(tmp_path / "killed", "fid")
    assert sorted(fids) == [4, 8] and fids == records(straight, "fid")


def test_another_process_count_reseeds_the_random_streams(tmp_path, straight):
    """The 2-process checkpoint of step 4 resumed by one process: the note says the streams are re-seeded, and
    they are: a copy of that checkpoint whose saved streams are swapped between the ranks resumes to the same
    weights, streams and losses."""
    state = ckpt.load_checkpoint(ckpt.checkpoint_path(straight / "checkpoints", 4))
    assert len(state["rng"]) == 2
    for name, rng in (("one", state["rng"]), ("swapped", state["rng"][::-1])):
        ckpt.save_checkpoint({**state, "rng": rng}, tmp_path / name / "checkpoints", 4)
        resumed = run_train(*run_args(tmp_path, name), processes=1)
        assert "written by 2 processes, now 1: RNG streams are re-seeded" in resumed.stdout, resumed.stdout
        assert "at step 4" in resumed.stdout
    one, swapped = final_state(tmp_path / "one"), final_state(tmp_path / "swapped")
    assert one["step"] == 8 and one["world_size"] == 1 and len(one["rng"]) == 1
    assert_bit_identical(one, swapped)
    assert records(tmp_path / "one", "loss") == records(tmp_path / "swapped", "loss")
    assert records(tmp_path / "one", "world_size") == {6: 1, 8: 1}


def test_two_process_fid_is_the_one_process_fid(tmp_path, straight):
    """The FID (and the digits metrics) the 2-process run logged at step 8, recomputed by one process from
    the EMA of its step-8 checkpoint with the run's evaluation settings: the same numbers, exactly. The one
    process uses the CPU threads each rank had (train.cpu_threads=auto shares the cores between the 2): the
    reference features' last bits depend on the thread count, not on the process count."""
    path = ckpt.checkpoint_path(straight / "checkpoints", 8)
    state = ckpt.load_checkpoint(path)
    net, cfg = ckpt.net_from_state(state, path)
    threads = torch.get_num_threads()
    set_cpu_threads(cfg["train"]["cpu_threads"], 2)
    try:
        scores = TrainingEvaluator(OmegaConf.create(cfg), Accelerator(cpu=True), tmp_path)(net, 8)
    finally:
        set_cpu_threads(threads, 1)
    logged = {k: records(straight, k)[8] for k in ("fid", "class_acc", "nn_ratio")}
    assert {k: scores[k] for k in logged} == logged
