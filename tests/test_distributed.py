"""Processes: more processes than GPUs refused, the process-group timeout, CPU threads on every device, and
the feature pass spread over the ranks (one process, and two gloo processes forked from this one)."""
import datetime
import os
import subprocess
import sys
import types

import numpy as np
import pytest
import torch
import torch.distributed as dist

from edm import EDMPrecond
from evaluations.distributed_features import compute_features_distributed, rank_share
from evaluations.features import compute_features
from evaluations.metrics import RunningStatistics, feature_statistics
from generation import generate
from conftest import REPO, assert_one_line_error, run_forked_ranks, subprocess_env, tiny_overrides
from tread_utils.distributed import check_cuda_processes, gather_rows, set_cpu_threads, start_processes
from tread_utils.errors import UserError


def fake_gpus(monkeypatch, count):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)


def test_more_processes_per_node_than_gpus_is_refused(monkeypatch):
    fake_gpus(monkeypatch, 1)
    with pytest.raises(UserError, match=r"2 processes per node but 1 CUDA device\(s\) visible.*--num_processes.*"
                                        r"CUDA_VISIBLE_DEVICES"):
        check_cuda_processes(2)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")  # what torchrun tells each process
    with pytest.raises(UserError, match="3 processes per node"):
        check_cuda_processes()
    check_cuda_processes(1)
    fake_gpus(monkeypatch, 4)
    check_cuda_processes()
    fake_gpus(monkeypatch, 0)  # no GPU (or CUDA hidden): the processes share the CPU
    check_cuda_processes(8)


# As `python -c`: the entry point under a torch that reports one GPU, as rank 0 of two processes on this node.
ONE_GPU = ("import runpy, sys, torch; torch.cuda.is_available = lambda: True; torch.cuda.device_count = lambda: 1; "
           "sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')")


@pytest.mark.parametrize("script, args", [("train.py", ["results_dir={tmp}", *tiny_overrides("dit")]),
                                          ("sample.py", ["ckpt=none.pt", "num_samples=2", "out={tmp}/samples.npz"])])
def test_entry_points_refuse_two_processes_on_one_gpu(tmp_path, script, args):
    env = {**subprocess_env(), "LOCAL_WORLD_SIZE": "2", "WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"}
    proc = subprocess.run([sys.executable, "-c", ONE_GPU, str(REPO / script),
                           *(a.format(tmp=tmp_path) for a in args)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert_one_line_error(proc, "2 processes per node but 1 CUDA device(s) visible", "--num_processes")
    assert not any(tmp_path.iterdir()), "refused before anything is written"


def test_every_process_group_gets_the_configured_timeout():
    accelerator = start_processes(7, cpu=True)
    assert accelerator.init_handler.timeout == datetime.timedelta(minutes=7)
    for bad in (0, -1, "soon", None):
        with pytest.raises(UserError, match="timeout"):
            start_processes(bad, cpu=True)


def test_cpu_threads_auto_shares_the_cores():
    from threadpoolctl import threadpool_info

    before = torch.get_num_threads()
    try:
        assert set_cpu_threads("auto", 2) == max(1, (os.cpu_count() or 1) // 2) == torch.get_num_threads()
        assert set_cpu_threads(1, 4) == 1 == torch.get_num_threads()
        assert all(pool["num_threads"] == 1 for pool in threadpool_info())  # numpy/scipy's BLAS too
    finally:
        set_cpu_threads(before, 1)
    for bad in ("many", 0, "2.5"):
        with pytest.raises(UserError, match="cpu_threads"):
            set_cpu_threads(bad, 1)


def test_running_statistics_merge_is_the_statistics_of_all_rows():
    rows = np.random.default_rng(0).normal(3.0, 2.0, size=(50, 6))
    parts = [RunningStatistics(), RunningStatistics(), RunningStatistics()]
    for part, chunk in zip(parts, (rows[:7], rows[7:30], rows[30:])):
        part.update(chunk)
    merged = RunningStatistics().merge(parts[0]).merge(RunningStatistics()).merge(parts[1]).merge(parts[2])
    for got, want in zip(merged.result(), feature_statistics(rows)):
        np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)


class Extractor(torch.nn.Module):
    """uint8 NHWC -> pool [B, 5] and spatial [B, 4] features, deterministic."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(12, 9, generator=torch.Generator().manual_seed(0)))

    def forward(self, images):
        f = torch.tanh(images.float().reshape(len(images), -1)[:, :12] / 64 @ self.w)
        return {"pool": f[:, :5], "spatial": f[:, 5:]}


class Backbone(torch.nn.Module):
    num_classes = 3

    def forward(self, x, noise, class_labels=None, **kwargs):
        return torch.tanh(x) * noise.reshape(-1, 1, 1, 1) + class_labels.reshape(-1, 1, 1, 1) * 0.1


class Decoder:
    @staticmethod
    def decode(x):
        return ((x.clamp(-1, 1) + 1) * 127.5).to(torch.uint8).permute(0, 2, 3, 1).numpy()


def _sample(accelerator, gather):
    return generate(EDMPrecond(Backbone()), range(11), sampler_kwargs={"num_steps": 3}, decoder=Decoder(),
                    batch_size=2, accelerator=accelerator, latent_shape=(3, 2, 2), progress=False, gather=gather)


def _check(feats, images):
    want = compute_features(Extractor(), images, batch_size=3, stats_keys=("spatial",))
    np.testing.assert_allclose(feats["pool"], want["pool"], rtol=1e-5, atol=1e-6)  # other batches: other sums
    for got, ref in zip(feats["spatial_stats"], want["spatial_stats"]):
        np.testing.assert_allclose(got, ref, rtol=1e-9, atol=1e-12)


def test_one_process_gives_compute_features_in_seed_order():
    images, labels = _sample(None, gather=True)
    share = _sample(None, gather=False)
    assert np.array_equal(share.indices, np.arange(11)) and np.array_equal(share.images, images)
    order = np.random.default_rng(1).permutation(11)  # a share in any row order comes back in seed order
    _check(compute_features_distributed(Extractor(), images[order], indices=order, batch_size=3,
                                        stats_keys=("spatial",)), images)
    _check(compute_features_distributed(Extractor(), images, batch_size=3, stats_keys=("spatial",)), images)
    assert [len(rank_share(10, 3, r)) for r in range(3)] == [3, 3, 4]


def _rank(rank, store, out):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    accelerator = types.SimpleNamespace(num_processes=2, process_index=rank, device=torch.device("cpu"))
    share = _sample(accelerator, gather=False)
    images, indices = share.images, share.indices
    feats = compute_features_distributed(Extractor(), images, accelerator, indices=indices, batch_size=3,
                                         stats_keys=("spatial",))
    full = compute_features_distributed(Extractor(), _sample(None, gather=True).images, accelerator, batch_size=3,
                                        stats_keys=("spatial",))
    gathered, _ = gather_rows({"images": images}, indices, 2, rank)  # the images too, e.g. for a sample grid
    main = _sample(accelerator, gather=True)  # every row on rank 0, none on rank 1
    if rank == 0:
        assert np.array_equal(main.images, gathered["images"]) and np.array_equal(main.indices, np.arange(11))
        np.savez(out, pool=feats["pool"], mu=feats["spatial_stats"][0], sigma=feats["spatial_stats"][1],
                 full_pool=full["pool"], images=gathered["images"])
    else:
        assert feats is None and full is None and gathered is None
        assert len(main.images) == len(main.labels) == len(main.indices) == 0
    dist.destroy_process_group()


def test_two_processes_give_the_one_process_features(tmp_path):
    run_forked_ranks(_rank, tmp_path / "store", tmp_path / "out.npz")
    got = np.load(tmp_path / "out.npz")
    images = _sample(None, gather=True).images
    feats = {"pool": got["pool"], "spatial_stats": (got["mu"], got["sigma"])}
    _check(feats, images)
    np.testing.assert_allclose(got["full_pool"], feats["pool"], rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(got["images"], images)
