"""Benchmarks: training-step time of DiT against TREAD, measured against the FLOP-count bound.

    python -m lab.bench --backbones DiT-S/2 DiT-B/2 --batch-sizes 8 --compile both --paper-code ../tread \
        --out docs/perf/cpu.json
    python -m lab.bench --backbones DiT-XL/2 --batch-sizes 256 --dtype bf16 --compile --fp32-after-route both \
        --sections training  # one GPU
    python -m lab.bench --backbones DiT-B/2 --dtype bf16 --sections fid suite   # FID-5K, ADM suite on 50K

Sections (`--sections`): training (below; lab/bench_training.py); sampling (EDM Heun images/s and network
evaluations per image, unguided / CFG / CFG inside a guidance interval); evaluator (Inception images/s); suite
(the ADM evaluator end to end on 50K samples, with its peak host memory), metrics (its metric stage alone on
random features) and fid (in-training FID on 5K samples, stage by stage), all in lab/bench_evaluation.py;
loader (the training data loader alone, samples/s) in lab/bench_loader.py.

For every backbone x batch size x {dit, tread} it times full training steps (EDM loss forward,
backward, AdamW step), and reports images/s, peak memory, the training-step FLOPs
(torch.utils.flop_counter), model-FLOP utilisation against a matmul ceiling measured on the same
device in the same run, and for TREAD the measured speed-up next to the FLOP bound.
The route is 2 -> depth-4 at ratio 0.5 (2 -> 8 for 12 blocks, 2 -> 24 for DiT-XL).
With `--paper-code DIR` (a clone of github.com/CompVis/tread, never copied here) the paper's own DiT
is timed in the same run on the same model, batch and data, after checking that it computes our
function (lab/paper_code.py). Each variant is built, compiled and timed alone (the others freed, dynamo
reset), so its peak memory is its own and no compiled variant can fall back to eager unnoticed; a variant
that runs out of memory is recorded as such (`"oom": true` with its batch and micro-batch) and the next one
runs. `--micro-batch` accumulates gradients (DiT-L/2 and DiT-XL/2 do by default above 128), `--grad-checkpointing`
recomputes each block's forward (MFU counts model FLOPs; HFU adds the recomputation), `--fp32-after-route
both` times TREAD with and without the authors' float32 block after the route, `--compile-scope` what
our compiled variants compile (train.compile_scope: the whole model, each block alone, or both, each a variant
of its own; `warmup_s` in the record, the first `--warmup` steps, holds the compilation), `--compile-dynamic`
their shapes (train.compile_dynamic), `--compile-mode` picks torch.compile's mode, `--profile` records where one
more step of each of our variants spends its time (kernel categories, top kernels, host syncs;
lab/bench_timing.py).
"""
import argparse
import functools
import json
import sys
import time
import traceback
from pathlib import Path

import torch

from dit import DiT_models, get_model
from edm import EDMPrecond, edm_sampler
from edm.guidance import ClassifierFreeGuidance, NFECounter
from lab.bench_evaluation import bench_evaluator, bench_metrics, bench_suite, bench_training_fid, sync
from lab.bench_loader import add_loader_args, bench_loader
from lab.bench_tables import (loader_table, metrics_table, sampling_table, suite_table, training_fid_table,
                                training_table)
from lab.bench_timing import matmul_ceiling
from lab.bench_training import (AUTO_MICRO_BATCH, COMPILE_DYNAMIC, COMPILE_SCOPES, FP32_AFTER_ROUTE, bench_training,
                                compile_model, model_params)
from lab.paper_code import load_paper_dit
from tread_utils.attention import BACKENDS, DEFAULT as DEFAULT_ATTENTION, FLOAT32, use_attention
from tread_utils.errors import UserError, report_user_errors
from tread_utils.cli import ArgumentParser, positive_int
from tread_utils.precision import avoid_faulting_attention, precision_policy, set_precision_policy

DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


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
                             attention=args.attention, images_per_s=args.sample_batch / sec,
                             nfe_per_image=counter.num_rows / args.sample_batch))
            print(f"sampling {backbone} {name}: {rows[-1]['images_per_s']:.3f} images/s, "
                  f"{rows[-1]['nfe_per_image']:.0f} NFE/image", flush=True)
    return rows


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backbones", nargs="+", default=["DiT-S/2", "DiT-B/2"])
    parser.add_argument("--batch-sizes", nargs="+", type=positive_int, default=[8])
    parser.add_argument("--micro-batch", type=positive_int, default=None,
                        help="training: accumulate gradients over micro-batches of this size up to each batch size "
                             "(one AdamW step per batch; MFU counts the whole step). Default: the whole batch, except "
                             f"{', '.join(f'{b} above {n}' for b, n in AUTO_MICRO_BATCH.items())} (micro-batches of "
                             "at most that size), so batch 256 fits one 80 GB GPU")
    parser.add_argument("--grad-checkpointing", action="store_true",
                        help="training: activation checkpointing of every block (model.params.grad_checkpointing); "
                             "MFU counts the model's FLOPs, HFU adds the recomputed forward")
    parser.add_argument("--fp32-after-route", choices=sorted(FP32_AFTER_ROUTE), default="on",
                        help="training: time tread with the block after its route in float32 (on, the authors' "
                             "numerics, default), under autocast like the others (off), or both")
    parser.add_argument("--profile", action="store_true",
                        help="training: after timing each of our variants, run one more step under torch.profiler "
                             "and record where its time went (JSON: the variant's `profile`)")
    parser.add_argument("--steps", type=positive_int, default=5, help="timed steps (median reported)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first (compilation happens here)")
    parser.add_argument("--dtype", choices=list(DTYPES), default="fp32", help="autocast dtype")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--tf32", choices=["on", "off"], default="on", help="train.tf32 / sample.py tf32 (default on)")
    parser.add_argument("--keep-cudnn-attention", action="store_true",
                        help="train.keep_cudnn_attention=true: keep cuDNN's fused attention where the trainer turns "
                             "it off (tread_utils.precision.cudnn_attention_faults)")
    parser.add_argument("--attention", choices=list(BACKENDS), default=DEFAULT_ATTENTION,
                        help="train.attention: the attention kernels of our model's blocks (tread_utils/attention.py; "
                             "the paper code's stay torch's choice); every row records it")
    parser.add_argument("--attention-fp32", choices=list(FLOAT32), default=DEFAULT_ATTENTION,
                        help="train.attention_fp32: our float32 attention's kernel (the block after a route); "
                             "training rows record it as `attention_fp32`")
    parser.add_argument("--compile", nargs="?", const="on", default="off", choices=["off", "on", "both"],
                        help="torch.compile our backbone (`--compile` = on; `both` times eager and compiled)")
    parser.add_argument("--compile-scope", choices=sorted(COMPILE_SCOPES), default="model",
                        help="training: what our compiled variants compile (train.compile_scope): the whole model "
                             "(default), each block alone, or both, timed as two variants (blocks first)")
    parser.add_argument("--compile-dynamic", choices=sorted(COMPILE_DYNAMIC), default="null",
                        help="training: train.compile_dynamic of our compiled variants (null: torch's default, "
                             "static until a shape changes, then dynamic; true; false: static, a graph per shape); "
                             "training rows record it as `compile_dynamic`")
    parser.add_argument("--compile-mode", default="default",
                        choices=["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"],
                        help="torch.compile mode of our backbone (training and --fid-compile; default: torch's)")
    parser.add_argument("--compile-backend", default="inductor",
                        help="torch.compile backend (default inductor; 'eager' traces with dynamo only, a quick "
                             "check of the compiled path on a CPU)")
    parser.add_argument("--paper-code", type=Path, default=None,
                        help="folder of a clone of github.com/CompVis/tread: time the paper's DiT in the same run")
    parser.add_argument("--paper-modes", nargs="+", default=["published", "eager"], choices=["published", "eager"],
                        help="the paper's blocks with their @torch.compile (published) and/or run eagerly")
    parser.add_argument("--out", type=Path, default=None,
                        help="write results as JSON here (and a .md beside it); the JSON is rewritten after every "
                             "variant and stage, so a run cut short leaves what it measured")
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
    parser.add_argument("--fid-batch", type=positive_int, default=256,
                        help="fid: sampling and Inception batch (the VAE decodes at most 64 at a time)")
    parser.add_argument("--fid-compile", action="store_true",
                        help="fid: compile the backbone for one batch shape (the last batch padded)")
    parser.add_argument("--vae", default="random",
                        help="fid: 'random' (the SD-VAE architecture, random weights) or a diffusers repo id / folder")
    add_loader_args(parser)
    return parser


def parse_args(argv=None):
    """The options, checked (backbones, suite sizes, micro-batches) before anything is timed."""
    args = build_parser().parse_args(argv)
    unknown = [b for b in args.backbones if b not in DiT_models]
    if unknown:
        raise UserError(f"unknown backbone(s) {', '.join(unknown)}; choose from {', '.join(DiT_models)}")
    if min(args.suite_samples, args.suite_ref) < 4:
        raise UserError("--suite-samples and --suite-ref must be >= 4 (precision/recall needs k + 1 = 4 images)")
    uneven = [b for b in args.batch_sizes if args.micro_batch and b % args.micro_batch]
    if uneven:
        raise UserError(f"--micro-batch {args.micro_batch} does not divide batch size(s) {uneven}; pass a divisor of "
                        f"every --batch-sizes value")
    if args.grad_checkpointing and args.paper_code:
        raise UserError("--grad-checkpointing applies to our model only (the paper's code has no such switch); "
                        "time the paper's code in a run without it")
    return args


def write_record(out, result, tables=None):
    """The JSON record (and the markdown tables, when given) as they stand."""
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2))
        if tables is not None:
            out.with_suffix(".md").write_text("\n\n".join(tables) + "\n")


@report_user_errors
def main():
    args = parse_args()
    paper_dit = load_paper_dit(args.paper_code) if args.paper_code else None
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          "cpu" if args.device == "auto" else args.device)
    dtype = DTYPES[args.dtype]
    set_precision_policy(args.tf32 == "on")  # the trainer's policy (train.tf32), so timings describe it
    attention = avoid_faulting_attention(args.keep_cudnn_attention, "--keep-cudnn-attention")  # as the trainer
    kernels = use_attention(args.attention, "--attention", device, args.attention_fp32)
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else \
        f"CPU ({torch.get_num_threads()} threads)"
    ceiling = matmul_ceiling(device, dtype)
    print(f"{device_name}: matmul ceiling {ceiling / 1e12:.3f} TFLOP/s ({args.dtype})", flush=True)
    for line in (attention, kernels):
        if line:
            print(line, flush=True)
    result = dict(device=device_name, dtype=args.dtype, matmul_ceiling=ceiling, torch=torch.__version__,
                  precision=precision_policy(), attention=attention, compile_mode=args.compile_mode,
                  compile_backend=args.compile_backend, grad_checkpointing=args.grad_checkpointing)
    sections = {
        "training": (lambda save: bench_training(args, device, dtype, ceiling, paper_dit, save),
                     lambda rows: training_table(rows, device_name, args.dtype, ceiling, args.grad_checkpointing)),
        "sampling": (lambda save: bench_sampling(args, device, dtype), sampling_table),
        "evaluator": (lambda save: bench_evaluator(args, device),
                      lambda rows: f"Evaluator (Inception features): {rows[0]['images_per_s']:.1f} images/s"),
        "suite": (lambda save: bench_suite(args, device, save), suite_table),
        "metrics": (lambda save: bench_metrics(args, device), metrics_table),
        "fid": (lambda save: bench_training_fid(args, device, dtype, save,
                                                functools.partial(compile_model, args=args, dynamic=False)),
                training_fid_table),
        "loader": (lambda save: bench_loader(args), loader_table),
    }
    tables = []
    for name in args.sections:
        run, table = sections[name]

        def save(rows, name=name):
            result[name] = rows
            write_record(args.out, result)

        try:
            save(run(save))
        except UserError:
            raise
        except Exception as e:  # recorded; the other sections still run
            traceback.print_exc()
            result.setdefault("failed", {})[name] = f"{type(e).__name__}: {e}"
            print(f"section {name} failed ({type(e).__name__}); its partial record is kept, going on", flush=True)
            write_record(args.out, result, tables)
            continue
        tables.append(table(result[name]))
        write_record(args.out, result, tables)
    print("\n\n".join(tables))
    if "failed" in result:
        sys.exit(f"failed section(s): {', '.join(result['failed'])}")


if __name__ == "__main__":
    main()
