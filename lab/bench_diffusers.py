"""Bench: the routed against the unrouted training step of mid-size random diffusers transformers (apply_tread),
one per supported family (ARCHS: the model and inputs of each family's `Example`, tread_diffusers/families.py), at
1,024 image tokens (video: 4 frames of 16 x 16; the default run: FLUX and SD3 at 256, batch 4), with the FLOP bound
from torch.utils.flop_counter.

    python -m lab.bench_diffusers --out diffusers_cpu.json    # FLUX and SD3 at 256 tokens; a .md table beside it

Each committed record under docs/perf/diffusers_*_cpu.json names the command that made it (its `command`);
docs/diffusers.md gives them beside their tables.

A step is the flow-matching loss forward, backward and an AdamW step over all weights (with --lora-int8: over
the LoRA adapters of an int8 base), on random latents and text tokens. Routed and unrouted steps are timed in
alternating blocks (`--rounds` x `--steps`) so that both see the same load on a shared machine, and the medians
are compared: speed-up = unrouted / routed, bound = FLOPs unrouted / FLOPs routed, and their ratio (1.0: routing
saves all the time its FLOPs promise). The route is SimpleTuner's balanced one, {selection_ratio 0.5, start 2,
end -2}. The record notes the machine's load.

    python -m lab.bench_diffusers --flux-lora full --out flux_lora_gpu.json     # FLUX.1-dev LoRA on a GPU
    python -m lab.bench_diffusers --flux-lora proxy --out docs/perf/diffusers_flux_host_cpu.json   # its host cost

`--flux-lora` times the FLUX.1-dev LoRA fine-tune step instead (lab/bench_flux_lora.py): at full size on a GPU,
eager and with compiled blocks, batch 1 and 2; or its host-cost proxy on a CPU.
"""
import argparse
import importlib.util
import json
import math
import os
import platform
import sys
from pathlib import Path

import torch

from lab.bench_flux_lora import flux_lora_rows
from tools.diffusers_toy import COMPILE_MODES, routed_vs_unrouted
from tread_diffusers.families import FAMILIES
from tread_diffusers.tread import apply_tread  # noqa: F401  (importing registers every family)
from tread_utils.errors import UserError, report_user_errors
from tread_utils.precision import avoid_faulting_attention


def registered_archs() -> dict:
    """Each --archs name (its family's Example.arch): the family as docs/diffusers.md and the README name it, and its
    diffusers class; the image families first, then the video ones, each in the order they are registered."""
    examples = [(cls, family) for cls, family in FAMILIES.items() if family.example is not None]
    examples.sort(key=lambda item: item[1].example.video)  # a stable sort: the registration order within each
    return {family.example.arch: (family.name, cls) for cls, family in examples}


ARCHS = registered_archs()
QUANTIZERS = {"quanto": ("optimum.quanto", "optimum-quanto"), "torchao": ("torchao", "torchao")}  # module, package
ROUTES = {"routes": [{"selection_ratio": 0.5, "start_layer_idx": 2, "end_layer_idx": -2}]}


def model_and_batch(arch: str, width: int, depth: int, tokens_side: int, batch: int, text_len: int = 16,
                    frames: int = 4):
    """The random model of the family (its Example, seed 0) and a function drawing a batch (latents, text tokens,
    pooled) for it."""
    text_dim, channels = 64, 4
    example = FAMILIES[ARCHS[arch][1]].example
    torch.manual_seed(0)
    model = example.model(channels, width, depth, text_dim, tokens_side)
    return model, lambda: (example.latents(batch, channels, tokens_side, frames),
                           torch.randn(batch, text_len, text_dim), torch.randn(batch, text_dim))


def quantized_lora(model, rank: int = 16, library: str = "quanto") -> None:
    """A quantized fine-tune, as SimpleTuner users run one: the blocks' Linear weights stored int8 weight-only per
    output channel and frozen (optimum-quanto qint8, or torchao's Int8WeightOnlyConfig), LoRA adapters (peft) on
    the attention projections training. The library is imported here only: optimum.quanto logs a line at import
    on a machine without CUDA."""
    from peft import LoraConfig

    spec, package = QUANTIZERS[library]
    if importlib.util.find_spec(spec) is None:
        raise UserError(f"--lora-int8 --quantizer {library} needs {package}: pip install {package}")
    in_blocks = [name for name, module in model.named_modules()
                 if isinstance(module, torch.nn.Linear) and "blocks" in name]
    if library == "quanto":
        from optimum.quanto import freeze, qint8, quantize

        quantize(model, weights=qint8, include=in_blocks)
        freeze(model)
        count_quanto_matmuls()
    else:
        from torchao.quantization import Int8WeightOnlyConfig, quantize_

        quantize_(model, Int8WeightOnlyConfig(), filter_fn=lambda module, name: name in in_blocks)
    model.requires_grad_(False)
    model.add_adapter(LoraConfig(r=rank, lora_alpha=rank, init_lora_weights="gaussian",
                                 target_modules=["to_q", "to_k", "to_v"]))


def count_quanto_matmuls() -> None:
    """torch's FLOP counter sees quanto's int8 matmul as an op it has no formula for (0 FLOPs): count it as the
    [tokens, in] x [in, out] matmul it is, so that the FLOP bound counts the base's Linears as with torchao."""
    from torch.utils.flop_counter import flop_registry, register_flop_formula

    op = torch.ops.quanto.qbytes_mm
    if op not in flop_registry:
        register_flop_formula(op)(lambda x, weight, scales, **_: 2 * math.prod(x) * weight[0])


def to_markdown(record: dict) -> str:
    lines = [f"Command: `{record['command']}`", "",
             f"Machine: {record['machine']}", "",
             "| model | params (M) | blocks | image tokens | batch | unrouted step (ms) | routed step (ms) | speed-up | "
             "FLOP bound | speed-up / bound | peak memory (MB) |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in record["rows"]:
        model = f"{r['arch']}, {r['base']}" if "base" in r else r["arch"]
        model += {True: ", compiled blocks", False: ", eager"}.get(r.get("compiled"), "")
        model += ", checkpoint around them" if r.get("compiled") and r.get("checkpoint") == "around blocks" else ""
        model += f", mode {r['compile_mode']}" if r.get("compile_mode", "default") != "default" else ""
        # a GPU row in reduce-overhead mode: its steps replayed CUDA graphs, or fell back without them
        model += ", CUDA graphs" if r.get("cuda_graphs") else ", CUDA graphs failed" * ("cuda_graphs_failure" in r)
        peak = "-" if r.get("peak_mem_mb") is None else f"{r['peak_mem_mb']:.0f}"  # None: a CPU
        lines.append(f"| {model} | {r['params_m']:.1f} | {r['blocks']} | {r['tokens']} | {r['batch']} | "
                     f"{r['unrouted_step_s'] * 1e3:.0f} | {r['routed_step_s'] * 1e3:.0f} | {r['speedup']:.3f}x | "
                     f"{r['flop_bound']:.3f}x | {r['speedup_vs_bound']:.3f} | {peak} |")
    profiled = [(i, r["profile_routed"]) for i, r in enumerate(record["rows"], 1) if "profile_routed" in r]
    lines += [""] * bool(profiled) + [
        f"Row {i}, one routed step profiled: kernels busy {p['busy_ms']:.0f} ms against the timed "
        f"{record['rows'][i - 1]['routed_step_s'] * 1e3:.0f} ms; host syncs {p['host_syncs']}" for i, p in profiled]
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--archs", nargs="+", choices=tuple(ARCHS), default=("flux", "sd3"))
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--depth", type=int, default=8,
                   help="blocks (FLUX, FLUX.2, Chroma: a quarter dual-stream, the rest single)")
    p.add_argument("--tokens-side", type=int, default=16, help="image tokens per side")
    p.add_argument("--frames", type=int, default=4, help="video frames, each tokens-side^2 tokens")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--steps", type=int, default=2, help="steps per timed block")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (1: steadier timings on a shared CPU)")
    p.add_argument("--lora-int8", action="store_true",
                   help="train LoRA adapters on an int8 weight-only base (needs peft and --quantizer's library)")
    p.add_argument("--quantizer", choices=tuple(QUANTIZERS), default="quanto",
                   help="--lora-int8's library: optimum-quanto qint8 (in the lora extra) or torchao (in no extra)")
    p.add_argument("--flux-lora", choices=("full", "proxy"), default=None,
                   help="time the FLUX.1-dev LoRA step instead: full size (a GPU) or its host-cost proxy (a CPU)")
    p.add_argument("--keep-cudnn-attention", action="store_true",
                   help="--flux-lora: keep cuDNN's fused attention where the trainer turns it off")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=None,
                   help="--flux-lora: batch sizes (default: 1 2 full, 1 proxy)")
    p.add_argument("--compile", choices=("off", "on", "both"), default=None,
                   help="--flux-lora: eager, compiled blocks (at every batch size) or both (default: both full, off proxy)")
    p.add_argument("--checkpoint-outside", action="store_true",
                   help="--flux-lora: time the compiled blocks with the gradient checkpoint around them too (a last row, "
                        "after those with it inside their graphs)")
    p.add_argument("--compile-mode", choices=COMPILE_MODES,
                   default="default", help="--flux-lora: torch.compile's mode for the blocks (reduce-overhead: CUDA "
                                           "graphs on a GPU)")
    p.add_argument("--profile", action="store_true",
                   help="--flux-lora: profile one more routed step per row (its kernels' busy time: GPU- or host-bound)")
    p.add_argument("--out", default=None, help="JSON record (a .md table beside it)")
    return p


def machine_line(load_before, load_after, dtype: str, gpu: bool) -> str:
    if gpu:
        import diffusers
        import peft
        return (f"{torch.cuda.get_device_name()}, torch {torch.__version__}, CUDA {torch.version.cuda}, cuDNN "
                f"{torch.backends.cudnn.version()}, diffusers {diffusers.__version__}, peft {peft.__version__}, "
                f"{dtype}")
    return (f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPU cores shared with other jobs "
            f"(1-minute load average {load_before[0]:.1f} before, {load_after[0]:.1f} after), torch "
            f"{torch.__version__}, {torch.get_num_threads()} threads, {dtype}")


def flux_lora(args) -> tuple:
    """(rows, attention line or None) of --flux-lora."""
    if args.flux_lora == "full" and not torch.cuda.is_available():
        raise UserError("--flux-lora full builds an 11.9 B-parameter transformer on a GPU; on a CPU run "
                        "--flux-lora proxy")
    attention = avoid_faulting_attention(args.keep_cudnn_attention, "--keep-cudnn-attention")  # as the trainer
    if attention:
        print(attention, flush=True)
    full = args.flux_lora == "full"
    modes = {"off": [False], "on": [True], "both": [False, True]}[args.compile or ("both" if full else "off")]
    for given, flag in ((args.checkpoint_outside, "--checkpoint-outside"), (args.compile_mode != "default", "--compile-mode")):
        if given and True not in modes:
            raise UserError(f"{flag} applies to compiled blocks; add --compile on or --compile both")
    rows = flux_lora_rows(args.flux_lora, args.batch_sizes or ([1, 2] if full else [1]), modes, ROUTES,
                          args.rounds, args.steps, args.checkpoint_outside, args.compile_mode, args.profile)
    return rows, attention


def main(argv=None):
    args = build_parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    rows, attention = [], None
    if args.flux_lora:
        rows, attention = flux_lora(args)
    for arch in ([] if args.flux_lora else args.archs):
        model, batch = model_and_batch(arch, args.width, args.depth, args.tokens_side, args.batch_size,
                                       frames=args.frames)
        if args.lora_int8:
            quantized_lora(model, library=args.quantizer)
        optimizer = torch.optim.AdamW([q for q in model.parameters() if q.requires_grad], lr=1e-4)
        result = routed_vs_unrouted(model, ROUTES, batch, optimizer, rounds=args.rounds, steps=args.steps)
        base = dict(base=f"int8 ({args.quantizer}) + LoRA") if args.lora_int8 else {}
        frames = args.frames if FAMILIES[ARCHS[arch][1]].example.video else 1
        rows.append(dict(arch=arch, **base, params_m=sum(q.numel() for q in model.parameters()) / 1e6,
                         blocks=args.depth, tokens=args.tokens_side ** 2 * frames, batch=args.batch_size, **result))
        print(f"{arch}: unrouted {result['unrouted_step_s'] * 1e3:.0f} ms, routed {result['routed_step_s'] * 1e3:.0f} ms, "
              f"speed-up {result['speedup']:.3f}x, FLOP bound {result['flop_bound']:.3f}x, "
              f"speed-up / bound {result['speedup_vs_bound']:.3f}", flush=True)
    load_after = os.getloadavg()
    gpu = args.flux_lora == "full"
    machine = machine_line(load_before, load_after, rows[0].get("dtype", "float32") if rows else "float32", gpu)
    device = torch.cuda.get_device_name() if gpu else "cpu"
    record = dict(command="python -m lab.bench_diffusers " + " ".join(argv if argv is not None else sys.argv[1:]),
                  machine=machine, device=device, attention=attention, routes=ROUTES["routes"], rows=rows)
    if args.out:
        out = Path(args.out)
        out.write_text(json.dumps(record, indent=1) + "\n")
        out.with_suffix(".md").write_text(to_markdown(record))
    print(to_markdown(record))
    return record


if __name__ == "__main__":
    report_user_errors(main)()
