"""The precision policy, decided once here and applied by train.py (and so the in-training evaluation),
sample.py and lab/bench.py alike, so that a benchmark times what the trainer runs.

TF32 on by default, as the authors' train.py sets it: float32 matmuls (and cuDNN convolutions, e.g. the
SD-VAE decoder) use TF32 tensor cores on Ampere and newer GPUs. Under bf16/fp16 autocast this matters for
the block right after each route, which runs in float32 (`fp32_after_route`, also the authors'): with
TF32 it runs on tensor cores at about half the bf16 rate, without it at a small fraction of that.
On a CPU the flags change nothing.

The attention backend: where cuDNN's fused attention was seen to fault in backward (below), the training entry
points turn it off and say so in one line, with a switch that keeps it; which kernels the models' attention runs
is tread_utils/attention.py's choice.
"""
import torch


def set_precision_policy(tf32: bool = True) -> None:
    torch.set_float32_matmul_precision("high" if tf32 else "highest")
    torch.backends.cudnn.allow_tf32 = bool(tf32)


def precision_policy() -> dict:
    """The flags in force, for logs and benchmark records."""
    return {"tf32_matmul": torch.get_float32_matmul_precision() != "highest",
            "tf32_cudnn": bool(torch.backends.cudnn.allow_tf32)}


# Where cuDNN's fused attention (the first SDPA backend torch tries on Hopper and newer) was seen to fail in
# backward, one row per report: (torch from, torch before, cuDNN from, cuDNN before), as (major, minor) and
# torch.backends.cudnn.version() numbers; None leaves that end open. A stack outside every row keeps cuDNN's
# attention (a newer cuDNN installed over torch's: `python -m lab.cudnn_attention_fault` checks it there).
CUDNN_ATTENTION_FAULTS = (
    # an illegal memory access after `mha_graph.execute(...).is_good()` fails, on long sequences: public reports
    # pytorch#122695 and #169849, fixed in cuDNN 9.15.1
    (None, None, None, 91501),
    # NaN query gradients with an attention mask at lengths 64 mod 128 on H100/H200 from torch 2.11: public report
    # pytorch#196678, fixed in cuDNN 9.26 (by cudnn-frontend's fix)
    ((2, 11), None, None, 92600),
    # seen in this project: an illegal memory access at the first backward of an unmasked FLUX LoRA step on an H100
    # (torch 2.11 with the cuDNN it ships, 9.19), and a fault with torch 2.11 + cuDNN 9.19 on an H200
    ((2, 11), (2, 12), 91900, 92000),
)


def _within(value, start, stop) -> bool:
    return (start is None or value >= start) and (stop is None or value < stop)


def cudnn_attention_faults(torch_version: str, cudnn_version, capability) -> bool:
    """Whether this torch / cuDNN / GPU (compute capability (major, minor)) is one where cuDNN's attention
    backward was seen to fail: a Hopper or newer GPU (where torch picks cuDNN's attention first) on a stack within
    a row of CUDNN_ATTENTION_FAULTS."""
    if capability is None or tuple(capability) < (9, 0):
        return False
    release = tuple(int(part) for part in torch_version.split("+")[0].split(".")[:2])
    return any(_within(release, torch_from, torch_before) and _within(cudnn_version or 0, cudnn_from, cudnn_before)
               for torch_from, torch_before, cudnn_from, cudnn_before in CUDNN_ATTENTION_FAULTS)


def attention_stack():
    """(torch version, cuDNN version, compute capability) of this machine's GPU, or None without one: what the
    attention decision reads."""
    if not torch.cuda.is_available():
        return None
    return torch.__version__, torch.backends.cudnn.version(), torch.cuda.get_device_capability()


def avoid_faulting_attention(keep_cudnn: bool, switch: str):
    """Turn cuDNN's attention off for scaled_dot_product_attention where `cudnn_attention_faults` (torch then
    uses flash or memory-efficient attention, the same computation); returns the one line to print, or None
    where nothing changed. `switch` names the setting that keeps cuDNN's attention."""
    stack = None if keep_cudnn else attention_stack()
    if stack is None or not torch.backends.cuda.cudnn_sdp_enabled() or not cudnn_attention_faults(*stack):
        return None
    torch.backends.cuda.enable_cudnn_sdp(False)
    version, cudnn, (major, minor) = stack
    return (f"attention: cuDNN's fused attention is off (torch {version}, cuDNN {cudnn}, sm{major}{minor}: its "
            f"backward is known to fault there); flash / memory-efficient attention instead. {switch} keeps it")
