"""The optimizer of train.py and tools/bench.py: AdamW with the fastest implementation the device offers.

The fused kernel exists for CUDA and, since torch 2.4, for the CPU, where torch's default is a
per-tensor loop. Its cost matters for TREAD: the optimizer step does not shrink with the routed
tokens, so a slow one pulls the measured speed-up below the FLOP bound. Without a fused kernel the
multi-tensor (foreach) path is used.
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
