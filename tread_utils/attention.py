"""The attention kernels the models run: a registry of backends, selected once at start-up.

The DiT and LightningDiT blocks call `attention(q, k, v)` ([B, H, N, D], no mask, no dropout), which runs the
backend `use_attention(name, setting)` selected: the entry point (train.py's `train.attention`, lab.bench's
`--attention`) checks the name, its package and this device once, and stores the backend's function, so a call
looks nothing up (`sdpa`: one Python call more than torch's SDPA; a forced torch kernel adds its `sdpa_kernel`
context, eager only: a compiled graph holds the kernel). A diffusers transformer has attention backends of its
own: `use_diffusers_attention(transformer, name, setting)` sets the one an entry maps to.

`flash`, `cudnn` and `flash4` run bfloat16 and float16 inputs. Float32 attention (the block after a route under
mixed precision, or a run without it) runs the float32 kernel selected apart (FLOAT32, `train.attention_fp32`):
torch's own choice by default (on a GPU its memory-efficient kernel, in float32 arithmetic, as the authors' code
runs it), or torch's math kernel, two batched matmuls and a softmax, which on CUDA run TF32 where TF32 matmuls
are on (`train.tf32`, the authors' setting) and hold the [B, H, N, N] scores in memory. Under torch.compile the
math kernel's forced choice is traced as its matmuls (inductor would fuse a written-out attention back into
SDPA). Which backend for which GPU, and what is measured: docs/performance.md, "Attention backends".
"""
import importlib.metadata
import importlib.util
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from tread_utils.errors import UserError
from tread_utils.precision import attention_stack, cudnn_attention_faults

INSTALL_HOPPER = 'pip install -e ".[hopper]"'


@dataclass(frozen=True)
class Package:
    module: str        # what the backend imports
    distribution: str  # what pip installs


@dataclass(frozen=True)
class Backend:
    what: str                      # the kernels it runs, for the start-up line
    build: Callable[[], Callable]  # -> the attention function (q, k, v) -> out; imports its package when called
    cpu: bool = True               # runs on the CPU too
    capability: tuple = (0, 0)     # the oldest CUDA compute capability it runs on
    package: Optional[Package] = None
    diffusers: Optional[str] = None  # the diffusers backend (AttentionBackendName's value) it maps to; None: none


def forced(kernel) -> Callable:
    """torch's SDPA restricted to one of its kernels (`attention` hands float32 inputs to the float32 kernel
    before a backend sees them)."""
    def run(q, k, v):
        with sdpa_kernel(kernel):
            return F.scaled_dot_product_attention(q, k, v)
    return run


def flash_attention_4() -> Callable:
    """FlashAttention-4's `flash_attn_func`, which takes [B, N, H, D] (the transposes are views: it accepts a
    contiguous last dimension) and returns (out, logsumexp)."""
    from flash_attn.cute import flash_attn_func

    @torch.compiler.disable  # not a torch op: dynamo would trace into its CuTe code; under compile, a graph break
    def fa4(q, k, v):
        out = flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return (out[0] if isinstance(out, tuple) else out).transpose(1, 2)
    return fa4


BACKENDS = {
    "sdpa": Backend("torch's scaled_dot_product_attention, its own choice of kernel",
                    lambda: F.scaled_dot_product_attention, diffusers="native"),
    "flash": Backend("torch's FlashAttention-2 kernel for bf16/fp16", lambda: forced(SDPBackend.FLASH_ATTENTION),
                     capability=(8, 0), diffusers="_native_flash"),
    "cudnn": Backend("cuDNN's fused attention through torch's SDPA for bf16/fp16",
                     lambda: forced(SDPBackend.CUDNN_ATTENTION), cpu=False, capability=(8, 0),
                     diffusers="_native_cudnn"),
    "flash4": Backend("FlashAttention-4 for bf16/fp16", flash_attention_4, cpu=False, capability=(9, 0),
                      package=Package("flash_attn.cute", "flash-attn-4"), diffusers="flash_4_hub"),
    "math": Backend("torch's reference (math) kernel", lambda: forced(SDPBackend.MATH), diffusers="_native_math"),
}
DEFAULT = "sdpa"

# train.attention_fp32 -> (what it runs, its function): the kernel of float32 attention, whatever the backend
FLOAT32 = {
    "sdpa": ("torch's own choice", F.scaled_dot_product_attention),
    "math": ("torch's math kernel (TF32 batched matmuls on CUDA under train.tf32)", forced(SDPBackend.MATH)),
}

_selected = F.scaled_dot_product_attention  # the selected backend's function: what `attention` calls
_selected_name = DEFAULT
_float32 = F.scaled_dot_product_attention   # the selected float32 kernel


def attention(q, k, v):
    """Self-attention of [B, H, N, D] queries, keys and values by the backend `use_attention` selected (float32
    inputs: by its float32 kernel)."""
    return (_float32 if q.dtype == torch.float32 else _selected)(q, k, v)


def selected_attention() -> str:
    """The name of the backend `attention` runs, for records."""
    return _selected_name


def installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # its parent package is absent
        return False


def check_attention(name: str, setting: str, device=None, package: bool = True) -> Backend:
    """The backend `name` if it can run in this process on `device` (None: the GPU if there is one), else one
    UserError line: an unknown name, a missing package (`package`: its own; diffusers' backends need others), a
    device it does not run on, a cuDNN known to fault. `setting` names the option, e.g. train.attention."""
    backend = BACKENDS.get(name)
    if backend is None:
        raise UserError(f"{setting}={name} is not an attention backend; use one of {', '.join(BACKENDS)}")
    needed = backend.package
    if package and needed is not None and not installed(needed.module):
        raise UserError(f"{setting}={name} needs the {needed.distribution} package, not installed here: "
                        f"{INSTALL_HOPPER} (or pip install --pre {needed.distribution})")
    device = torch.device(device if device is not None else "cuda" if torch.cuda.is_available() else "cpu")
    wanted = "sm{}{}".format(*backend.capability)
    if device.type != "cuda" and backend.cpu:
        return backend
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    if capability is None or capability < backend.capability:
        here = f"this process runs on the {device.type}" if capability is None else "this one is sm{}{}".format(*capability)
        raise UserError(f"{setting}={name} runs on a CUDA GPU of {wanted} or newer and {here}; use {setting}={DEFAULT}")
    stack = attention_stack()
    if name == "cudnn" and stack is not None and cudnn_attention_faults(*stack):
        version, cudnn, _ = stack
        raise UserError(f"{setting}=cudnn: cuDNN's attention backward was seen to fault with torch {version} and "
                        f"cuDNN {cudnn} on this GPU; install a newer cuDNN and check it with python -m "
                        f"lab.cudnn_attention_fault (docs/performance.md), or use {setting}=flash")
    return backend


def describe(name: str, backend: Backend) -> str:
    needed = backend.package
    version = f" ({needed.distribution} {importlib.metadata.version(needed.distribution)})" if needed else ""
    return f"attention: {name}, {backend.what}{version}"


def use_attention(name: str, setting: str, device=None, float32: str = DEFAULT) -> Optional[str]:
    """Select the backend the models' `attention` runs in this process, after `check_attention`, and its float32
    kernel (a name of FLOAT32, which the entry point's choices check); returns the line to print, or None for
    the defaults (torch's own choice, as without a selection)."""
    global _selected, _selected_name, _float32
    backend = check_attention(name, setting, device)
    _selected, _selected_name = backend.build(), name
    what, _float32 = FLOAT32[float32]
    lines = []
    if name != DEFAULT:
        lines.append(describe(name, backend))
    if float32 != DEFAULT:
        lines.append(f"float32 attention: {float32}, {what}")
    return "; ".join(lines) or None


def use_diffusers_attention(transformer, name: str, setting: str, device=None) -> Optional[str]:
    """Set the diffusers attention backend that `name` maps to on every attention module of `transformer` (its
    `set_attention_backend`), after checking this device; returns the line to print, or None for the default.
    diffusers checks what its backend needs (FlashAttention-4 comes from the Hub there, through `kernels`)."""
    backend = check_attention(name, setting, device, package=False)
    import diffusers
    from diffusers.models.attention_dispatch import AttentionBackendName

    mapped = backend.diffusers
    if mapped is None or mapped not in {b.value for b in AttentionBackendName}:
        raise UserError(f"{setting}={name} has no diffusers attention backend in diffusers {diffusers.__version__}; "
                        f"use {setting}={DEFAULT}")
    try:
        transformer.set_attention_backend(mapped)
    except (RuntimeError, ValueError, ImportError) as e:  # a package its backend needs, the Hub, a remote kernel
        raise UserError(f"{setting}={name} (diffusers' {mapped}): {str(e).splitlines()[0]}") from None
    return None if name == DEFAULT else f"attention: {name}, diffusers' {mapped} backend"
