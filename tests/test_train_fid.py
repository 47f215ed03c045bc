"""FID during training on the embedded digits: logged at every eval step, with a sample grid, and falling;
the evaluator never moves the training random streams; a run logging to a file writes plain lines."""
import json
import random
import subprocess
import sys

import numpy as np
import torch
from accelerate import Accelerator
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from PIL import Image

from conftest import REPO, command, run_script, subprocess_env, tiny_overrides
from dit import get_model
from training.checkpoint import capture_rng_state
from training.checkpoint import build_denoiser
from training.in_training_eval import TrainingEvaluator


def test_embedded_training_logs_falling_fid(tmp_path):
    run_script("train.py", f"results_dir={tmp_path}", "run_name=fid", "model=tread", "+model.params.depth=4",
               "+model.params.hidden_size=64", "model.params.routes.0.start_layer_idx=1",
               "model.params.routes.0.end_layer_idx=2", "train.max_steps=300", "train.logging.log_interval=50",
               "train.ckpt_every=300", "train.eval.eval_interval=100", "train.eval.fid_num_samples=160",
               "train.eval.sampler.num_steps=8", "train.optimizer.lr=5e-4", "train.ema.decay=0.99",
               check=True, timeout=600)
    records = [json.loads(line) for line in (tmp_path / "fid" / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if "fid" in r]
    assert [r["step"] for r in evals] == [100, 200, 300]
    assert all(k in evals[0] for k in ("sfid", "is", "precision", "recall", "nn_ratio", "eval_seconds"))
    fids = [r["fid"] for r in evals]
    assert fids[-1] < 0.9 * fids[0], fids  # measured here: 142.8 -> 117.3
    assert (tmp_path / "fid" / "samples" / "step_00000300.png").exists()


def test_evaluator_leaves_the_training_random_streams_untouched(tmp_path):
    """Building the evaluator (digits classifier, references) and evaluating (sampling, features, nn_ratio)
    move none of torch's CPU/CUDA, numpy's or Python's global streams, on whatever device trains here."""
    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base="1.3"):
        cfg = compose("config", overrides=[*tiny_overrides("tread"), "train.eval.eval_interval=20",
                                           "train.eval.fid_num_samples=16", "train.eval.sampler.num_steps=2"])
    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    model = get_model(cfg.model.backbone_type, OmegaConf.to_container(cfg.model.params, resolve=True))
    net = build_denoiser(cfg.diffuser, model.to(accelerator.device))
    torch.manual_seed(1)  # also seeds every CUDA device
    np.random.seed(1)
    random.seed(1)
    before = capture_rng_state()
    evaluator = TrainingEvaluator(cfg, accelerator, tmp_path)
    assert np.isfinite(evaluator(net, 20)["fid"])
    after = capture_rng_state()
    assert torch.equal(before["torch"], after["torch"])
    if torch.cuda.is_available():  # the current device's stream: the one a rank trains with
        assert torch.equal(before["cuda"], after["cuda"])
    else:
        assert before["cuda"] is None and after["cuda"] is None
    numpy_before, numpy_after = before["numpy"], after["numpy"]
    assert torch.equal(numpy_before.pop("keys"), numpy_after.pop("keys")) and numpy_before == numpy_after
    assert before["python"] == after["python"]


def test_run_logging_to_a_file_writes_plain_lines_metrics_and_a_summary(tmp_path):
    """stdout and stderr in a file, as on a cluster: one short line per log interval (no progress bar's
    carriage returns), the evaluations, class_acc beside fid and nn_ratio, and a closing summary line."""
    log = tmp_path / "train.log"
    args = [f"results_dir={tmp_path}", "run_name=log", *tiny_overrides("tread"), "train.max_steps=6",
            "train.logging.log_interval=2", "train.eval.eval_interval=3", "train.eval.fid_num_samples=128",
            "train.eval.sampler.num_steps=2"]
    with open(log, "w") as f:
        proc = subprocess.run([sys.executable, *command("train.py"), *args], cwd=REPO, env=subprocess_env(),
                              stdout=f, stderr=subprocess.STDOUT, timeout=300)
    text = log.read_text()
    assert proc.returncode == 0, text[-3000:]
    lines = text.splitlines()
    assert "\r" not in text and max(map(len, lines)) < 300, max(lines, key=len)
    for step in (2, 4, 6):
        assert any(line.startswith(f"step {step}/6  loss ") and "it/s  ETA " in line for line in lines), text
    assert any(line.startswith("step 3: fid ") and "class_acc" in line for line in lines), text
    grid = tmp_path / "log" / "samples" / "step_00000006.png"
    summary = [line for line in lines if line.startswith("done: step 6 in ")]
    assert len(summary) == 1 and "class_acc" in summary[0] and "nn_ratio" in summary[0], text
    assert summary[0].endswith(f"grid {grid}")
    with Image.open(grid) as image:
        assert image.width >= 512
    evals = [json.loads(line) for line in (tmp_path / "log" / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in evals if "fid" in r]
    assert [r["step"] for r in evals] == [3, 6] and all(0 <= r["class_acc"] <= 1 for r in evals)
