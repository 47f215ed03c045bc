"""One precision policy (tread_utils/precision.py), applied the same way by training, sampling and bench."""
import sys

import pytest
import torch
from hydra import compose, initialize_config_dir

import sample
from conftest import REPO, TINY_MODEL, TINY_ROUTE
from tools import bench
from training.loop import save_snapshot, setup
from tread_utils.precision import precision_policy, set_precision_policy


@pytest.fixture(autouse=True)
def restore_policy():
    yield
    set_precision_policy(True)


def train_setup(tmp_path, tf32: bool):
    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base="1.3"):
        cfg = compose("config", overrides=[f"results_dir={tmp_path}", "run_name=p", *TINY_MODEL, *TINY_ROUTE,
                                           "train.general.batch_size=8", "train.eval.eval_interval=0",
                                           "train.logging.tensorboard=false", f"train.tf32={str(tf32).lower()}"])
    return setup(cfg)


@pytest.mark.parametrize("tf32", [True, False])
def test_train_sample_and_bench_apply_the_same_policy(tmp_path, monkeypatch, tf32):
    expected = {"tf32_matmul": tf32, "tf32_cudnn": tf32}
    set_precision_policy(not tf32)
    run = train_setup(tmp_path, tf32)
    assert precision_policy() == expected
    save_snapshot(run, 0)
    run.logger.close()

    set_precision_policy(not tf32)
    sample.main([f"ckpt={tmp_path / 'p'}", "num_samples=2", f"out={tmp_path / 's.npz'}", "sampler.num_steps=2",
                 "progress=false", f"tf32={str(tf32).lower()}"])
    assert precision_policy() == expected

    set_precision_policy(not tf32)
    monkeypatch.setattr(sys, "argv", ["bench", "--backbones", "DiT-T/8", "--batch-sizes", "2", "--steps", "1",
                                      "--warmup", "1", "--sections", "training", "--tf32", "on" if tf32 else "off"])
    bench.main()
    assert precision_policy() == expected
