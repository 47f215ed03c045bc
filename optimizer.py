"""The optimizer of train.py and bench.py: AdamW with the fastest implementation the device offers.

The fused kernel exists for CUDA and, since torch 2.4, for the CPU, where it is much faster than the
default per-tensor loop (DiT-S/2 on 2 cores: about 30 ms against over a second a step) and so decides
how close TREAD's measured speed-up gets to its FLOP bound: the optimizer step does not shrink with
the routed tokens. Otherwise the multi-tensor (foreach) path is used.
"""
import torch


def fused_adamw_available(device) -> bool:
    device = torch.device(device)
    if device.type == "cuda":
        return True
    major, minor = (int(v) for v in torch.__version__.split(".")[:2])
    return device.type == "cpu" and (major, minor) >= (2, 4)


def build_adamw(params, device, lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0):
    fused = fused_adamw_available(device)
    return torch.optim.AdamW(params, lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                             fused=fused, foreach=None if fused else True)
