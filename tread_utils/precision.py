"""The precision policy, decided once here and applied by train.py (and so the in-training evaluation),
sample.py and lab/bench.py alike, so that a benchmark times what the trainer runs.

TF32 on by default, as the authors' train.py sets it: float32 matmuls (and cuDNN convolutions, e.g. the
SD-VAE decoder) use TF32 tensor cores on Ampere and newer GPUs. Under bf16/fp16 autocast this matters for
the block right after each route, which runs in float32 (`fp32_after_route`, also the authors'): with
TF32 it runs on tensor cores at about half the bf16 rate, without it at a small fraction of that.
On a CPU the flags change nothing.
"""
import torch


def set_precision_policy(tf32: bool = True) -> None:
    torch.set_float32_matmul_precision("high" if tf32 else "highest")
    torch.backends.cudnn.allow_tf32 = bool(tf32)


def precision_policy() -> dict:
    """The flags in force, for logs and benchmark records."""
    return {"tf32_matmul": torch.get_float32_matmul_precision() != "highest",
            "tf32_cudnn": bool(torch.backends.cudnn.allow_tf32)}
