"""The ImageNet path offline, at toy scale, as docs/training.md gives it: a random-weight SD-VAE, extraction, a
random-network reference, training with the smoke in-training FID, sample.py, the evaluator. And the
offline refusals of the configuration check: one line, in seconds, before the run folder exists."""
import json
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import REPO, TINY_MODEL, TINY_ROUTE, assert_one_line_error, once_per_session, subprocess_env


def run(tmp_path, *args, check=True, **env):
    """A repository command, offline (HF_HUB_OFFLINE=1), with no Inception weights in reach."""
    full_env = {**subprocess_env(), "HF_HUB_OFFLINE": "1", "TORCH_HOME": str(tmp_path / "torch"),
                "HOME": str(tmp_path / "home"), "HF_HOME": str(tmp_path / "hf"), **env}
    full_env.pop("TREAD_INCEPTION_WEIGHTS", None)
    proc = subprocess.run([sys.executable, *map(str, args)], cwd=REPO, env=full_env, capture_output=True,
                          text=True, timeout=600)
    if check and proc.returncode != 0:
        raise AssertionError(f"{args} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


TOY = "/tmp/tread-toy"  # the docs' folder, here a test's own


def offline_commands(root) -> list:
    """docs/training.md's offline block (the bash block that makes /tmp/tread-toy/vae), as argument lists in
    `root`."""
    text = (REPO / "docs" / "training.md").read_text()
    block = next(b for b in re.findall(r"```bash\n(.*?)```", text, re.S) if f"{TOY}/vae" in b)
    lines = block.replace("\\\n", " ").replace(TOY, str(root)).splitlines()
    return [[a for a in shlex.split(line) if not a.startswith("HF_HUB_OFFLINE=")][1:] for line in lines if line.strip()]


@pytest.fixture(scope="session")
def latents(tmp_path_factory):
    """The offline block's first three steps: a random SD-VAE and 8 random images, their latents at 64 x 64 (8 x 8
    latents), a random-network reference."""
    def make(tmp):
        commands = offline_commands(tmp)
        assert [c[:2] for c in commands] == [["-m", "tools.make_random_sdvae"], ["-m", "data.extract_latents"],
                                             ["fid.py", "ref"], ["train.py", "dataset=imagenet256"],
                                             ["sample.py", f"ckpt={tmp}/runs/toy"],
                                             ["evaluations/evaluator.py", f"{tmp}/ref.npz"]]
        run(tmp, *commands[0])
        run(tmp, *commands[1])
        ref = run(tmp, *commands[2])
        assert "inception-random-init" in ref.stdout and "covariance is singular" in ref.stderr
        return str(tmp)

    return Path(once_per_session(tmp_path_factory, "imagenet", make))


def train_args(tmp, results, *extra):
    return ["train.py", f"results_dir={tmp / results}", "run_name=smoke", "dataset=imagenet256",
            f"dataset.train_path={tmp / 'latents'}", "dataset.input_size=8", "dataset.num_classes=1",
            "model=tread", *TINY_MODEL, *TINY_ROUTE, "train.general.batch_size=4", "train.general.num_workers=0",
            "train.max_steps=2", "train.ckpt_every=2", "train.logging.log_interval=1",
            "train.logging.tensorboard=false", "train.eval.eval_interval=2", "train.eval.batch_size=4",
            "train.eval.sampler.num_steps=2", *extra]


def test_offline_imagenet_path_end_to_end(latents):
    """docs/training.md's offline block runs as written: training, sampling and the evaluator after the fixture."""
    tmp = latents
    manifest = json.loads((tmp / "latents" / "manifest.json").read_text())
    assert manifest["vae"] == str(tmp / "vae") and manifest["latent_shape"] == [2, 8, 8, 8]
    train, sample, evaluate = offline_commands(tmp)[3:]

    trained = run(tmp, *train)
    out = trained.stdout + trained.stderr
    assert f"decoding with VAE {tmp / 'vae'}, which made the latents" in out
    assert "train.eval.smoke=true" in out and "mean nothing" in out and "covariance is singular" in out
    records = [json.loads(line) for line in (tmp / "runs" / "toy" / "metrics.jsonl").read_text().splitlines()]
    assert any(np.isfinite(r.get("fid", np.nan)) for r in records), records

    sampled = run(tmp, *sample)
    assert f"decoding with VAE {tmp / 'vae'}, which made the latents" in sampled.stdout
    assert np.load(tmp / "samples.npz")["arr_0"].shape == (4, 64, 64, 3)

    evaluated = run(tmp, *evaluate)
    assert evaluated.stdout.splitlines()[1].startswith("FID: ")
    assert "warning: FID from 4 samples" in evaluated.stderr
    unmatched = run(tmp, *[a for a in evaluate if a != "--random-init"], check=False)
    assert_one_line_error(unmatched, "inception-random-init", "--random-init")


@pytest.mark.parametrize("case", ["inception", "vae", "reference"])
def test_offline_refusals_come_before_the_run_folder(latents, case):
    """Missing weights offline, or a reference from another network: one line naming the key, in seconds."""
    tmp = latents
    smoke = ["train.eval.smoke=true", "train.eval.fid_num_samples=4"]
    extra = {"inception": ["train.eval.fid_num_samples=2048"],  # the real network: its weights are nowhere here
             "vae": ["dataset.vae=stabilityai/sd-vae-ft-mse", *smoke], "reference": smoke}[case]
    ref = tmp / ("ref.npz" if case != "reference" else "real_ref.npz")
    if case == "reference":
        np.savez(ref, mu=np.zeros(2048), sigma=np.eye(2048), feature_network=np.array("inception"))
    elif not ref.exists():
        run(tmp, "fid.py", "ref", "--images", tmp / "imgs" / "0", "--out", ref, "--random-init", "--device", "cpu",
            "--no-progress")
    start = time.time()
    proc = run(tmp, *train_args(tmp, f"runs_{case}", f"train.eval.ref_batch={ref}", *extra), check=False)
    needles = {"inception": ["train.eval.inception_weights=PATH", "train.eval.smoke=true", "HF_HUB_OFFLINE"],
               "vae": ["dataset.vae=DIR", "stabilityai/sd-vae-ft-mse", "HF_HUB_OFFLINE"],
               "reference": ["inception-random-init", "train.eval.smoke=false"]}[case]
    assert_one_line_error(proc, *needles)
    assert not (tmp / f"runs_{case}").exists()
    assert time.time() - start < 60  # the check itself, not half a minute of hub retries on top of start-up
