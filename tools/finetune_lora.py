"""LoRA fine-tuning of a FLUX-architecture transformer with TREAD, on the embedded digits, in minutes on a CPU.

    python -m tools.finetune_lora --steps 300 --out docs/perf/finetune_lora_digits.log
    python -m tools.finetune_lora --pretrained /path/to/FLUX.1-dev --resolution 256 --batch-size 4 --steps 1000

Without `--pretrained` the transformer is a small random FLUX architecture (2 dual-stream + 4 single-stream
blocks, width 64) and the digits (upsampled to --resolution) are its 1-channel latents, packed 2x2 as FLUX
packs them. With `--pretrained DIR` (a local diffusers folder with `transformer/` and `vae/`, e.g. a FLUX.1
or SD3 snapshot) the same loop fine-tunes that transformer: the digits, as RGB at --resolution, are encoded by
the folder's VAE. Either way the text condition is the class name ("seven") embedded by a tiny fixed text
encoder built here (FixedTextEncoder, sized to the transformer's text inputs) - nothing is downloaded.

The loss is rectified-flow (velocity) matching with logit-normal t, as FLUX and SD3 train. LoRA adapters
(peft, `transformer.add_adapter`) on the attention and MLP projections are the only trained weights; TREAD
routes the image tokens (`--route RATIO START END`, SimpleTuner's indexing). The log gives the training
loss, an unrouted evaluation loss on held-out digits before and after, and the routed and unrouted step
times against the FLOP bound (torch.utils.flop_counter), measured alternately at the end.
"""
import argparse
import json
import sys
import time
from pathlib import Path

import torch

from data.digits import load_digits_split
from tools.diffusers_toy import (COMPILE_MODES, FixedTextEncoder, flow_matching_loss, pack, peak_memory,
                                 random_flux, routed_vs_unrouted)
from tread_diffusers import apply_tread
from tread_diffusers.compile import CompiledSteps
from tread_utils.attention import BACKENDS as ATTENTION_BACKENDS, DEFAULT as DEFAULT_ATTENTION
from tread_utils.attention import check_attention, use_diffusers_attention
from tread_utils.cli import ArgumentParser
from tread_utils.errors import UserError, report_user_errors
from tread_utils.precision import avoid_faulting_attention

LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out",
                "proj_mlp", "proj_out", "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2"]


def load_pretrained(path: Path, device: torch.device):
    """(transformer, latents-from-images function) from a local diffusers checkpoint folder."""
    import diffusers

    config = path / "transformer" / "config.json"
    if not config.is_file() or not (path / "vae").is_dir():
        raise UserError(f"--pretrained {path}: expected a diffusers folder with transformer/config.json and vae/")
    name = json.loads(config.read_text()).get("_class_name")
    if name not in ("FluxTransformer2DModel", "SD3Transformer2DModel"):
        raise UserError(f"--pretrained {path}: transformer is {name}; this example fine-tunes FLUX or SD3")
    transformer = getattr(diffusers, name).from_pretrained(path, subfolder="transformer")
    vae = diffusers.AutoencoderKL.from_pretrained(path, subfolder="vae").eval().requires_grad_(False).to(device)
    shift, scale = vae.config.shift_factor or 0.0, vae.config.scaling_factor

    @torch.no_grad()
    def encode(images):
        latents = (vae.encode(images.to(device).expand(-1, 3, -1, -1)).latent_dist.mode() - shift) * scale
        return pack(latents) if name == "FluxTransformer2DModel" else latents
    return transformer, encode


def build(args, device: torch.device):
    if args.pretrained:
        transformer, encode = load_pretrained(Path(args.pretrained), device)
        return transformer.to(device), encode
    return random_flux(1, 64, 4, 2, 4, 32, seed=args.seed).to(device), lambda images: pack(images).to(device)


def add_lora(transformer, rank: int):
    from peft import LoraConfig

    names = {n.rsplit(".", 1)[-1] for n, _ in transformer.named_modules()}
    targets = [t for t in LORA_TARGETS if t.rsplit(".", 1)[-1] in names]
    transformer.requires_grad_(False)
    transformer.add_adapter(LoraConfig(r=rank, lora_alpha=rank, init_lora_weights="gaussian", target_modules=targets))
    return [p for p in transformer.parameters() if p.requires_grad]


@torch.no_grad()
def eval_loss(transformer, latents, text, pooled, run=None) -> float:
    """Unrouted (eval mode) loss on held-out digits with fixed noise and t: comparable across calls. Each batch's
    forward goes through `run` where given (CompiledSteps: a step of CUDA graphs too)."""
    transformer.eval()
    state = torch.get_rng_state()
    torch.manual_seed(1234)
    batches = list(zip(latents.split(64), text.split(64), pooled.split(64)))
    losses = [(run or _call)(lambda: flow_matching_loss(transformer, *batch).item()) for batch in batches]
    torch.set_rng_state(state)
    transformer.train()
    return sum(losses) / len(losses)


def _call(step):
    return step()


class DefaultsShown(argparse.ArgumentDefaultsHelpFormatter):
    """--help gives each option's default; an option off by default (None, False) says what its absence means."""

    def _get_help_string(self, action):
        return action.help if action.default in (None, False) else super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="python -m tools.finetune_lora", description=__doc__.split("\n\n")[0],
                       formatter_class=DefaultsShown)
    p.add_argument("--steps", type=int, default=300, help="training steps")
    p.add_argument("--batch-size", type=int, default=8, help="digits per step")
    p.add_argument("--resolution", type=int, default=32, help="digits upsampled to this size (pixels)")
    p.add_argument("--route", type=float, nargs=3, default=(0.5, 1, -2), metavar=("RATIO", "START", "END"),
                   help="the TREAD route: selection ratio, first and last block (negative: from the last)")
    p.add_argument("--rank", type=int, default=16, help="LoRA rank")
    p.add_argument("--lr", type=float, default=2e-3, help="AdamW learning rate of the LoRA weights")
    p.add_argument("--log-every", type=int, default=20, help="log the mean training loss every this many steps")
    p.add_argument("--time-rounds", type=int, default=8, help="alternating timed blocks, routed / unrouted")
    p.add_argument("--gradient-checkpointing", action="store_true", help="checkpoint the transformer's blocks")
    p.add_argument("--compile", action="store_true",
                   help="compile each block (tread_diffusers.compile_blocks, after the LoRA adapters, checkpointing "
                        "and routes: a checkpoint goes inside the blocks' graphs)")
    p.add_argument("--compile-backend", default="inductor",
                   help="--compile: torch.compile's backend (aot_eager: traced and partitioned, no code generated)")
    p.add_argument("--compile-mode", choices=COMPILE_MODES, default="default",
                   help="--compile: torch.compile's mode for the blocks, inductor's (reduce-overhead: CUDA graphs on a "
                        "GPU; where they fail, one line says so and training goes on without them)")
    p.add_argument("--pretrained", default=None, help="local diffusers folder (transformer/, vae/); without it, "
                                                      "a small random FLUX architecture")
    p.add_argument("--eval-samples", type=int, default=128, help="held-out digits in the evaluation loss")
    p.add_argument("--time-steps", type=int, default=3, help="steps per alternating timed block")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (1: steadier timings on a shared CPU)")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the batch draws (and of the random architecture's weights and noise)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu",
                   help="where the transformer trains")
    p.add_argument("--attention", choices=list(ATTENTION_BACKENDS), default=DEFAULT_ATTENTION,
                   help="the transformer's attention kernels, as train.attention (diffusers' backend each maps to; "
                        "docs/performance.md, Attention backends)")
    p.add_argument("--keep-cudnn-attention", action="store_true",
                   help="keep cuDNN's fused attention where its backward is known to fault (by default it is "
                        "turned off there, said in one line)")
    p.add_argument("--out", default=None, help="also write the log to this file")
    return p


def main(argv=None):
    args = build_parser().parse_args(argv)
    if args.steps < 1 or args.batch_size < 1 or args.resolution % 2:
        raise UserError("--steps and --batch-size must be positive and --resolution even")
    if args.compile_mode != "default" and not (args.compile and args.compile_backend == "inductor"):
        raise UserError(f"--compile-mode {args.compile_mode} is a mode of inductor's compiled blocks; add --compile "
                        f"and keep --compile-backend inductor")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda: this machine has no CUDA GPU; give --device cpu")
    try:
        import peft  # noqa: F401  (the LoRA layers, add_lora's: refused here, before anything is built)
    except ImportError:
        raise UserError('LoRA needs peft, which the lora extra installs: pip install -e ".[lora]"') from None
    device = torch.device(args.device)
    check_attention(args.attention, "--attention", device, package=False)  # before anything is built
    torch.set_num_threads(args.threads)
    lines = []

    def log(line):
        print(line, flush=True)
        lines.append(line)

    log("command: python -m tools.finetune_lora " + " ".join(sys.argv[1:] if argv is None else argv))
    attention = avoid_faulting_attention(args.keep_cudnn_attention, "--keep-cudnn-attention")
    if attention:
        log(attention)
    transformer, encode = build(args, device)
    attention = use_diffusers_attention(transformer, args.attention, "--attention", device)
    if attention:
        log(attention)
    text_encoder = FixedTextEncoder(transformer.config.joint_attention_dim,
                                    transformer.config.pooled_projection_dim).to(device)
    trainable = add_lora(transformer, args.rank)
    if args.gradient_checkpointing:
        transformer.enable_gradient_checkpointing()
    routes = {"routes": [{"selection_ratio": args.route[0], "start_layer_idx": int(args.route[1]),
                          "end_layer_idx": int(args.route[2])}]}
    images, labels = load_digits_split("train", args.resolution)
    test_images, test_labels = (t[:args.eval_samples] for t in load_digits_split("test", args.resolution))
    latents, test_latents = encode(images), encode(test_images)
    test_text = text_encoder(test_labels.to(device))
    optimizer = torch.optim.AdamW(trainable, lr=args.lr, weight_decay=0.0)
    g = torch.Generator().manual_seed(args.seed)

    def batch():
        idx = torch.randint(len(labels), (args.batch_size,), generator=g)
        return (latents[idx.to(device)], *text_encoder(labels[idx].to(device)))

    log(f"model {type(transformer).__name__} ({sum(p.numel() for p in transformer.parameters()) / 1e6:.2f}M params, "
        f"LoRA rank {args.rank}: {sum(p.numel() for p in trainable) / 1e6:.3f}M trained), tokens "
        f"{latents.shape[1] if latents.ndim == 3 else latents[0, 0].numel() // 4}, batch {args.batch_size}, "
        f"routes {routes['routes']}, gradient checkpointing {args.gradient_checkpointing}, compiled blocks "
        f"{args.compile}{f' (mode {args.compile_mode})' if args.compile else ''}, torch threads "
        f"{torch.get_num_threads()}")
    log(f"step 0: eval loss (unrouted, held-out) {eval_loss(transformer, test_latents, *test_text):.4f}")
    handle = apply_tread(transformer, routes)
    # static shapes: the route's ratio is fixed, so is its kept count
    run = CompiledSteps(transformer, report=log, backend=args.compile_backend, mode=args.compile_mode,
                        dynamic=False) if args.compile else None
    transformer.train()

    def train_step(drawn):
        optimizer.zero_grad(set_to_none=True)
        loss = flow_matching_loss(transformer, *drawn)
        loss.backward()
        optimizer.step()
        return loss.item()

    losses, start = [], time.perf_counter()
    for step in range(1, args.steps + 1):
        drawn = batch()  # outside the step: a step run again (CompiledSteps) trains on the same digits
        losses.append((run or _call)(lambda: train_step(drawn)))
        if step % args.log_every == 0 or step == args.steps:
            recent = losses[-args.log_every:]
            log(f"step {step}: train loss {sum(recent) / len(recent):.4f} ({time.perf_counter() - start:.0f} s)")
    handle.remove()
    final = eval_loss(transformer, test_latents, *test_text, run=run)
    log(f"step {args.steps}: eval loss (unrouted, held-out) {final:.4f}")
    timing = routed_vs_unrouted(transformer, routes, batch, optimizer, rounds=args.time_rounds, steps=args.time_steps,
                                run=run)
    log(f"step time: unrouted {timing['unrouted_step_s'] * 1e3:.0f} ms, routed {timing['routed_step_s'] * 1e3:.0f} ms "
        f"(medians of {timing['timed_steps_each']} steps each, alternating); speed-up {timing['speedup']:.3f}x, "
        f"FLOP bound {timing['flop_bound']:.3f}x ({timing['flops_unrouted'] / 1e9:.2f} / "
        f"{timing['flops_routed'] / 1e9:.2f} GFLOP per step), speed-up / bound {timing['speedup_vs_bound']:.3f}; "
        f"peak memory {peak_memory(timing)}")
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")
    return timing


if __name__ == "__main__":
    report_user_errors(main)()
