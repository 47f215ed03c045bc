"""Benchmarks: training-step time of DiT against TREAD, measured against the FLOP-count bound.

    python bench.py --backbones DiT-S/2 DiT-B/2 --batch-sizes 8 --out docs/perf/cpu.json
    python bench.py --backbones DiT-XL/2 --batch-sizes 256 --dtype bf16 --compile   # one GPU

Sections (`--sections`): training (above), sampling (EDM Heun images/s and network evaluations per
image, unguided / CFG / CFG inside a guidance interval) and evaluator (Inception images/s).

For every backbone x batch size x {dit, tread} it times full training steps (EDM loss forward,
backward, AdamW step), and reports images/s, peak memory, the training-step FLOPs
(torch.utils.flop_counter), model-FLOP utilisation against a matmul ceiling measured on the same
device in the same run, and for TREAD the measured speed-up next to the FLOP bound.
The route is 2 -> depth-4 at ratio 0.5 (2 -> 8 for 12 blocks, 2 -> 24 for DiT-XL).
"""
import argparse
import json
import resource
import statistics
import time
from pathlib import Path

import torch

from dit import get_model
from edm import EDMLoss, EDMPrecond
from flops import training_step_flops

IMAGENET_LATENT = dict(num_classes=1000, in_channels=4, input_size=32)
DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def matmul_ceiling(device, dtype, size=None, iters=10) -> float:
    """Achieved FLOP/s of a large square matmul: the practical peak this device reaches."""
    size = size or (8192 if device.type == "cuda" else 1024)
    dt = dtype or torch.float32
    a, b = torch.randn(size, size, device=device, dtype=dt), torch.randn(size, size, device=device, dtype=dt)
    for _ in range(2):
        a @ b
    sync(device)
    t0 = time.perf_counter()
    for _ in range(iters):
        a @ b
    sync(device)
    return 2 * size ** 3 * iters / (time.perf_counter() - t0)


def peak_memory_mb(device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2 ** 20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # process peak RSS (Linux: KiB)


def model_params(backbone, routed, ratio=0.5):
    routes = [dict(start_layer_idx=2, end_layer_idx=-4, selection_ratio=ratio)]
    return dict(IMAGENET_LATENT, enable_routing=routed, routes=routes)


def time_training_step(backbone, batch, routed, device, dtype, steps, warmup, compile_model=False):
    """Median seconds per training step over `steps` timed steps."""
    torch.manual_seed(0)
    model = get_model(backbone, model_params(backbone, routed)).to(device).train()
    net = EDMPrecond(model)
    if compile_model:
        net.model = torch.compile(model)
    loss_fn = EDMLoss()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    x = torch.randn(batch, 4, 32, 32, device=device)
    y = torch.randint(0, 1000, (batch,), device=device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for i in range(warmup + steps):
        sync(device)
        t0 = time.perf_counter()
        with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
            loss = loss_fn(net, x, y).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sync(device)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return statistics.median(times), peak_memory_mb(device)


def bench_training(args, device, dtype, ceiling):
    rows = []
    for backbone in args.backbones:
        for batch in args.batch_sizes:
            flops = {routed: training_step_flops(backbone, model_params(backbone, routed), batch, routing=routed)
                     for routed in (False, True)}
            result = {}
            for routed in (False, True):
                sec, mem = time_training_step(backbone, batch, routed, device, dtype, args.steps, args.warmup,
                                              args.compile)
                result[routed] = sec
                rows.append(dict(backbone=backbone, batch=batch, model="tread" if routed else "dit",
                                 step_s=sec, images_per_s=batch / sec, peak_mem_mb=mem,
                                 flops_per_step=flops[routed], mfu=flops[routed] / sec / ceiling))
            bound = flops[False] / flops[True]
            measured = result[False] / result[True]
            rows[-1].update(flop_bound=bound, speedup=measured, speedup_vs_bound=measured / bound)
            print(f"{backbone} batch {batch}: dit {result[False] * 1e3:.1f} ms, tread {result[True] * 1e3:.1f} ms "
                  f"-> speed-up {measured:.3f}x, FLOP bound {bound:.3f}x, ratio {measured / bound:.3f}", flush=True)
    return rows


GUIDANCE = {"unguided": None, "cfg": dict(scale=1.5), "cfg+interval": dict(scale=1.5, interval=(0.28, 5.42))}


@torch.no_grad()
def bench_sampling(args, device, dtype):
    """Images/s and backbone evaluations per image of EDM Heun sampling, unguided and with CFG."""
    from edm import edm_sampler
    from edm.guidance import ClassifierFreeGuidance, NFECounter

    rows = []
    for backbone in args.backbones:
        torch.manual_seed(0)
        model = get_model(backbone, model_params(backbone, True)).to(device).eval()
        counter = NFECounter(EDMPrecond(model))
        x = torch.randn(args.sample_batch, 4, 32, 32, device=device)
        y = torch.randint(0, 1000, (args.sample_batch,), device=device)
        for name, guide in GUIDANCE.items():
            net = counter if guide is None else ClassifierFreeGuidance(counter, guide["scale"], 1000,
                                                                       interval=guide.get("interval"))
            counter.num_rows = 0
            sync(device)
            t0 = time.perf_counter()
            with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
                edm_sampler(net, x, y, num_steps=args.sample_steps)
            sync(device)
            sec = time.perf_counter() - t0
            rows.append(dict(backbone=backbone, guidance=name, batch=args.sample_batch, num_steps=args.sample_steps,
                             images_per_s=args.sample_batch / sec, nfe_per_image=counter.num_rows / args.sample_batch))
            print(f"sampling {backbone} {name}: {rows[-1]['images_per_s']:.3f} images/s, "
                  f"{rows[-1]['nfe_per_image']:.0f} NFE/image", flush=True)
    return rows


@torch.no_grad()
def bench_evaluator(args, device):
    """Inception feature extraction (the evaluator's cost per image), a randomly initialised network of the
    exact FID Inception shape on 256x256 uint8 images."""
    from evaluations.inception import load_inception

    net = load_inception(device=device, random_init=True)
    images = torch.randint(0, 256, (args.eval_batch, 256, 256, 3), dtype=torch.uint8, device=device)
    net(images[:2])
    sync(device)
    t0 = time.perf_counter()
    for _ in range(args.eval_batches):
        net(images)
    sync(device)
    rate = args.eval_batch * args.eval_batches / (time.perf_counter() - t0)
    print(f"evaluator: {rate:.1f} images/s (Inception features, batch {args.eval_batch})", flush=True)
    return [dict(batch=args.eval_batch, images_per_s=rate)]


def markdown_table(rows, device_name, dtype_name, ceiling):
    lines = [f"Device: {device_name}, {dtype_name}, matmul ceiling {ceiling / 1e12:.2f} TFLOP/s (measured).", "",
             "| backbone | batch | model | step (ms) | images/s | peak mem (MB) | GFLOP/step | MFU | speed-up | "
             "FLOP bound | speed-up / bound |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        extra = (f"{r['speedup']:.3f}x | {r['flop_bound']:.3f}x | {r['speedup_vs_bound']:.3f}" if "speedup" in r
                 else " | | ")
        lines.append(f"| {r['backbone']} | {r['batch']} | {r['model']} | {r['step_s'] * 1e3:.1f} | "
                     f"{r['images_per_s']:.1f} | {r['peak_mem_mb']:.0f} | {r['flops_per_step'] / 1e9:.1f} | "
                     f"{r['mfu']:.1%} | {extra} |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backbones", nargs="+", default=["DiT-S/2", "DiT-B/2"])
    parser.add_argument("--batch-sizes", nargs="+", type=int, default=[8])
    parser.add_argument("--steps", type=int, default=5, help="timed steps (median reported)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--dtype", choices=list(DTYPES), default="fp32", help="autocast dtype")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--compile", action="store_true", help="torch.compile the backbone")
    parser.add_argument("--out", type=Path, default=None, help="write rows as JSON here (and a .md beside it)")
    parser.add_argument("--sections", nargs="+", default=["training", "sampling", "evaluator"],
                        choices=["training", "sampling", "evaluator"])
    parser.add_argument("--sample-batch", type=int, default=8)
    parser.add_argument("--sample-steps", type=int, default=40, help="EDM Heun steps (NFE 2N-1 unguided)")
    parser.add_argument("--eval-batch", type=int, default=64)
    parser.add_argument("--eval-batches", type=int, default=2)
    args = parser.parse_args()
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          "cpu" if args.device == "auto" else args.device)
    dtype = DTYPES[args.dtype]
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else \
        f"CPU ({torch.get_num_threads()} threads)"
    ceiling = matmul_ceiling(device, dtype)
    print(f"{device_name}: matmul ceiling {ceiling / 1e12:.3f} TFLOP/s ({args.dtype})", flush=True)
    result = dict(device=device_name, dtype=args.dtype, matmul_ceiling=ceiling, torch=torch.__version__)
    table = ""
    if "training" in args.sections:
        result["training"] = bench_training(args, device, dtype, ceiling)
        table = markdown_table(result["training"], device_name, args.dtype, ceiling)
    if "sampling" in args.sections:
        result["sampling"] = bench_sampling(args, device, dtype)
        table += "\n\n| backbone | guidance | batch | Heun steps | images/s | NFE/image |\n|---|---|---|---|---|---|\n"
        table += "\n".join(f"| {r['backbone']} | {r['guidance']} | {r['batch']} | {r['num_steps']} | "
                           f"{r['images_per_s']:.3f} | {r['nfe_per_image']:.0f} |" for r in result["sampling"])
    if "evaluator" in args.sections:
        result["evaluator"] = bench_evaluator(args, device)
        table += f"\n\nEvaluator (Inception features): {result['evaluator'][0]['images_per_s']:.1f} images/s"
    print(table)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2))
        args.out.with_suffix(".md").write_text(table + "\n")


if __name__ == "__main__":
    main()
