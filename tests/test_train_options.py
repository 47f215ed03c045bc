"""Training options end to end: grad_clip and bf16 in one in-process step; train.compile=true with bf16
through train.py, stopped by SIGINT and resumed."""
import json
import signal
import subprocess
import sys
import time

import torch
from hydra import compose, initialize_config_dir

from conftest import REPO, TINY_MODEL, TINY_ROUTE, subprocess_env, tiny_overrides
from training import loop
from training.checkpoint import list_checkpoints, load_checkpoint


def test_grad_clip_bounds_the_gradient_the_optimizer_steps_with(tmp_path, monkeypatch):
    """One bf16 step with grad_clip=1e-3: the blocks' matmuls run in bfloat16, and AdamW steps with exactly the
    reference clip of the step's gradient, g * min(1, c / (||g|| + 1e-6)), whose norm is c."""
    clip, pre, post, dtypes = 1e-3, [], [], []
    accumulate, build_adamw = loop.accumulate_gradients, loop.build_adamw

    def accumulate_and_record(run, *args):
        run.model.blocks[0].attn.qkv.register_forward_hook(lambda m, a, out: dtypes.append(out.dtype))
        loss = accumulate(run, *args)
        pre.append([p.grad.clone() for p in run.model.parameters()])
        return loss

    def recording_adamw(params, **kwargs):
        params = list(params)
        optimizer = build_adamw(params, **kwargs)
        step = optimizer.step
        optimizer.step = lambda *a, **k: (post.append([p.grad.clone() for p in params]), step(*a, **k))[1]
        return optimizer

    monkeypatch.setattr(loop, "accumulate_gradients", accumulate_and_record)
    monkeypatch.setattr(loop, "build_adamw", recording_adamw)
    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base="1.3"):
        cfg = compose("config", overrides=[f"results_dir={tmp_path}", "run_name=clip", *TINY_MODEL, *TINY_ROUTE,
                                           "train.general.batch_size=8", "train.general.num_workers=0",
                                           "train.eval.eval_interval=0", "train.logging.tensorboard=false",
                                           "train.mixed_precision=bf16", f"train.optimizer.grad_clip={clip}",
                                           "train.max_steps=1"])
    loop.training_loop(cfg)
    assert dtypes == [torch.bfloat16]
    (grads,), (stepped,) = pre, post
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
    assert norm > 100 * clip, "the clip must bind"
    for g, s in zip(grads, stepped):
        torch.testing.assert_close(s, g * min(1.0, clip / (norm.item() + 1e-6)), rtol=1e-5, atol=1e-12)
    stepped_norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(s) for s in stepped]))
    assert abs(stepped_norm.item() - clip) < 1e-4 * clip


def compiled_run(tmp_path):
    """train.py with train.compile=true, bf16 and grad_clip. Dynamo's backend is overridden to `eager`
    (TORCH_COMPILE_OVERRIDE_BACKENDS): inductor's C++ build of this model takes ~5 minutes on a 2-core CPU;
    the inductor path is covered on a GPU by tests/test_cuda.py. TORCH_LOGS=dynamo shows the tracing."""
    args = [sys.executable, str(REPO / "train.py"), f"results_dir={tmp_path}", "run_name=sig",
            *tiny_overrides("tread"), "train.compile=true", "train.mixed_precision=bf16",
            "train.optimizer.grad_clip=1.0", "train.max_steps=12", "train.ckpt_every=2",
            "train.logging.log_interval=2", "train.general.num_workers=0"]
    env = {**subprocess_env(), "TORCH_COMPILE_OVERRIDE_BACKENDS": ">=0:eager", "TORCH_LOGS": "dynamo"}
    return subprocess.Popen(args, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_compiled_bf16_run_stops_cleanly_on_sigint_and_resumes(tmp_path):
    """SIGINT after the first checkpoint: exit code 130 (no KeyboardInterrupt traceback), a checkpoint of the
    step it stopped at (plain parameter names, no grad scaler under bf16), status `stopped`, the lock released;
    the same command resumes from that step, compiled again, and finishes."""
    run_dir = tmp_path / "sig"
    proc = compiled_run(tmp_path)
    deadline = time.time() + 240
    while not (run_dir / "checkpoints" / "ckpt_00000002.pt").exists() and time.time() < deadline \
            and proc.poll() is None:
        time.sleep(0.02)
    assert proc.poll() is None, "the run ended before it could be interrupted"
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGINT, err[-3000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    assert "torchdynamo start tracing forward" in err and "dit.py" in err, "the model ran compiled"
    (step, path), = list_checkpoints(run_dir / "checkpoints")[-1:]
    assert 2 <= step < 12 and f"stopped by signal {int(signal.SIGINT)} at step {step}" in out, out
    state = load_checkpoint(path)
    assert state["step"] == step and state["scaler"] is None
    assert not any(k.startswith("_orig_mod.") for k in state["model"]), "saved from the uncompiled module"
    assert json.loads((run_dir / "status.json").read_text())["status"] == "stopped"
    assert not (run_dir / "run.lock").exists()

    proc = compiled_run(tmp_path)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    assert f"resuming from {path} at step {step}" in out and "torchdynamo start tracing forward" in err
    assert list_checkpoints(run_dir / "checkpoints")[-1][0] == 12
    assert json.loads((run_dir / "status.json").read_text())["status"] == "completed"
