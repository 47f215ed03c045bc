"""Which route? Measures each candidate TREAD route's cost and damage on a trained model and its data, and
suggests one.

    python -m tools.route_probe results/dit-digits --out probe/ --target-speedup 1.3
    python -m tools.route_probe exported/tread-digits --routes 2:8:0.5,0:5:0.5 --time-steps 5 --out probe/
    python -m tools.route_probe flux_dir/transformer --data latents.pt --target-speedup 1.4 --out probe/

The model is a run folder, checkpoint or exported folder of this project (its EDM or rectified-flow loss on
its own training data, or the latent shards at --data), or a diffusers FLUX or SD3 transformer folder
(config.json, with weights or without: then random weights from --init-seed) with a file of its inputs at
--data: a .pt (a dict of tensors) or .npz holding `latents` (as the transformer takes them: FLUX's packed
tokens [N, L, C] on a square grid, SD3's [N, C, H, W]), `text` (encoder_hidden_states [N, T, D]) and `pooled`
([N, P]); the loss is flow matching (tools/diffusers_toy.py).

Each route (START:END:RATIO, negative indices from the last block; the default grid is built from the depth)
gets its FLOP-bound speed-up and activation-memory fraction, its damage (the rise of the training loss with
the route applied to the trained model in training-mode routing, no training, paired against the unrouted
loss on the same samples, noise and seeds, with a confidence interval), and optionally a measured step time.
Writes probe.json, probe.md and probe.png (damage against speed-up with the Pareto front, and the cosine
similarity between each block's input and output tokens) to --out, with the routes the model was trained with
(tools/route_probe_trained.py): candidates inside them show little damage because of that training, and
--exclude-inside-trained leaves them out. A run's `imports` (modules of the user's own) are imported again before
its model is read. What this predicts, and for which models: docs/route_probe.md.
"""
import json
import sys
from pathlib import Path

import numpy as np
import torch

from routing_module import RouteError, resolve_routes
from tools.route_probe_measure import Candidate, DiffusersSubject, DiTSubject, default_candidates, measure
from tools.route_probe_report import annotate, suggestion_line, write
from tools.route_probe_trained import EXCLUDE_OPTION, exclude_inside, trained_line
from tread_utils.cli import ArgumentParser, non_negative_int, positive_int
from tread_utils.errors import UserError, report_user_errors

DATA_KEYS = ("latents", "text", "pooled")


def build_parser() -> ArgumentParser:
    p = ArgumentParser(prog="python -m tools.route_probe", description=__doc__.split("\n\n")[0])
    p.add_argument("model", help="run folder, checkpoint or exported folder; or a diffusers transformer folder")
    p.add_argument("--out", required=True, help="folder for probe.json, probe.md, probe.png")
    p.add_argument("--data", default=None, help="DiT: latent shards (default: the run's data); diffusers: the "
                   "inputs file (.pt or .npz with latents, text, pooled)")
    p.add_argument("--routes", default=None, help="START:END:RATIO,... (default: a grid from the depth)")
    p.add_argument("--batches", type=positive_int, default=4)
    p.add_argument("--batch-size", type=positive_int, default=64)
    p.add_argument("--seed", type=non_negative_int, default=0, help="data choice, noise and routing")
    p.add_argument("--target-speedup", type=float, default=None, help="suggest a route at least this fast (FLOPs)")
    p.add_argument("--target-memory", type=float, default=None,
                   help="suggest a route keeping at most this fraction of the block activation memory")
    p.add_argument("--time-steps", type=non_negative_int, default=0, help="also time this many training steps")
    p.add_argument("--weights", choices=("model", "ema"), default="model", help="DiT run: which weights")
    p.add_argument("--init-seed", type=non_negative_int, default=0, help="diffusers config without weights")
    p.add_argument("--threads", type=positive_int, default=None, help="torch CPU threads")
    p.add_argument(EXCLUDE_OPTION, action="store_true",
                   help="leave out the candidates inside a route the model was trained with (their damage is near "
                        "0 because of that training); the model must record its trained routes")
    return p


def parse_routes(text: str, depth: int) -> list:
    """"START:END:RATIO,..." -> checked Candidates (each a route of its own, indices made non-negative)."""
    candidates = []
    for item in (part.strip() for part in text.split(",")):
        fields = item.split(":")
        if len(fields) != 3:
            raise RouteError(f"--routes: {item!r} is not START:END:RATIO (e.g. 2:8:0.5, or 2:-4:0.5 counting from "
                             f"the last block)")
        start, end, ratio = fields
        try:
            route = {"start_layer_idx": int(start), "end_layer_idx": int(end), "selection_ratio": float(ratio)}
        except ValueError:
            raise RouteError(f"--routes: {item!r} needs integer START and END and a number RATIO") from None
        r = resolve_routes([route], depth)[0]
        candidates.append(Candidate(r.start_layer_idx, r.end_layer_idx, r.selection_ratio))
    if len(set(candidates)) != len(candidates):
        raise RouteError("--routes lists a route twice")
    return candidates


def diffusers_config(path: Path):
    """The diffusers transformer config.json in `path` (or `path`/transformer), or None for a DiT folder."""
    for folder in (path, path / "transformer"):
        config = folder / "config.json"
        if config.is_file():
            data = json.loads(config.read_text())
            if "_class_name" in data and "tread" not in data:
                return folder, data
    return None


def load_inputs(path) -> dict:
    if path is None:
        raise UserError("a diffusers transformer needs its inputs: --data FILE (.pt or .npz with latents, text, "
                        "pooled; see python -m tools.route_probe --help)")
    path = Path(path)
    if not path.is_file() or path.suffix not in (".pt", ".npz"):
        raise UserError(f"--data {path}: expected an existing .pt or .npz file with latents, text and pooled")
    if path.suffix == ".npz":
        with np.load(path) as f:
            tensors = {k: torch.from_numpy(f[k]) for k in f.files}
    else:
        try:
            tensors = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:
            raise UserError(f"--data {path} cannot be read ({type(e).__name__}); save a dict of tensors with "
                            f"torch.save") from None
    if not isinstance(tensors, dict) or any(k not in tensors for k in DATA_KEYS):
        raise UserError(f"--data {path} must hold {', '.join(DATA_KEYS)}; it holds "
                        f"{sorted(tensors) if isinstance(tensors, dict) else type(tensors).__name__}")
    if len({len(tensors[k]) for k in DATA_KEYS}) != 1:
        raise UserError(f"--data {path}: latents, text and pooled hold different sample counts "
                        f"{[len(tensors[k]) for k in DATA_KEYS]}")
    return tensors


def check_inputs(transformer, tensors: dict, path) -> None:
    cfg, latents = transformer.config, tensors["latents"]
    flux = type(transformer).__name__ == "FluxTransformer2DModel"
    want = (3, cfg.in_channels) if flux else (4, cfg.in_channels)
    got = (latents.ndim, latents.shape[-1] if flux else latents.shape[1] if latents.ndim == 4 else None)
    if got != want:
        layout = "[N, L, C] packed tokens" if flux else "[N, C, H, W]"
        raise UserError(f"--data {path}: latents {tuple(latents.shape)} do not fit {type(transformer).__name__}: "
                        f"expected {layout} with C = in_channels = {cfg.in_channels}")
    if flux and round(latents.shape[1] ** 0.5) ** 2 != latents.shape[1]:
        raise UserError(f"--data {path}: {latents.shape[1]} packed tokens are not a square grid")
    for key, dim, name in (("text", cfg.joint_attention_dim, "joint_attention_dim"),
                           ("pooled", cfg.pooled_projection_dim, "pooled_projection_dim")):
        if tensors[key].shape[-1] != dim or tensors[key].ndim != (3 if key == "text" else 2):
            raise UserError(f"--data {path}: {key} {tuple(tensors[key].shape)} does not fit the transformer "
                            f"({name} = {dim}; text [N, T, D], pooled [N, P])")


def load_subject(args):
    path = Path(args.model).expanduser()
    found = diffusers_config(path) if path.is_dir() else None
    if found is None:
        return DiTSubject(path, args.weights, args.data)
    import diffusers

    folder, config = found
    cls = getattr(diffusers, config["_class_name"], None)
    if cls is None:
        raise UserError(f"{folder}/config.json names {config['_class_name']}, which diffusers does not have")
    if config["_class_name"] not in DiffusersSubject.FAMILIES:  # before loading the weights
        raise UserError(f"the probe's flow-matching objective covers {', '.join(DiffusersSubject.FAMILIES)}; "
                        f"{folder} holds a {config['_class_name']}")
    if args.exclude_inside_trained:  # the same refusal exclude_inside gives, before loading the weights
        raise UserError(f"{EXCLUDE_OPTION}: a diffusers transformer's config.json does not record the routes it was "
                        f"trained with, so none can be left out")
    if any(folder.glob("*.safetensors")) or any(folder.glob("*.bin")):
        transformer, source = cls.from_pretrained(folder), str(folder)
    else:  # a config alone: the architecture with random weights (a dry run of the probe on a new model)
        torch.manual_seed(args.init_seed)
        transformer, source = cls.from_config(config), f"{folder} (random weights, seed {args.init_seed})"
    tensors = load_inputs(args.data)
    subject = DiffusersSubject(transformer, tensors, source)
    check_inputs(transformer, tensors, args.data)
    return subject


def check_args(args) -> None:
    if args.target_speedup is not None and not args.target_speedup >= 1:
        raise UserError(f"--target-speedup must be a speed-up >= 1, got {args.target_speedup}")
    if args.target_memory is not None and not 0 < args.target_memory <= 1:
        raise UserError(f"--target-memory must be a fraction in (0, 1], got {args.target_memory}")
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} is a file; give a folder")


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    check_args(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    subject = load_subject(args)
    candidates = parse_routes(args.routes, subject.depth) if args.routes else default_candidates(subject.depth)
    excluded = None
    if args.exclude_inside_trained:
        candidates, excluded = exclude_inside(candidates, subject.trained, subject.source)
    print(f"probing {len(candidates)} route(s) on {subject.description}, {args.batches} x {args.batch_size} "
          f"samples" + (f"; left out inside the trained routes: {', '.join(excluded)}" if excluded else ""), flush=True)
    result = measure(subject, candidates, args.batches, args.batch_size, args.seed, args.time_steps,
                     progress=lambda line: print(line, flush=True))
    result = {"command": "python -m tools.route_probe " + " ".join(argv), **result}
    if excluded is not None:
        result["excluded_inside_trained"] = excluded
    annotate(result, args.target_speedup, args.target_memory)
    paths = write(result, Path(args.out))
    print(trained_line(result))
    print(suggestion_line(result))
    print("wrote " + ", ".join(str(p) for p in paths))
    return result


if __name__ == "__main__":
    report_user_errors(main)()
