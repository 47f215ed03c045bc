"""Every missing-weights error names the option of the command that raised it, in that command's spelling
(`--vae DIR`, `vae=DIR`, `dataset.vae=DIR`, `--weights PATH`, `train.eval.inception_weights=PATH`), and that
spelling is one the command accepts: given a missing path with it, the command's error names that path.
Offline, with empty caches, so that nothing is downloaded and nothing cached is found."""
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import REPO, TINY_MODEL, command, once_per_session, save_tiny_vae, subprocess_env
from test_shards import simple, write_tar

S, K = 8, 10


def build(root):
    """The inputs every command reads: an empty folder, shards, images, a tiny VAE, a checkpoint."""
    (root / "empty").mkdir()
    write_tar(root / "shards" / "latents-000000.tar", simple(16, (4, S, S)))
    images = np.random.default_rng(0).integers(0, 256, (4, 16, 16, 3), dtype=np.uint8)
    np.savez(root / "images.npz", arr_0=images)
    save_tiny_vae(root / "vae", 2 * S)
    from dit import get_model  # a 4-channel "shards" checkpoint for sample.py, built directly

    params = dict(num_classes=K, in_channels=4, input_size=S, depth=2, hidden_size=32, num_heads=2,
                  enable_routing=False, routes=[])
    weights = get_model("DiT-T/2", params).state_dict()
    config = {"model": {"backbone_type": "DiT-T/2", "params": params}, "diffuser": {"sigma_data": 0.5},
              "dataset": {"kind": "shards"}, "train": {"general": {"class_drop_prob": 0.1}}}
    torch.save({"step": 1, "model": weights, "ema": weights, "config": config}, root / "ckpt_00000001.pt")


def train_args(root):
    return [f"results_dir={root / 'runs'}", "model=tread", "dataset=imagenet256",
            f"dataset.train_path={root / 'shards'}",
            f"dataset.input_size={S}", f"dataset.num_classes={K}", *TINY_MODEL,
            "model.params.routes.0.start_layer_idx=1", "model.params.routes.0.end_layer_idx=2",
            "train.general.batch_size=4", "train.general.num_workers=0", "train.max_steps=2", "train.ckpt_every=2",
            "train.eval.eval_interval=2", "train.eval.fid_num_samples=2048",
            f"train.eval.ref_batch={root / 'images.npz'}"]


def commands(root):
    """name -> (command line, the spelling its error must name, that option set to a missing path)."""
    missing = root / "no_such_dir"
    out = root / "out"
    return {
        "extract": (["data.extract_latents", root / "empty", out], "--vae DIR", ["--vae", missing]),
        "sample": (["sample.py", f"ckpt={root / 'ckpt_00000001.pt'}", "num_samples=1", "sampler.num_steps=1",
                    "progress=false", f"out={root / 's.npz'}"], "vae=DIR", [f"vae={missing}"]),
        "train_vae": (["train.py", *train_args(root)], "dataset.vae=DIR", [f"dataset.vae={missing}"]),
        "train_inception": (["train.py", *train_args(root), f"dataset.vae={root / 'vae'}"],
                            "train.eval.inception_weights=PATH", [f"train.eval.inception_weights={missing}"]),
        "fid": (["fid.py", "ref", "--images", root / "images.npz", "--out", root / "ref.npz"], "--weights PATH",
                ["--weights", missing]),
        "evaluator": (["evaluations.evaluator", root / "images.npz", root / "images.npz"], "--weights PATH",
                      ["--weights", missing]),
    }


def run_all(root) -> dict:
    """Each command run twice, all at once: without the option, then with it naming a missing path."""
    home = root / "home"
    env = {**subprocess_env(), "HF_HUB_OFFLINE": "1", "TREAD_OFFLINE": "1", "HF_HOME": str(home / "hf"),
           "TORCH_HOME": str(home / "torch"), "HOME": str(home), "CUDA_VISIBLE_DEVICES": ""}
    env.pop("TREAD_INCEPTION_WEIGHTS", None)
    procs = {}
    for name, (cmd, _, given) in commands(root).items():
        for variant, extra in (("absent", []), ("given", given)):
            extra = [*extra, f"run_name={name}-{variant}"] if cmd[0] == "train.py" else extra  # a run each
            procs[f"{name} {variant}"] = subprocess.Popen(
                [sys.executable, *command(str(cmd[0])), *map(str, cmd[1:] + extra)], cwd=REPO, env=env,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return {key: (proc.wait(timeout=300), proc.communicate()[1]) for key, proc in procs.items()}


@pytest.fixture(scope="session")
def shared(tmp_path_factory):
    def make(root):
        build(root)
        return {"root": str(root), "results": run_all(root)}

    return once_per_session(tmp_path_factory, "options", make)


@pytest.fixture(scope="session")
def setup(shared):
    return Path(shared["root"])


@pytest.fixture(scope="session")
def results(shared):
    return {tuple(key.split()): tuple(value) for key, value in shared["results"].items()}


def error_line(code, stderr):
    lines = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert code == 2 and len(lines) == 1 and "Traceback" not in stderr, stderr[-3000:]
    return lines[0]


@pytest.mark.parametrize("name", ["extract", "sample", "train_vae", "train_inception", "fid", "evaluator"])
def test_the_error_names_an_option_the_command_accepts(setup, results, name):
    _, spelling, _ = commands(setup)[name]
    absent = error_line(*results[name, "absent"])
    assert spelling in absent, absent
    others = {s for _, s, _ in commands(setup).values()} - {spelling}
    assert not any(f" {s}" in absent for s in others if s not in spelling), absent  # no other command's spelling
    given = error_line(*results[name, "given"])
    assert str(setup / "no_such_dir") in given, given  # the option reached the loader


def test_train_refuses_an_unknown_flag_in_one_line():
    """`--vae DIR`, the fix an argparse command asks for, given to train.py: one line naming the key=value form."""
    proc = subprocess.run([sys.executable, str(REPO / "train.py"), "--vae", "/tmp/vae"], cwd=REPO, env=subprocess_env(),
                          capture_output=True, text=True, timeout=120)
    line = error_line(proc.returncode, proc.stderr)
    assert "--vae" in line and "dataset.vae=DIR" in line, line
