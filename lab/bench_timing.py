"""How lab/bench.py times a variant on a device: the matmul ceiling MFU is measured against, CUDA-event timing,
peak memory, and one variant built and timed alone, its out-of-memory failure caught and its memory freed."""
import functools
import gc
import statistics
import time

import torch
from torch._dynamo.utils import counters

from lab.bench_evaluation import peak_rss_mb, sync


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


def time_alone(build, steps, warmup, device) -> dict:
    """Builds one variant with every other one freed, warms it up (compilation happens here), then times
    `steps` steps: median seconds per step, peak memory of this variant alone, and what dynamo did (reset
    first, so a compiled variant can never fall back to eager on an earlier variant's recompile limit)."""
    torch._dynamo.reset()
    counters.clear()
    release_memory(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    step = build()
    for _ in range(warmup):
        step()
    sync(device)
    compiled = dict(frames=int(counters["frames"]["total"]), graphs=int(counters["stats"]["unique_graphs"]),
                    graph_breaks=int(sum(counters["graph_break"].values())))
    times = [timed(device, step) for _ in range(steps)]
    compiled["recompiles_while_timed"] = int(counters["frames"]["total"]) - compiled["frames"]
    result = dict(step_s=statistics.median(times), peak_mem_mb=peak_memory_mb(device), **compiled)
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


def time_or_out_of_memory(build, steps, warmup, device) -> dict:
    """`time_alone`, or {"oom": True, "error": its first line} when the variant runs out of memory; either way
    its memory is freed before the next variant (the exception, and with it the frames holding the model,
    is dropped first)."""
    try:
        return time_alone(build, steps, warmup, device)
    except Exception as e:
        if not out_of_memory(e):
            raise
        error = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
    torch._dynamo.reset()
    peak = peak_memory_mb(device)
    release_memory(device)
    return dict(oom=True, error=error, peak_mem_mb=peak)
