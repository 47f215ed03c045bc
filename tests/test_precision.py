"""One precision policy (tread_utils/precision.py), applied the same way by training, sampling and bench."""
import sys

import pytest
import torch
from hydra import compose, initialize_config_dir

import sample
from conftest import REPO, TINY_MODEL, TINY_ROUTE, assert_one_line_error, run_script, tiny_overrides
from lab import bench
from tools import finetune_lora
from training import loop
from training.checkpoint import load_checkpoint
from training.config_check import check_train_config
from training.loop import save_snapshot, setup
from tread_utils.precision import precision_policy, set_precision_policy


@pytest.fixture(autouse=True)
def restore_policy():
    yield
    set_precision_policy(True)


def train_setup(tmp_path, tf32: bool, *more):
    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base="1.3"):
        cfg = compose("config", overrides=[f"results_dir={tmp_path}", "run_name=p", *TINY_MODEL, *TINY_ROUTE,
                                           "train.general.batch_size=8", "train.eval.eval_interval=0",
                                           "train.logging.tensorboard=false", f"train.tf32={str(tf32).lower()}",
                                           *more])
    return setup(check_train_config(cfg))


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


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU accelerate makes the fp16 grad scaler")
def test_fp16_without_a_gpu_is_refused(tmp_path):
    """accelerate on a CPU takes mixed_precision=fp16 but neither autocasts nor scales: refused before the run
    folder exists, not trained in fp32; so is a results_dir that cannot be created."""
    proc = run_script("train.py", f"results_dir={tmp_path}", "run_name=p", *tiny_overrides("dit"),
                      "train.mixed_precision=fp16")
    assert_one_line_error(proc, "fp16 needs a CUDA GPU", "use bf16 or no")
    assert not (tmp_path / "p").exists()
    (tmp_path / "file").write_text("not a folder")
    proc = run_script("train.py", f"results_dir={tmp_path / 'file' / 'results'}", *tiny_overrides("dit"))
    assert_one_line_error(proc, "cannot create the run folder", "set results_dir=")


def test_grad_scaler_state_survives_a_resume(tmp_path, monkeypatch):
    """The checkpoint carries the grad scaler's state (scale, growth tracker) and a resume restores it.
    fp16 has no scaler on a CPU (above), so a CPU GradScaler is attached to the accelerator by hand: this
    checks the save/restore path; scaled fp16 steps themselves need a GPU (tests/test_cuda.py)."""
    start = loop.start_processes

    def with_scaler(*args, **kwargs):
        accelerator = start(*args, **kwargs)
        accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16, growth_interval=7)
        return accelerator

    monkeypatch.setattr(loop, "start_processes", with_scaler)
    run = train_setup(tmp_path, True, "train.general.num_workers=0")
    scaler = run.accelerator.scaler
    scaler.scale(torch.ones(()))  # creates the scale tensor
    scaler.update(new_scale=123.0)
    scaler._growth_tracker.fill_(5)
    save_snapshot(run, 3)
    run.logger.close()
    assert load_checkpoint(run.ckpt_dir / "ckpt_00000003.pt")["scaler"]["scale"] == 123.0

    resumed = train_setup(tmp_path, True, "train.general.num_workers=0")
    resumed.logger.close()
    assert resumed.step == 3
    assert resumed.accelerator.scaler.state_dict() == scaler.state_dict()


@pytest.fixture
def hopper_with_torch_2_11(monkeypatch):
    """The attention decision reading an H100 with torch 2.11 and cuDNN 9.13, cuDNN's attention on. (torch's own
    version and CUDA state stay as they are: the modules a test imports read them.)"""
    from tread_utils import precision

    enabled = []
    monkeypatch.setattr(precision, "attention_stack", lambda: ("2.11.0+cu130", 91300, (9, 0)))
    monkeypatch.setattr(torch.backends.cuda, "cudnn_sdp_enabled", lambda: not enabled)
    monkeypatch.setattr(torch.backends.cuda, "enable_cudnn_sdp", lambda on: enabled.append(on))
    return enabled


def test_faulting_cudnn_attention_is_turned_off_in_one_line_unless_kept(hopper_with_torch_2_11):
    from tread_utils.precision import avoid_faulting_attention

    assert avoid_faulting_attention(True, "--keep") is None and hopper_with_torch_2_11 == []
    line = avoid_faulting_attention(False, "--keep-cudnn-attention")
    assert hopper_with_torch_2_11 == [False] and "\n" not in line
    assert "torch 2.11.0+cu130, cuDNN 91300, sm90" in line and line.endswith("--keep-cudnn-attention keeps it")


@pytest.mark.parametrize("keep", [False, True])
def test_train_py_decides_the_attention_backend_from_its_config(tmp_path, monkeypatch, capsys, keep):
    """... and the float32 kernel (train.attention_fp32, here with keep), said in one line."""
    from tread_utils import attention

    seen = []
    monkeypatch.setattr(loop, "avoid_faulting_attention", lambda *args: seen.append(args) or "attention: off")
    try:
        run = train_setup(tmp_path, True, f"train.keep_cudnn_attention={str(keep).lower()}",
                          *["train.attention_fp32=math"] * keep)
        run.logger.close()
        assert (attention._float32 is attention.F.scaled_dot_product_attention) != keep
    finally:
        attention.use_attention(attention.DEFAULT, "train.attention")  # the selection is the process's
    out = capsys.readouterr().out
    assert seen == [(keep, "train.keep_cudnn_attention=true")] and "attention: off\n" in out
    assert ("\nfloat32 attention: math, torch's math kernel" in out) == keep


def test_finetune_lora_decides_the_attention_backend(hopper_with_torch_2_11, monkeypatch):
    monkeypatch.setattr(finetune_lora, "build", lambda args, device: (_ for _ in ()).throw(SystemExit(0)))
    for argv, expected in (([], [False]), (["--keep-cudnn-attention"], [])):
        hopper_with_torch_2_11.clear()
        with pytest.raises(SystemExit):
            finetune_lora.main(["--device", "cpu", *argv])
        assert hopper_with_torch_2_11 == expected
