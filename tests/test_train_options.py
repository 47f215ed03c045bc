"""Training options end to end: grad_clip and bf16 in one in-process step; train.compile=true with bf16
through train.py, stopped by SIGINT and resumed."""
import json
import signal
import time

import torch
from hydra import compose, initialize_config_dir

from conftest import REPO, TINY_MODEL, TINY_ROUTE, tiny_overrides
from train_runs import run_train, start_train, wait_train
from training import loop
from training.checkpoint import list_checkpoints, load_checkpoint
from training.config_check import check_train_config


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
    loop.training_loop(check_train_config(cfg))
    assert dtypes == [torch.bfloat16]
    (grads,), (stepped,) = pre, post
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
    assert norm > 100 * clip, "the clip must bind"
    for g, s in zip(grads, stepped):
        torch.testing.assert_close(s, g * min(1.0, clip / (norm.item() + 1e-6)), rtol=1e-5, atol=1e-12)
    stepped_norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(s) for s in stepped]))
    assert abs(stepped_norm.item() - clip) < 1e-4 * clip


COMPILED = {"TORCH_COMPILE_OVERRIDE_BACKENDS": ">=0:eager", "TORCH_LOGS": "dynamo"}


def compiled_run_args(tmp_path, steps):
    """train.py with train.compile=true, bf16 and grad_clip. Dynamo's backend is overridden to `eager`
    (TORCH_COMPILE_OVERRIDE_BACKENDS, in COMPILED): inductor's C++ build of this model takes ~5 minutes on a
    2-core CPU; the inductor path is covered on a GPU by tests/test_cuda.py. TORCH_LOGS=dynamo shows the
    tracing."""
    return [f"results_dir={tmp_path}", "run_name=sig", *tiny_overrides("tread"), "train.compile=true",
            "train.mixed_precision=bf16", "train.optimizer.grad_clip=1.0", f"train.max_steps={steps}",
            "train.ckpt_every=2", "train.logging.log_interval=2", "train.general.num_workers=0"]


def test_compiled_bf16_run_stops_cleanly_on_sigint_and_resumes(tmp_path):
    """SIGINT after the first checkpoint: exit code 130 (no KeyboardInterrupt traceback), a checkpoint of the
    step it stopped at (plain parameter names, no grad scaler under bf16), status `stopped`, the lock released;
    the same command resumes from that step, compiled again, and finishes. The run is 100,000 steps long, so
    however slowly the test polls it cannot end before the signal; the resumed run stops 4 steps later."""
    run_dir = tmp_path / "sig"
    proc = start_train(*compiled_run_args(tmp_path, 100_000), env=COMPILED)
    deadline = time.time() + 240
    while not (run_dir / "checkpoints" / "ckpt_00000002.pt").exists() and time.time() < deadline \
            and proc.poll() is None:
        time.sleep(0.05)
    assert proc.poll() is None, wait_train(proc, expect=None).stderr[-3000:]
    proc.send_signal(signal.SIGINT)
    stopped = wait_train(proc, expect=128 + signal.SIGINT, timeout=120)
    out, err = stopped.stdout, stopped.stderr
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    assert "torchdynamo start tracing forward" in err and "dit.py" in err, "the model ran compiled"
    (step, path), = list_checkpoints(run_dir / "checkpoints")[-1:]
    assert step >= 2 and f"stopped by signal {int(signal.SIGINT)} at step {step}" in out, out
    state = load_checkpoint(path)
    assert state["step"] == step and state["scaler"] is None
    assert not any(k.startswith("_orig_mod.") for k in state["model"]), "saved from the uncompiled module"
    assert json.loads((run_dir / "status.json").read_text())["status"] == "stopped"
    assert not (run_dir / "run.lock").exists()

    resumed = run_train(*compiled_run_args(tmp_path, step + 4), env=COMPILED, timeout=300)
    assert f"resuming from {path} at step {step}" in resumed.stdout
    assert "torchdynamo start tracing forward" in resumed.stderr
    assert list_checkpoints(run_dir / "checkpoints")[-1][0] == step + 4
    assert json.loads((run_dir / "status.json").read_text())["status"] == "completed"
    # each log record of a compiled run says how many graphs dynamo built and whether it recompiled after step 1
    logged = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    logged = [r for r in logged if "loss" in r and r["step"] > step]
    assert logged and all(r["compiled_graphs"] >= 1 and r["recompiles_after_first_step"] == 0 for r in logged)
