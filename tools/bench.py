"""Benchmarks: training-step time of DiT against TREAD, measured against the FLOP-count bound.

    python -m tools.bench --backbones DiT-S/2 DiT-B/2 --batch-sizes 8 --compile both --paper-code ../tread \
        --out docs/perf/cpu.json
    python -m tools.bench --backbones DiT-XL/2 --batch-sizes 256 --dtype bf16 --compile --sections training  # one GPU
    python -m tools.bench --backbones DiT-B/2 --dtype bf16 --sections fid suite   # FID-5K, ADM suite on 50K

Sections (`--sections`): training (below); sampling (EDM Heun images/s and network evaluations per
image, unguided / CFG / CFG inside a guidance interval); evaluator (Inception images/s); suite (the
ADM evaluator end to end on 50K samples, with its peak host memory), metrics (its metric stage alone
on random features) and fid (in-training FID on 5K samples, stage by stage), all in tools/bench_evaluation.py;
loader (the training data loader alone, samples/s) in tools/bench_loader.py.

For every backbone x batch size x {dit, tread} it times full training steps (EDM loss forward,
backward, AdamW step), and reports images/s, peak memory, the training-step FLOPs
(torch.utils.flop_counter), model-FLOP utilisation against a matmul ceiling measured on the same
device in the same run, and for TREAD the measured speed-up next to the FLOP bound.
The route is 2 -> depth-4 at ratio 0.5 (2 -> 8 for 12 blocks, 2 -> 24 for DiT-XL).
With `--paper-code DIR` (a clone of github.com/CompVis/tread, never copied here) the paper's own DiT
is timed in the same run on the same model, batch and data, after checking that it computes our
function (tools/paper_code.py). Each variant is built, compiled and timed alone (the others freed, dynamo
reset), so its peak memory is its own and no compiled variant can fall back to eager unnoticed.
"""
import argparse
import contextlib
import functools
import gc
import json
import statistics
import time
from pathlib import Path

import torch
from torch._dynamo.utils import counters

from dit import DiT_models, get_model
from edm import EDMLoss, EDMPrecond, edm_sampler
from edm.guidance import ClassifierFreeGuidance, NFECounter
from tools.bench_evaluation import (IMAGENET_LATENT, bench_evaluator, bench_metrics, bench_suite, bench_training_fid,
                                    peak_rss_mb, sync)
from tools.bench_loader import add_loader_args, bench_loader
from tools.paper_code import build_paper_model, eager_context, load_our_weights, load_paper_dit
from training.flops import training_step_flops
from training.loop import build_adamw
from tread_utils.errors import UserError, report_user_errors
from tread_utils.cli import ArgumentParser, positive_int
from tread_utils.precision import precision_policy, set_precision_policy

DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def matmul_ceiling(device, dtype, size=None, min_seconds=0.5, trials=3) -> float:
    """Achieved FLOP/s of a large square matmul, the practical peak of this device: the best of `trials`
    timings, each repeated until at least `min_seconds` of work is timed (CUDA events on a GPU), after a
    warm-up. One timing on a CPU whose clock or neighbours vary can come out low (a CPU table once showed
    MFU above 100%); the best of several is the ceiling's estimate, and CPU tables mark MFU as indicative."""
    size = size or (8192 if device.type == "cuda" else 1024)
    dt = dtype or torch.float32
    a, b = torch.randn(size, size, device=device, dtype=dt), torch.randn(size, size, device=device, dtype=dt)
    for _ in range(3):
        a @ b
    best = 0.0
    for _ in range(trials):
        iters, seconds = 1, 0.0
        while seconds < min_seconds:
            iters *= 2
            seconds = timed(device, lambda: [a @ b for _ in range(iters)])
        best = max(best, 2 * size ** 3 * iters / seconds)
    return best


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


def model_params(backbone, routed, ratio=0.5):
    routes = [dict(start_layer_idx=2, end_layer_idx=-4, selection_ratio=ratio)]
    return dict(IMAGENET_LATENT, enable_routing=routed, routes=routes)


def training_step(model, batch, device, dtype, context=contextlib.nullcontext):
    """A closure running one full training step of `model` (EDM loss, backward, AdamW) on fixed data."""
    net, loss_fn = EDMPrecond(model), EDMLoss()
    optimizer = build_adamw([p for p in model.parameters() if p.requires_grad])
    x = torch.randn(batch, 4, 32, 32, device=device)
    y = torch.randint(0, 1000, (batch,), device=device)

    def step():
        with context():
            with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
                loss = loss_fn(net, x, y).mean()
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def time_alone(build, steps, warmup, device) -> dict:
    """Builds one variant with every other one freed, warms it up (compilation happens here), then times
    `steps` steps: median seconds per step, peak memory of this variant alone, and what dynamo did (reset
    first, so a compiled variant can never fall back to eager on an earlier variant's recompile limit)."""
    torch._dynamo.reset()
    counters.clear()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
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


def our_model(backbone, routed, device, mode):
    torch.manual_seed(0)
    model = get_model(backbone, model_params(backbone, routed)).to(device).train()
    return torch.compile(model) if mode == "compiled" else model


def paper_twin(paper_dit, backbone, ours, routed):
    """The paper's DiT for `backbone` holding the weights of our model `ours` (their pos_embed is
    computed identically)."""
    theirs = build_paper_model(paper_dit, backbone, DiT_models[backbone]["depth"], routed, **IMAGENET_LATENT)
    load_our_weights(theirs, ours)
    return theirs


@torch.no_grad()
def paper_output_difference(paper_dit, backbone):
    """Max |ours - theirs| of one inference forward with equal (perturbed, so non-trivial) weights: the
    comparison is only meaningful if both compute the same function."""
    torch.manual_seed(0)
    ours = get_model(backbone, model_params(backbone, False)).eval()
    for p in ours.parameters():
        p.add_(0.02 * torch.randn_like(p))
    theirs = paper_twin(paper_dit, backbone, ours, routed=False).eval()
    x, t, y = torch.randn(2, 4, 32, 32), torch.randn(2), torch.tensor([0, 999])
    with eager_context(hasattr(torch.compiler, "set_stance")):  # eager where torch can switch compilation off
        return (ours(x, t, y) - theirs(x, t, y)).abs().max().item()


def training_variants(args):
    """(code, mode) pairs to time: ours eager and/or compiled, the paper's as published and/or eager."""
    ours = {"off": ["eager"], "on": ["compiled"], "both": ["eager", "compiled"]}[args.compile]
    return [("ours", m) for m in ours] + [("paper", m) for m in (args.paper_modes if args.paper_code else [])]


def variant_builder(args, paper_dit, backbone, routed, code, mode, batch, device, dtype):
    def build():
        if code == "ours":
            model, context = our_model(backbone, routed, device, mode), contextlib.nullcontext
        else:
            ours = our_model(backbone, routed, "cpu", "eager")  # same initial weights
            model = paper_twin(paper_dit, backbone, ours, routed).to(device).train()
            context = functools.partial(eager_context, mode == "eager")
        return training_step(model, batch, device, dtype, context)

    return build


def bench_training(args, device, dtype, ceiling, paper_dit=None):
    rows = []
    for backbone in args.backbones:
        paper_diff = paper_output_difference(paper_dit, backbone) if paper_dit else None
        if paper_dit:
            print(f"{backbone}: paper code vs ours, max |output difference| {paper_diff:.2e}", flush=True)
        for batch in args.batch_sizes:
            flops = {routed: training_step_flops(backbone, model_params(backbone, routed), batch, routing=routed)
                     for routed in (False, True)}
            sec = {}
            for code, mode in training_variants(args):
                for routed in (False, True):
                    build = variant_builder(args, paper_dit, backbone, routed, code, mode, batch, device, dtype)
                    measured = time_alone(build, args.steps, args.warmup, device)
                    if mode == "compiled" and measured["graphs"] == 0:
                        raise RuntimeError(f"{backbone} {code} {mode}: dynamo compiled no graph (eager fallback)")
                    sec[code, mode, routed] = s = measured["step_s"]
                    rows.append(dict(backbone=backbone, batch=batch, code=code, mode=mode,
                                     model="tread" if routed else "dit", images_per_s=batch / s,
                                     flops_per_step=flops[routed], mfu=flops[routed] / s / ceiling, **measured))
                    if code == "paper":
                        rows[-1]["max_abs_output_difference"] = paper_diff
                    print(f"{backbone} batch {batch} {code} {mode} {'tread' if routed else 'dit'}: "
                          f"{s * 1e3:.1f} ms, MFU {flops[routed] / s / ceiling:.1%}, "
                          f"{measured['peak_mem_mb'] / 1024:.1f} GiB, {measured['graphs']} graph(s), "
                          f"{measured['recompiles_while_timed']} recompile(s) while timed", flush=True)
            bound = flops[False] / flops[True]
            for row in rows:
                if row["backbone"] == backbone and row["batch"] == batch and row["model"] == "tread":
                    speedup = sec[row["code"], row["mode"], False] / row["step_s"]
                    row.update(flop_bound=bound, speedup=speedup, speedup_vs_bound=speedup / bound)
                    print(f"{backbone} batch {batch} {row['code']} {row['mode']}: speed-up {speedup:.3f}x, "
                          f"FLOP bound {bound:.3f}x, ratio {speedup / bound:.3f}", flush=True)
    order = {v: i for i, v in enumerate(training_variants(args))}
    rows.sort(key=lambda r: (args.backbones.index(r["backbone"]), r["batch"], order[r["code"], r["mode"]]))
    return rows


GUIDANCE = {"unguided": None, "cfg": dict(scale=1.5), "cfg+interval": dict(scale=1.5, interval=(0.28, 5.42))}


@torch.no_grad()
def bench_sampling(args, device, dtype):
    """Images/s and backbone evaluations per image of EDM Heun sampling, unguided and with CFG."""

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


def markdown_table(rows, device_name, dtype_name, ceiling):
    memory = ("peak memory per variant" if "CPU" not in device_name else
              "peak memory is the process's peak RSS so far, not per variant; MFU on a CPU is indicative only "
              "(the ceiling of a shared CPU varies from run to run; above 100% means it was under-measured)")
    lines = [f"Device: {device_name}, {dtype_name}, matmul ceiling {ceiling / 1e12:.2f} TFLOP/s (measured); {memory}.",
             "",
             "| backbone | batch | code | mode | model | step (ms) | images/s | peak mem (MB) | GFLOP/step | MFU | "
             "speed-up | FLOP bound | speed-up / bound |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        extra = (f"{r['speedup']:.3f}x | {r['flop_bound']:.3f}x | {r['speedup_vs_bound']:.3f}" if "speedup" in r
                 else " | | ")
        lines.append(f"| {r['backbone']} | {r['batch']} | {r['code']} | {r['mode']} | {r['model']} | "
                     f"{r['step_s'] * 1e3:.1f} | {r['images_per_s']:.1f} | {r['peak_mem_mb']:.0f} | "
                     f"{r['flops_per_step'] / 1e9:.1f} | {r['mfu']:.1%} | {extra} |")
    return "\n".join(lines) + paper_comparison_table(rows)


def paper_comparison_table(rows):
    """Our fastest step against the paper code's fastest, per backbone x batch x model (> 1: ours faster)."""
    groups = {}
    for r in rows:
        groups.setdefault((r["backbone"], r["batch"], r["model"]), {}).setdefault(r["code"], []).append(r)
    lines = []
    for (backbone, batch, model), by_code in groups.items():
        if "paper" not in by_code or "ours" not in by_code:
            continue
        ours, paper = (min(by_code[c], key=lambda r: r["step_s"]) for c in ("ours", "paper"))
        lines.append(f"| {backbone} | {batch} | {model} | {ours['step_s'] * 1e3:.1f} ({ours['mode']}) | "
                     f"{paper['step_s'] * 1e3:.1f} ({paper['mode']}) | {paper['step_s'] / ours['step_s']:.2f}x | "
                     f"{paper['max_abs_output_difference']:.1e} |")
    if not lines:
        return ""
    return ("\n\nSame run, same model, batch and data: our fastest step against the paper code's fastest "
            "(> 1x: ours is faster).\n\n| backbone | batch | model | ours (ms) | paper code (ms) | paper / ours | "
            "max abs output difference |\n|---|---|---|---|---|---|---|\n" + "\n".join(lines))


def simple_table(header, rows, cells):
    """Markdown: the `header` names, then one line of `cells(row)` strings per row."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(cells(r)) + " |" for r in rows])


def sampling_table(rows):
    return simple_table(("backbone", "guidance", "batch", "Heun steps", "images/s", "NFE/image"), rows, lambda r: (
        r["backbone"], r["guidance"], str(r["batch"]), str(r["num_steps"]), f"{r['images_per_s']:.3f}",
        f"{r['nfe_per_image']:.0f}"))


def suite_table(rows):
    return "ADM suite (`python -m evaluations.evaluator`, one process, start-up included):\n\n" + simple_table(
        ("samples", "reference images", "batch", "seconds", "images/s", "peak host memory (MB)"), rows, lambda r: (
            str(r["samples"]), str(r["reference"]), str(r["batch"]), f"{r['seconds']:.1f}",
            f"{r['images_per_s']:.1f}", f"{r['peak_host_mb']:.0f}"))


def metrics_table(rows):
    return "ADM metric stage alone (random features, own process):\n\n" + simple_table(
        ("samples", "reference", "seconds", "peak host memory (MB)"), rows, lambda r: (
            str(r["samples"]), str(r["reference"]), f"{r['seconds']:.1f}", f"{r['peak_host_mb']:.0f}"))


def training_fid_table(rows):
    return ("In-training FID (EDM Heun, unguided; SD-VAE decoding; Inception; Frechet distance):\n\n" +
            simple_table(("backbone", "samples", "Heun steps", "total (s)", "sampling (s)", "decoding (s)",
                          "Inception (s)", "FID (s)"), rows, lambda r: (
                r["backbone"], str(r["samples"]), str(r["heun_steps"]),
                *(f"{r[k]:.1f}" for k in ("seconds", "sampling_s", "decoding_s", "features_s", "fid_s")))))


def loader_table(rows):
    return "Data loader alone:\n\n" + simple_table(("data", "workers", "batch", "samples/s", "first batch (s)"), rows,
                                                     lambda r: (r["path"], str(r["workers"]), str(r["batch"]),
                                                                f"{r['samples_per_s']:.0f}", f"{r['first_batch_s']:.2f}"))


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backbones", nargs="+", default=["DiT-S/2", "DiT-B/2"])
    parser.add_argument("--batch-sizes", nargs="+", type=positive_int, default=[8])
    parser.add_argument("--steps", type=positive_int, default=5, help="timed steps (median reported)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first (compilation happens here)")
    parser.add_argument("--dtype", choices=list(DTYPES), default="fp32", help="autocast dtype")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--tf32", choices=["on", "off"], default="on", help="train.tf32 / sample.py tf32 (default on)")
    parser.add_argument("--compile", nargs="?", const="on", default="off", choices=["off", "on", "both"],
                        help="torch.compile our backbone (`--compile` = on; `both` times eager and compiled)")
    parser.add_argument("--paper-code", type=Path, default=None,
                        help="folder of a clone of github.com/CompVis/tread: time the paper's DiT in the same run")
    parser.add_argument("--paper-modes", nargs="+", default=["published", "eager"], choices=["published", "eager"],
                        help="the paper's blocks with their @torch.compile (published) and/or run eagerly")
    parser.add_argument("--out", type=Path, default=None,
                        help="write results as JSON here (and a .md beside it), rewritten after every section")
    parser.add_argument("--sections", nargs="+", default=["training", "sampling", "evaluator"],
                        choices=["training", "sampling", "evaluator", "suite", "metrics", "fid", "loader"])
    parser.add_argument("--sample-batch", type=positive_int, default=8)
    parser.add_argument("--sample-steps", type=int, default=40, help="EDM Heun steps (NFE 2N-1 unguided)")
    parser.add_argument("--eval-batch", type=positive_int, default=64)
    parser.add_argument("--eval-batches", type=int, default=2)
    parser.add_argument("--suite-samples", type=int, default=50_000, help="suite, metrics: sample images")
    parser.add_argument("--suite-ref", type=int, default=10_000, help="suite, metrics: reference images (ADM's)")
    parser.add_argument("--suite-batch", type=positive_int, default=250, help="suite: evaluator --batch-size")
    parser.add_argument("--tmp-dir", default=None, help="suite: where the random batches are written")
    parser.add_argument("--fid-samples", type=positive_int, default=5_000, help="fid: samples (train.eval default)")
    parser.add_argument("--fid-steps", type=positive_int, default=40, help="fid: EDM Heun steps")
    parser.add_argument("--fid-batch", type=positive_int, default=256, help="fid: sampling / decoding / Inception batch")
    parser.add_argument("--vae", default="random",
                        help="fid: 'random' (the SD-VAE architecture, random weights) or a diffusers repo id / folder")
    add_loader_args(parser)
    return parser


def parse_args(argv=None):
    """The options, checked (backbones, suite sizes) before anything is timed."""
    args = build_parser().parse_args(argv)
    unknown = [b for b in args.backbones if b not in DiT_models]
    if unknown:
        raise UserError(f"unknown backbone(s) {', '.join(unknown)}; choose from {', '.join(DiT_models)}")
    if min(args.suite_samples, args.suite_ref) < 4:
        raise UserError("--suite-samples and --suite-ref must be >= 4 (precision/recall needs k + 1 = 4 images)")
    return args


@report_user_errors
def main():
    args = parse_args()
    paper_dit = load_paper_dit(args.paper_code) if args.paper_code else None
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          "cpu" if args.device == "auto" else args.device)
    dtype = DTYPES[args.dtype]
    set_precision_policy(args.tf32 == "on")  # the trainer's policy (train.tf32), so timings describe it
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else \
        f"CPU ({torch.get_num_threads()} threads)"
    ceiling = matmul_ceiling(device, dtype)
    print(f"{device_name}: matmul ceiling {ceiling / 1e12:.3f} TFLOP/s ({args.dtype})", flush=True)
    result = dict(device=device_name, dtype=args.dtype, matmul_ceiling=ceiling, torch=torch.__version__,
                  precision=precision_policy())
    sections = {
        "training": (lambda: bench_training(args, device, dtype, ceiling, paper_dit),
                     lambda rows: markdown_table(rows, device_name, args.dtype, ceiling)),
        "sampling": (lambda: bench_sampling(args, device, dtype), sampling_table),
        "evaluator": (lambda: bench_evaluator(args, device),
                      lambda rows: f"Evaluator (Inception features): {rows[0]['images_per_s']:.1f} images/s"),
        "suite": (lambda: bench_suite(args, device), suite_table),
        "metrics": (lambda: bench_metrics(args, device), metrics_table),
        "fid": (lambda: bench_training_fid(args, device, dtype), training_fid_table),
        "loader": (lambda: bench_loader(args), loader_table),
    }
    tables = []
    for name in args.sections:
        run, table = sections[name]
        result[name] = run()
        tables.append(table(result[name]))
        if args.out:  # partial results survive a later section's failure or a lost machine
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(result, indent=2))
            args.out.with_suffix(".md").write_text("\n\n".join(tables) + "\n")
    print("\n\n".join(tables))


if __name__ == "__main__":
    main()
