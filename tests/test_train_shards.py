"""train.py on latents on disk: it trains on extracted shards, and bad shards stop it with one line."""
import json
import logging
import math
import runpy
import subprocess
import sys

import numpy as np
import pytest
import torch
from hydra.core.global_hydra import GlobalHydra

from conftest import REPO, TINY_MODEL, assert_one_line_error, run_script
from data.shards import _seed
from data.vae import LOGVAR_MAX, LOGVAR_MIN
from test_shards import simple, write_tar

C, S, K = 4, 8, 10


def shard_options(tmp_path, data_dir):
    return [f"results_dir={tmp_path / 'runs'}", "run_name=shards", "model=tread", "dataset=imagenet256",
            f"dataset.train_path={data_dir}", f"dataset.input_size={S}", f"dataset.num_classes={K}", *TINY_MODEL,
            "model.params.routes.0.start_layer_idx=1", "model.params.routes.0.end_layer_idx=2",
            "train.general.batch_size=8", "train.eval.eval_interval=0", "train.max_steps=6"]


def shard_train(tmp_path, data_dir, *extra, script="train.py"):
    return run_script(script, *shard_options(tmp_path, data_dir), "train.general.num_workers=2", "train.ckpt_every=6",
                      "train.logging.log_interval=3", *extra)


def posterior_sample(pair, index, num_samples, scale):
    """What a read of `index` must give, written out: the flip chosen by the sample's generator (seed 0, its
    epoch, its position), then scale * (mean + exp(logvar / 2) * eps) with eps drawn after the flip."""
    epoch, idx = divmod(index, num_samples)
    g = torch.Generator().manual_seed(_seed(0, epoch, idx))
    flip = int(torch.randint(0, 2, (1,), generator=g).item())
    moments = pair[idx][flip].astype(np.float32)
    mean, logvar = moments[:C], np.clip(moments[C:], LOGVAR_MIN, LOGVAR_MAX)
    eps = torch.randn(mean.shape, generator=g).numpy()
    return torch.from_numpy((mean + np.exp(0.5 * logvar) * eps) * np.float32(scale))


def test_trainer_reads_extracted_style_shards(tmp_path):
    """Extracted-style shards (moments of an image and its flip) with posterior sampling, flips and a scale:
    every micro-batch the loop trains on (two loader workers) holds exactly the scaled posterior samples of
    the indices its sampler chose, and the losses are finite."""
    # the extractor's layout: float16 [2 flips, 2C moments, S, S]
    first, second = simple(12, (2, 2 * C, S, S)), simple(12, (2, 2 * C, S, S), start=12, seed=1)
    write_tar(tmp_path / "data" / "latents-000000.tar", first)
    write_tar(tmp_path / "data" / "latents-000001.tar", second)
    proc = shard_train(tmp_path, tmp_path / "data", "dataset.posterior_sampling=true", "dataset.random_flip=true",
                       "dataset.scale_factor=0.25", script="tests/train_traced.py")
    assert proc.returncode == 0, proc.stderr[-2000:]
    run_dir = tmp_path / "runs" / "shards"
    assert (run_dir / "checkpoints" / "ckpt_00000006.pt").exists()
    trace = torch.load(run_dir / "trace_rank0.pt")
    pairs, labels = [arr for _, arr, _ in first + second], [label for _, _, label in first + second]
    assert len(trace["inputs"]) == 6
    for indices, (x, y) in zip(trace["batches"], trace["inputs"]):
        expected = torch.stack([posterior_sample(pairs, i, 24, 0.25) for i in indices])
        torch.testing.assert_close(x, expected, rtol=1e-6, atol=1e-7)
        assert y.tolist() == [labels[i % 24] for i in indices]
    logged = [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(logged) == 2 and all(math.isfinite(v) for v in logged + trace["losses"])


def refused_in_process(monkeypatch, capsys, *options):
    """`python train.py OPTIONS` in this process (the refusal needs no training): the finished launch, for
    `assert_one_line_error`."""
    monkeypatch.setattr(sys, "argv", [str(REPO / "train.py"), *options])
    monkeypatch.setenv("HYDRA_FULL_ERROR", "1")  # train.py's __main__ sets it; the test's environment keeps its own
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        with pytest.raises(SystemExit) as stopped:
            runpy.run_path(sys.argv[0], run_name="__main__")
    finally:  # what Hydra set up for the job goes with it, as with a process that ends
        GlobalHydra.instance().clear()
        root.handlers[:] = handlers
        root.setLevel(level)
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(sys.argv, stopped.value.code, out, err)


@pytest.mark.parametrize("case", ["shape", "corrupt", "empty", "manifest"])
def test_bad_shards_are_refused_before_the_run_folder(tmp_path, monkeypatch, capsys, case):
    """Everything the shards' headers, layout and manifest.json tell is checked at the entry point: one line, a
    non-zero exit, and no run folder (results_dir itself is not created)."""
    data = tmp_path / "data"
    write_tar(data / "good.tar", simple(16, (C, S, S)))
    if case == "shape":
        write_tar(data / "bad.tar", simple(4, (C, S + 2, S)))
        needle = "bad.tar"
    elif case == "corrupt":
        (data / "bad.tar").write_bytes(b"\x00garbage" * 100)
        needle = "bad.tar"
    elif case == "empty":
        (data / "good.tar").unlink()
        needle = "no latent shards"
    else:  # a hand-edited manifest with a trailing comma
        (data / "manifest.json").write_text('{"scale_factor": 0.18215, "scaled": false,}')
        needle = "manifest.json cannot be read"
    proc = refused_in_process(monkeypatch, capsys, *shard_options(tmp_path, data))
    assert_one_line_error(proc, needle)
    assert not (tmp_path / "runs").exists()


def test_fewer_samples_than_one_batch_is_refused_before_the_run_folder(tmp_path, monkeypatch, capsys):
    """The embedded digits hold 1,500 training images: a global batch of 1,600 cannot be drawn."""
    proc = refused_in_process(monkeypatch, capsys, f"results_dir={tmp_path / 'runs'}", "run_name=big-batch",
                              "model=dit", *TINY_MODEL, "train.general.batch_size=1600",
                              "train.eval.eval_interval=0")
    assert_one_line_error(proc, "holds 1500 samples, fewer than one global batch of 1600")
    assert not (tmp_path / "runs").exists()


def test_a_bad_label_stops_the_run_in_one_line(tmp_path):
    """A label is read with its sample, in training: the run stops there, in one line."""
    data = tmp_path / "data"
    write_tar(data / "good.tar", simple(16, (C, S, S)))
    write_tar(data / "bad.tar", [("000099", np.zeros((C, S, S), np.float16), 42)])
    assert_one_line_error(shard_train(tmp_path, data), "label")
