"""Shared by tools/finetune_lora.py and lab/bench_diffusers.py: a random FLUX-architecture transformer, a tiny
fixed text encoder, the flow-matching training step the models train with (each family's forward inputs from its
`Family.example`), and the timing / FLOP-bound measurement of a routed against an unrouted step."""
import statistics
import time
from contextlib import nullcontext

import torch
import torch.nn as nn
from torch.utils.flop_counter import FlopCounterMode

from tread_diffusers import apply_tread
from tread_diffusers.families import family_of
from tread_diffusers.flux_families import pack  # noqa: F401  (FLUX's packing, for the callers)
from tread_utils.errors import UserError

CLASS_NAMES = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
# torch.compile's modes the commands offer for compiled blocks (reduce-overhead: CUDA graphs,
# tread_diffusers.compile.CompiledSteps)
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune-no-cudagraphs")


class FixedTextEncoder(nn.Module):
    """Letters -> a frozen random embedding plus a sinusoidal position, one token per letter (names padded to
    the longest); the pooled vector is the mean over the name's letters. Seeded: the same on every run."""

    def __init__(self, dim: int, pooled_dim: int, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.length = max(map(len, CLASS_NAMES))
        self.register_buffer("letters", torch.randn(27, dim, generator=g))  # row 0: padding
        pos = torch.arange(self.length)[:, None] / 10000 ** (torch.arange(0, dim, 2) / dim)
        self.register_buffer("position", torch.cat([pos.sin(), pos.cos()], 1)[:, :dim])
        self.register_buffer("pool", torch.randn(dim, pooled_dim, generator=g) / dim ** 0.5)

    @torch.no_grad()
    def forward(self, labels: torch.Tensor):
        """Text tokens [B, L, dim] and pooled [B, pooled_dim] for class labels [B]."""
        codes = torch.zeros(len(CLASS_NAMES), self.length, dtype=torch.long)
        for i, name in enumerate(CLASS_NAMES):
            codes[i, :len(name)] = torch.tensor([ord(c) - 96 for c in name])
        codes = codes.to(labels.device)[labels]
        present = (codes > 0).float()[..., None]
        tokens = (self.letters[codes] + self.position) * present
        pooled = (tokens.sum(1) / present.sum(1)) @ self.pool
        return tokens, pooled


def random_flux(channels: int, width: int, heads: int, dual: int, single: int, text_dim: int, seed: int = 0):
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(seed)
    head_dim = width // heads
    axes = (head_dim - 2 * (3 * head_dim // 8), 3 * head_dim // 8, 3 * head_dim // 8)
    return FluxTransformer2DModel(patch_size=1, in_channels=channels * 4, num_layers=dual, num_single_layers=single,
                                  attention_head_dim=head_dim, num_attention_heads=heads, joint_attention_dim=text_dim,
                                  pooled_projection_dim=text_dim, axes_dims_rope=axes)


def model_inputs(model, x_t: torch.Tensor, text: torch.Tensor, pooled: torch.Tensor, t: torch.Tensor) -> dict:
    """The forward keywords of noisy latents `x_t` at times `t` in [0, 1], as the model's family builds them (its
    `Family.example.inputs`, tread_diffusers)."""
    family = family_of(model)
    if family.example is None:
        raise UserError(f"{type(model).__name__}: its family gives no example inputs (Family.example) to train it on")
    return family.example.inputs(model, x_t, text, pooled, t)


def flow_matching_loss(model, latents: torch.Tensor, text: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
    """Rectified flow as FLUX and SD3 train: x_t = (1 - t) x0 + t noise with t from a logit-normal, the
    model predicts the velocity noise - x0."""
    b = latents.shape[0]
    t = torch.sigmoid(torch.randn(b, device=latents.device))
    noise = torch.randn_like(latents)
    x_t = (1 - t.view(-1, *[1] * (latents.ndim - 1))) * latents + t.view(-1, *[1] * (latents.ndim - 1)) * noise
    x_t = x_t.to(latents.dtype)  # a bf16 model's latents stay bf16 (t is float32)
    pred = model(**model_inputs(model, x_t, text, pooled, t), return_dict=False)
    pred = pred if isinstance(pred, torch.Tensor) else pred[0]  # Kandinsky 5 returns the bare tensor
    if isinstance(pred, list):  # Z-Image: [C, 1, H, W] per sample
        pred = torch.stack(pred).reshape(latents.shape)
    if pred.shape != latents.shape:  # tokens [B, N, C] of latents [B, C, *grid] (LTX-Video, LTX-2)
        pred = pred.transpose(1, 2).reshape(latents.shape)
    return (pred.float() - (noise - latents).float()).square().mean()


def step_flops(model, batch) -> int:
    """FLOPs of one training step's forward + backward (torch.utils.flop_counter), as the model routes now; a
    compiled model's, counted eagerly (its compiled graphs run their Python code instead)."""
    eager = torch.compiler.set_stance("force_eager") if hasattr(torch.compiler, "set_stance") else nullcontext()
    with eager, FlopCounterMode(display=False) as counter:
        flow_matching_loss(model, *batch).backward()
    model.zero_grad(set_to_none=True)
    return counter.get_total_flops()


def training_step(model, batch_fn, optimizer, run=None):
    """One training step as a closure: the flow-matching loss on a new batch, backward, the optimizer's step; run
    by `run` where given (tread_diffusers.compile.CompiledSteps: compiled blocks, CUDA graphs' steps)."""
    def step():
        optimizer.zero_grad(set_to_none=True)
        flow_matching_loss(model, *batch_fn()).backward()
        optimizer.step()
    return step if run is None else lambda: run(step)


def peak_memory(timing: dict) -> str:
    """routed_vs_unrouted's peak memory as a log line says it."""
    return "none (a CPU)" if timing["peak_mem_mb"] is None else f"{timing['peak_mem_mb']:.0f} MB"


def routed_vs_unrouted(model, routes, batch_fn, optimizer, rounds: int = 5, steps: int = 3, flops=None,
                       run=None) -> dict:
    """Median step time (forward, backward, optimizer step) routed and unrouted, alternating `rounds` blocks of
    `steps` steps each so both see the same machine load, with the FLOP bound unrouted / routed. On a GPU each
    step ends with a synchronisation: its time is the GPU's or the host's, whichever is longer; `peak_mem_mb` is
    the most memory allocated on it from the first warm-up step on (None on a CPU). `flops` ({False: unrouted,
    True: routed}) skips the counting (a compiled model's counts are its eager ones). `run`: training_step's."""
    cuda = next(model.parameters()).is_cuda
    step = training_step(model, batch_fn, optimizer, run)
    warmups = 2 if getattr(run, "graphs", False) else 1  # CUDA graph trees record a graph at its second call

    def one_step():
        step()
        if cuda:
            torch.cuda.synchronize()

    model.train()
    counted, times = dict(flops or {}), {True: [], False: []}
    for routed in (False, True):
        if routed not in counted:  # eager, before the memory is measured
            handle = apply_tread(model, routes) if routed else None
            counted[routed] = step_flops(model, batch_fn())
            if handle:
                handle.remove()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    for count, timed in ((warmups, False), *[(steps, True)] * rounds):
        for routed in (False, True):
            handle = apply_tread(model, routes) if routed else None
            for _ in range(count):
                start = time.perf_counter()
                one_step()
                if timed:
                    times[routed].append(time.perf_counter() - start)
            if handle:
                handle.remove()
    unrouted, routed = statistics.median(times[False]), statistics.median(times[True])
    bound, speedup = counted[False] / counted[True], unrouted / routed
    return dict(unrouted_step_s=unrouted, routed_step_s=routed, speedup=speedup, flops_unrouted=counted[False],
                flops_routed=counted[True], flop_bound=bound, speedup_vs_bound=speedup / bound,
                timed_steps_each=rounds * steps,
                peak_mem_mb=torch.cuda.max_memory_allocated() / 2 ** 20 if cuda else None)
