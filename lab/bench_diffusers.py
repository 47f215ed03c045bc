"""Bench: the routed against the unrouted training step of mid-size random FLUX- and SD3-architecture diffusers
transformers (apply_tread), with the FLOP bound from torch.utils.flop_counter.

    python -m lab.bench_diffusers --out docs/perf/diffusers_cpu.json    # also writes docs/perf/diffusers_cpu.md

A step is the flow-matching loss forward, backward and an AdamW step over all weights, on random latents and
text tokens. Routed and unrouted steps are timed in alternating blocks (`--rounds` x `--steps`) so that both see
the same load on a shared machine, and the medians are compared: speed-up = unrouted / routed, bound =
FLOPs unrouted / FLOPs routed, and their ratio (1.0: routing saves all the time its FLOPs promise). The route
is SimpleTuner's balanced one, {selection_ratio 0.5, start 2, end -2}. The record notes the machine's load.
"""
import argparse
import json
import os
import platform
import sys
from pathlib import Path

import torch

from tools.diffusers_toy import pack, random_flux, random_sd3, routed_vs_unrouted
from tread_utils.errors import report_user_errors

ROUTES = {"routes": [{"selection_ratio": 0.5, "start_layer_idx": 2, "end_layer_idx": -2}]}


def model_and_batch(arch: str, width: int, depth: int, tokens_side: int, batch: int, text_len: int = 16):
    """The random model and a function drawing a batch (latents, text tokens, pooled) for it."""
    text_dim, channels = 64, 4
    if arch == "flux":
        model = random_flux(channels, width, width // 64, depth // 4, depth - depth // 4, text_dim)
        side = tokens_side * 2  # latent pixels; 2x2 packing gives tokens_side^2 tokens
        make = lambda: pack(torch.randn(batch, channels, side, side))  # noqa: E731
    else:
        side = tokens_side * 2  # patch 2
        model = random_sd3(channels, width, width // 64, depth, text_dim, side)
        make = lambda: torch.randn(batch, channels, side, side)  # noqa: E731
    return model, lambda: (make(), torch.randn(batch, text_len, text_dim), torch.randn(batch, text_dim))


def to_markdown(record: dict) -> str:
    lines = [f"Command: `{record['command']}`", "",
             f"Machine: {record['machine']}", "",
             "| model | params (M) | blocks | image tokens | batch | unrouted step (ms) | routed step (ms) | speed-up | "
             "FLOP bound | speed-up / bound |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in record["rows"]:
        lines.append(f"| {r['arch']} | {r['params_m']:.1f} | {r['blocks']} | {r['tokens']} | {r['batch']} | "
                     f"{r['unrouted_step_s'] * 1e3:.0f} | {r['routed_step_s'] * 1e3:.0f} | {r['speedup']:.3f}x | "
                     f"{r['flop_bound']:.3f}x | {r['speedup_vs_bound']:.3f} |")
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--archs", nargs="+", choices=("flux", "sd3"), default=("flux", "sd3"))
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--depth", type=int, default=8, help="blocks (FLUX: a quarter dual-stream, the rest single)")
    p.add_argument("--tokens-side", type=int, default=16, help="image tokens per side")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--steps", type=int, default=2, help="steps per timed block")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (1: steadier timings on a shared CPU)")
    p.add_argument("--out", default=None, help="JSON record (a .md table beside it)")
    return p


def main(argv=None):
    args = build_parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    rows = []
    for arch in args.archs:
        model, batch = model_and_batch(arch, args.width, args.depth, args.tokens_side, args.batch_size)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        result = routed_vs_unrouted(model, ROUTES, batch, optimizer, rounds=args.rounds, steps=args.steps)
        rows.append(dict(arch=arch, params_m=sum(q.numel() for q in model.parameters()) / 1e6, blocks=args.depth,
                         tokens=args.tokens_side ** 2, batch=args.batch_size, **result))
        print(f"{arch}: unrouted {result['unrouted_step_s'] * 1e3:.0f} ms, routed {result['routed_step_s'] * 1e3:.0f} ms, "
              f"speed-up {result['speedup']:.3f}x, FLOP bound {result['flop_bound']:.3f}x, "
              f"speed-up / bound {result['speedup_vs_bound']:.3f}", flush=True)
    load_after = os.getloadavg()
    machine = (f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPU cores shared with other jobs "
               f"(1-minute load average {load_before[0]:.1f} before, {load_after[0]:.1f} after), torch "
               f"{torch.__version__}, {torch.get_num_threads()} threads, fp32")
    record = dict(command="python -m lab.bench_diffusers " + " ".join(argv if argv is not None else sys.argv[1:]),
                  machine=machine, routes=ROUTES["routes"], rows=rows)
    if args.out:
        out = Path(args.out)
        out.write_text(json.dumps(record, indent=1) + "\n")
        out.with_suffix(".md").write_text(to_markdown(record))
    print(to_markdown(record))
    return record


if __name__ == "__main__":
    report_user_errors(main)()
