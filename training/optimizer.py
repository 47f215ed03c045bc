"""The optimizer of train.py and tools/bench.py: AdamW with the fastest implementation the device offers.

The fused kernel exists for CUDA and, since torch 2.4 (the oldest torch this project supports), for the
CPU, where torch's default is a per-tensor loop. The choice follows the device the parameters are on, so
build the optimizer after moving the model. Its cost matters for TREAD: the optimizer step does not shrink with the routed
tokens, so a slow one pulls the measured speed-up below the FLOP bound. Without a fused kernel the
multi-tensor (foreach) path is used.
"""
import torch


FUSED_DEVICE_TYPES = ("cuda", "cpu")


def fused_adamw_available(device) -> bool:
    return torch.device(device).type in FUSED_DEVICE_TYPES


def build_adamw(params, lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0):
    """AdamW over `params`, fused when every parameter lies on a device with the fused kernel."""
    params = list(params)
    fused = bool(params) and all(fused_adamw_available(p.device) for p in params)
    return torch.optim.AdamW(params, lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                             fused=fused, foreach=None if fused else True)
