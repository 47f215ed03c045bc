"""How lab/bench.py times a variant on a device: the matmul ceiling MFU is measured against, CUDA-event timing,
peak memory, and one variant built and timed alone, its out-of-memory failure caught and its memory freed."""
import functools
import gc
import statistics
import time

import torch
from torch._dynamo.utils import counters

from lab.bench_evaluation import sync
from lab.bench_memory import peak_rss_mb


def matmul_ceiling(device, dtype, size=None, min_seconds=0.5, trials=3) -> float:
    """Achieved FLOP/s of a large square matmul, the practical peak of this device: the best of `trials`
    timings, each repeated until at least `min_seconds` of work is timed (CUDA events on a GPU), after a
    warm-up. Every product is written into one preallocated output, so the timed loop allocates nothing and
    holds three matrices whatever the repeat count; they are freed before the variants are timed. One timing
    on a CPU whose clock or neighbours vary can come out low; the best of several is the ceiling's estimate,
    and CPU tables mark MFU as indicative."""
    size = size or (8192 if device.type == "cuda" else 1024)
    dt = dtype or torch.float32
    a, b = torch.randn(size, size, device=device, dtype=dt), torch.randn(size, size, device=device, dtype=dt)
    c = torch.empty(size, size, device=device, dtype=dt)

    def products(n):
        for _ in range(n):
            torch.mm(a, b, out=c)

    products(3)
    best = 0.0
    for _ in range(trials):
        iters, seconds = 1, 0.0
        while seconds < min_seconds:
            iters *= 2
            seconds = timed(device, functools.partial(products, iters))
        best = max(best, 2 * size ** 3 * iters / seconds)
    del a, b, c
    release_memory(device)
    return best


def release_memory(device):
    """Frees what Python no longer references, and on a GPU hands the allocator's cached blocks back."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def timed(device, fn) -> float:
    """Seconds `fn()` takes: CUDA events on a GPU (no host clock in the way), the host clock elsewhere."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(device)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def peak_memory_mb(device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2 ** 20
    return peak_rss_mb()


def time_alone(build, steps, warmup, device, profile=False) -> dict:
    """Builds one variant with every other one freed, warms it up (compilation happens here: `warmup_s`), then
    times `steps` steps: median seconds per step, peak memory of this variant alone, and what dynamo did (reset
    first, so a compiled variant can never fall back to eager on an earlier variant's recompile limit). With
    `profile`, one more step runs under torch.profiler (`profile_step`)."""
    torch._dynamo.reset()
    counters.clear()
    release_memory(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    step = build()
    t0 = time.perf_counter()
    for _ in range(warmup):
        step()
    sync(device)
    compiled = dict(warmup_s=time.perf_counter() - t0, frames=int(counters["frames"]["total"]),
                    graphs=int(counters["stats"]["unique_graphs"]),
                    graph_breaks=int(sum(counters["graph_break"].values())))
    times = [timed(device, step) for _ in range(steps)]
    compiled["recompiles_while_timed"] = int(counters["frames"]["total"]) - compiled["frames"]
    result = dict(step_s=statistics.median(times), peak_mem_mb=peak_memory_mb(device), **compiled)
    if profile:
        result["profile"] = profile_step(step, device)
    del step
    gc.collect()
    return result


def out_of_memory(error) -> bool:
    """Whether `error`, or one it was raised from (compilers wrap it), is the device running out of memory."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        text = str(error)
        if isinstance(error, torch.cuda.OutOfMemoryError) or "out of memory" in text.lower() or \
                "CUBLAS_STATUS_ALLOC_FAILED" in text:
            return True
        error = error.__cause__ or error.__context__
    return False


def time_or_out_of_memory(build, steps, warmup, device, profile=False) -> dict:
    """`time_alone`, or {"oom": True, "error": its first line} when the variant runs out of memory; either way
    its memory is freed before the next variant (the exception, and with it the frames holding the model,
    is dropped first)."""
    try:
        return time_alone(build, steps, warmup, device, profile)
    except Exception as e:
        if not out_of_memory(e):
            raise
        error = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
    torch._dynamo.reset()
    peak = peak_memory_mb(device)
    release_memory(device)
    return dict(oom=True, error=error, peak_mem_mb=peak)


# Where a step's time goes, by kernel (GPU) or operator (CPU) name, lower-cased; the first match wins. Inductor
# names a fused kernel after the ops in it, so adaLN's modulate fused into its layer norm shows as *layer_norm*.
CATEGORIES = (
    ("attention", ("flash", "fmha", "attention", "sdpa", "softmax")),
    ("optimizer", ("adam", "multi_tensor", "foreach")),
    ("gather/scatter", ("gather", "scatter", "index")),
    ("adaLN/modulate + layer norm", ("layer_norm",)),
    ("matmul", ("gemm", "nvjet", "cutlass", "xmma", "cublas", "aten::mm", "aten::addmm", "aten::bmm", "matmul")),
)
HOST_SYNCS = ("cudastreamsynchronize", "cudadevicesynchronize", "cudaeventsynchronize")  # .item() ends in the first


def category(name: str) -> str:
    name = name.lower()
    return next((c for c, keys in CATEGORIES if any(k in name for k in keys)), "other")


def annotation(event) -> bool:
    return getattr(event, "is_user_annotation", False) or event.key.startswith("## ") or "#" in event.key


def profile_step(step, device, top=15) -> dict:
    """One step under torch.profiler, summed by what limits a step: GPU time (CPU time on a CPU) per category
    of CATEGORIES, the kernels that compute in float32 (GPU only, by name: `..._f32...`, the block after a route's
    attention and TF32 matmuls), host syncs (GPU only), the share of the step's wall time the GPU was busy, and the
    top kernels."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    sync(device)
    t0 = time.perf_counter()
    with profile(activities=activities) as prof:
        step()
        sync(device)
    wall = time.perf_counter() - t0
    if cuda:  # kernels: their own time; not the annotations spanning them ("## Call CompiledFxGraph ##",
        # "Optimizer.step#AdamW.step"), which would count the same kernels twice
        rows = [(a.key, a.self_device_time_total, a.count) for a in prof.key_averages()
                if a.device_type == torch.autograd.DeviceType.CUDA and not annotation(a)]
    else:
        rows = [(a.key, a.self_cpu_time_total, a.count) for a in prof.key_averages()]
    by_category = {}
    for name, us, _ in rows:
        by_category[category(name)] = by_category.get(category(name), 0.0) + us / 1e3
    fp32 = sum(us for name, us, _ in rows if "f32" in name.lower()) / 1e3 if cuda else None
    syncs = sum(e.name.lower() in HOST_SYNCS for e in prof.events()) - 1 if cuda else None  # less our closing sync
    busy = sum(us for _, us, _ in rows) / 1e3
    return dict(wall_ms=wall * 1e3, busy_ms=busy, busy_share=busy / (wall * 1e3),
                ms_by_category=dict(sorted(by_category.items(), key=lambda kv: -kv[1])), fp32_kernel_ms=fp32,
                host_syncs=syncs, top=[dict(name=n[:120], ms=us / 1e3, count=c)
                                       for n, us, c in sorted(rows, key=lambda r: -r[1])[:top]])
