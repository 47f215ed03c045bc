"""What a CUDA run relies on, checked on the CPU: per-device RNG state in checkpoints, the optimizer built
on the parameters' device, the declared oldest torch."""
import re

import pytest
import torch

from conftest import REPO
from training import checkpoint as ckpt
from training.loop import build_adamw


class FakeCuda:
    """torch.cuda as a process that sees `count` GPUs and uses GPU `current`."""

    def __init__(self, monkeypatch, count, current):
        self.count, self.current, self.set_calls = count, current, []
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: self.current)
        monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device=None: torch.full((4,), int(device),
                                                                                         dtype=torch.uint8))
        monkeypatch.setattr(torch.cuda, "get_rng_state_all", self.fail)
        monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device=None: self.set_calls.append(
            (int(state[0]), device)))
        monkeypatch.setattr(torch.cuda, "set_rng_state_all", self.fail)

    @staticmethod
    def fail(*args, **kwargs):
        raise AssertionError("touched every visible GPU's generator")


def test_checkpoint_rng_holds_the_current_gpu_only(monkeypatch):
    FakeCuda(monkeypatch, count=8, current=3)
    state = ckpt.capture_rng_state()
    assert state["cuda"].tolist() == [3, 3, 3, 3]


def test_rng_restores_with_fewer_gpus_visible(monkeypatch):
    cuda = FakeCuda(monkeypatch, count=1, current=0)
    saved = ckpt.capture_rng_state()
    saved["cuda"] = torch.full((4,), 5, dtype=torch.uint8)  # written by a rank whose GPU was cuda:5
    ckpt.restore_rng_state(saved)
    assert cuda.set_calls == [(5, 0)]
    # a checkpoint of the older format held every visible GPU's state: take this process's own entry
    old = {**saved, "cuda": [torch.full((4,), i, dtype=torch.uint8) for i in range(4)]}
    cuda.current = 2
    ckpt.restore_rng_state(old)
    cuda.current = 6  # more GPUs now than the writer saw: nothing to restore for this one
    ckpt.restore_rng_state(old)
    assert cuda.set_calls == [(5, 0), (2, 2)]


def test_optimizer_follows_the_parameters_device():
    cpu = torch.nn.Linear(3, 3)
    assert build_adamw(cpu.parameters()).defaults["fused"] is True
    meta = torch.nn.Linear(3, 3, device="meta")  # a device without the fused kernel
    opt = build_adamw(meta.parameters())
    assert opt.defaults["fused"] is False and opt.defaults["foreach"] is True


def test_declared_oldest_torch_has_what_the_code_uses():
    spec = re.search(r'^\s*"torch>=\s*([\d.]+)"', (REPO / "pyproject.toml").read_text(), re.M)
    declared = tuple(int(v) for v in spec.group(1).split(".")[:2])
    assert declared >= (2, 4)  # fused CPU AdamW and torch.is_autocast_enabled(device_type) arrived in 2.4
    installed = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2])
    assert installed >= declared
    assert torch.is_autocast_enabled("cpu") is False
