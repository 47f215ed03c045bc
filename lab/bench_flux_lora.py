"""The FLUX.1-dev LoRA fine-tune step, routed against unrouted, as a SimpleTuner user runs it: LoRA rank 16 on
the attention projections (to_q, to_k, to_v, to_out.0), gradient checkpointing, AdamW on the adapters, the route
{selection_ratio 0.5, start 2, end -2}. Run by `python -m lab.bench_diffusers --flux-lora SIZE`:

- `full` (a GPU): FLUX.1-dev's transformer at its own sizes (19 + 38 blocks, width 3072, guidance embedding;
  11.9 B parameters, random weights, bf16, built on the GPU), 1024 x 1024 images (4,096 image tokens) and 512
  text tokens; eager at each batch size, then with each block compiled (tread_diffusers/compile.py, static
  shapes, `compile_mode`; reduce-overhead: CUDA graphs) at each batch size with the checkpoint inside the blocks'
  graphs (compiled after enable_gradient_checkpointing), and with `checkpoint_outside` last at the first batch
  size with the checkpoint around them (checkpointing enabled again after compiling). In reduce-overhead mode
  that last nesting is the one CUDA graph trees are reported to fail on: where they do, one line says so and the
  row's steps after it run without CUDA graphs (`cuda_graphs` false, `cuda_graphs_failure` the line).
- `proxy` (a CPU): the same depth at width 64, 16 image and 16 text tokens, float32: the arithmetic is tiny, so
  a step's time is what the host spends (Python, autograd, hooks), and routed / unrouted is the host cost of
  routing.

Each row: the medians of alternating timed blocks (tools/diffusers_toy.routed_vs_unrouted; on a GPU each step
ends synchronised), the FLOP bound from torch's FLOP counter, unrouted / routed, and the peak memory allocated
(`peak_mem_mb`, the larger of the two steps'; None on a CPU). With `profile`, one more routed
step under torch.profiler (`profile_routed`, lab/bench_timing.profile_step): its kernels' busy time against the
timed routed step says whether the step waits for the GPU or for the host (the profiler slows the host, so its
own wall time is not the step's).
"""
import torch

from lab.bench_timing import profile_step
from tools.diffusers_toy import pack, peak_memory, random_flux, routed_vs_unrouted, training_step
from tread_diffusers import apply_tread
from tread_diffusers.compile import CompiledSteps

DUAL, SINGLE = 19, 38  # FLUX.1-dev's blocks
SIZES = {"full": dict(width=3072, tokens_side=64, text=512, text_dim=4096, pooled=768, channels=16),
         "proxy": dict(width=64, tokens_side=4, text=16, text_dim=64, pooled=64, channels=4)}
LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0"]


def build(size: str, device: torch.device, rank: int = 16):
    """The transformer with LoRA adapters and gradient checkpointing, in training mode, and its AdamW."""
    from diffusers import FluxTransformer2DModel
    from peft import LoraConfig

    if size == "full":  # bf16 on the GPU from the start: a float32 CPU build takes minutes and 48 GB
        default = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        try:
            with torch.device(device):
                model = FluxTransformer2DModel(guidance_embeds=True)
        finally:
            torch.set_default_dtype(default)
    else:
        s = SIZES[size]
        model = random_flux(s["channels"], s["width"], s["width"] // 64, DUAL, SINGLE, s["text_dim"]).to(device)
    model.requires_grad_(False)
    model.add_adapter(LoraConfig(r=rank, lora_alpha=rank, init_lora_weights="gaussian", target_modules=LORA_TARGETS))
    model.enable_gradient_checkpointing()
    model.train()
    return model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)


def batches(size: str, batch: int, device: torch.device, dtype: torch.dtype):
    """A function drawing (packed latents, text tokens, pooled text) of the size's shapes."""
    s = SIZES[size]
    side = 2 * s["tokens_side"]  # latent pixels, packed 2 x 2

    def draw():
        return (pack(torch.randn(batch, s["channels"], side, side, device=device, dtype=dtype)),
                torch.randn(batch, s["text"], s["text_dim"], device=device, dtype=dtype),
                torch.randn(batch, s["pooled"], device=device, dtype=dtype))
    return draw


def flux_lora_rows(size: str, batch_sizes, compiled_modes, routes: dict, rounds: int, steps: int,
                   checkpoint_outside: bool = False, compile_mode: str = "default", profile: bool = False) -> list:
    """One row per batch size eager, then (blocks compiled once, static shapes: each batch size compiles graphs
    of its own, minutes at full size) one per batch size with the checkpoint inside the compiled blocks' graphs,
    and if asked the first batch size with the checkpoint around them."""
    device = torch.device("cuda" if size == "full" else "cpu")
    gpu = device.type == "cuda"
    model, optimizer = build(size, device)
    dtype = next(model.parameters()).dtype
    params_m = sum(p.numel() for p in model.parameters()) / 1e6
    rows, counted, run = [], {}, None
    runs = [(False, "around blocks", batch) for batch in batch_sizes] if False in compiled_modes else []
    if True in compiled_modes:
        runs += [(True, "in graphs", batch) for batch in batch_sizes]
        runs += [(True, "around blocks", batch_sizes[0])] * checkpoint_outside
    for compiled, checkpoint, batch in runs:
        if compiled and run is None:  # checkpointing is on: it goes inside the graphs
            run = CompiledSteps(model, dynamic=False, mode=compile_mode)  # the ratio is fixed: so are the shapes
        if compiled and checkpoint == "around blocks":
            model.enable_gradient_checkpointing()  # diffusers' own checkpoint function again: around the blocks
        draw = batches(size, batch, device, dtype)
        had_graphs = compiled and run.graphs
        result = routed_vs_unrouted(model, routes, draw, optimizer, rounds=rounds, steps=steps,
                                    flops=counted.get(batch), run=run if compiled else None)
        counted[batch] = {False: result["flops_unrouted"], True: result["flops_routed"]}
        graphs = dict(compile_mode=compile_mode, cuda_graphs=run.graphs and gpu) if compiled else {}  # CPU: none
        if had_graphs and not run.graphs:  # they failed in this row: the steps after the failure ran without them
            graphs["cuda_graphs_failure"] = run.failure
        if profile:
            result["profile_routed"] = profiled_routed_step(model, routes, draw, optimizer, device,
                                                            run if compiled else None)
        rows.append(dict(arch="flux-dev" if size == "full" else "flux-dev depth, width 64", params_m=params_m,
                         blocks=DUAL + SINGLE, tokens=SIZES[size]["tokens_side"] ** 2, text_tokens=SIZES[size]["text"],
                         batch=batch, compiled=compiled, checkpoint=checkpoint, dtype=str(dtype).replace("torch.", ""),
                         **graphs, **result))
        how = f"compiled ({compile_mode}), checkpoint {checkpoint}" if compiled else "eager"
        print(f"flux-lora {size} batch {batch} {how}: unrouted {result['unrouted_step_s'] * 1e3:.0f} ms, routed "
              f"{result['routed_step_s'] * 1e3:.0f} ms, speed-up {result['speedup']:.3f}x of a "
              f"{result['flop_bound']:.3f}x bound: {result['speedup_vs_bound']:.3f}; peak memory {peak_memory(result)}",
              flush=True)
    return rows


def profiled_routed_step(model, routes, draw, optimizer, device, run=None) -> dict:
    """One routed training step under torch.profiler, after one unprofiled (lab/bench_timing.profile_step)."""
    handle = apply_tread(model, routes)
    try:
        step = training_step(model, draw, optimizer, run)
        step()
        return profile_step(step, device, top=10)
    finally:
        handle.remove()
