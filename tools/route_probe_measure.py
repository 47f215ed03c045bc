"""The route probe's measurements (tools/route_probe.py): a trained model as a *subject* that computes its own
training loss per sample, with or without one candidate route, and what each route costs and damages.

Damage is the rise of the model's own training loss when a route is applied to the trained weights in
training-mode routing, with no training: the same samples, the same noise levels and noise (the objective's
own draws, from a seed per batch) and, for a DiT, the same routing seed, so each sample's routed loss is
paired with its unrouted loss and their difference carries only the route's effect. Cost is the FLOP-bound
speed-up and the block activation-memory fraction of a training step (training/flops.py for a DiT; a
FlopCounterMode forward for a diffusers transformer), and optionally a measured step time.
"""
import statistics
import time
from dataclasses import dataclass

import torch
from omegaconf import OmegaConf
from scipy import stats
from torch.utils.flop_counter import FlopCounterMode

from data import build_dataset
from dit import get_model
from routing_module import TokenRouter, resolve_routes
from tools.diffusers_toy import flow_matching_loss
from tools.route_probe_trained import from_export, from_run_config, unknown
from training.checkpoint import build_objective, load_model_state, read_checkpoint, resolve_checkpoint
from training.flops import activation_memory_fraction, tokens_per_block, training_step_flops
from tread_diffusers.families import family_of
from tread_diffusers.tread import apply_tread, bound_kwargs, positional_names
from tread_utils.errors import UserError
from tread_utils.hub import is_exported_folder
from tread_utils.user_imports import import_saved

CONFIDENCE = 0.95


@dataclass(frozen=True)
class Candidate:
    start: int
    end: int
    ratio: float

    @property
    def name(self) -> str:
        return f"{self.start}->{self.end} @ {self.ratio:g}"

    def as_route(self) -> dict:
        return {"start_layer_idx": self.start, "end_layer_idx": self.end, "selection_ratio": self.ratio}


def block_cosine(x_in: torch.Tensor, x_out: torch.Tensor) -> torch.Tensor:
    """Per-sample mean over tokens of the cosine similarity between a block's input and output tokens."""
    return torch.nn.functional.cosine_similarity(x_in.float(), x_out.float(), dim=-1).mean(-1)


class DiTSubject:
    """A run folder or exported folder of this project: the EMA or training weights, unrouted, with the run's
    objective (EDM, or rectified flow for diffuser=rf) and data."""
    kind = "dit"

    def __init__(self, path, weights: str = "model", data=None):
        ckpt = resolve_checkpoint(path)
        state = read_checkpoint(ckpt)
        cfg = state.get("config")
        if not isinstance(cfg, dict) or "model" not in cfg or "diffuser" not in cfg:
            raise UserError(f"{ckpt} holds no run config (model/diffuser); it was not written by train.py")
        import_saved(cfg, ckpt)  # the user's modules the run was trained with, before its routes are read
        params = dict(cfg["model"]["params"])
        if any(dict(r).get("fusion", "none") != "none" for r in params.get("routes") or []):
            raise UserError(f"{ckpt} was trained with SPRINT routes (their fusion has weights); the probe measures "
                            f"TREAD routes on a model without them")
        self.backbone_type = cfg["model"]["backbone_type"]
        self.params = {**params, "routes": [], "enable_routing": False}
        self.model = get_model(self.backbone_type, self.params)
        load_model_state(self.model, state[weights], ckpt)
        self.model.requires_grad_(False)
        diffuser = OmegaConf.create({"name": "edm", **cfg["diffuser"]})
        self.net, self.loss_fn = build_objective(diffuser, self.model)
        self.depth = len(self.model.blocks)
        self.trained = (from_export(ckpt, self.depth, sum(p.numel() for p in self.model.parameters()))
                        if is_exported_folder(ckpt) else
                        from_run_config(cfg, int(state["step"]), self.depth, f"the run config in {ckpt}"))
        self.fp32_after_route = params.get("fp32_after_route") is not False
        self.source = str(ckpt)
        self.step = int(state["step"])
        self.description = f"{self.backbone_type} ({diffuser.name}), {weights} weights, step {self.step}"
        self.dataset_cfg = OmegaConf.create(cfg.get("dataset") or {})
        self.data = data
        self.dense_flops = None

    def samples(self, count: int, seed: int):
        """`count` (inputs, labels) of the run's training data (or the shards at `data`), a seeded choice."""
        d = self.dataset_cfg
        if self.data is not None:
            d.kind, d.train_path = "shards", str(self.data)
        if d.get("kind") == "shards" and not d.get("train_path"):
            raise UserError(f"{self.source} names no latent shards to read; give them with --data SHARDS_DIR")
        dataset = build_dataset(d, seed)
        if len(dataset) < count:
            raise UserError(f"the data holds {len(dataset)} samples, fewer than --batches x --batch-size = {count}")
        order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(seed))[:count]
        items = [dataset[int(i)] for i in order]
        return torch.stack([item[0] for item in items]).float(), torch.tensor([int(item[1]) for item in items])

    def set_route(self, candidate):
        routes = resolve_routes([candidate.as_route()] if candidate else [], self.depth)
        self.model.router = TokenRouter(routes, True, self.fp32_after_route)

    def losses(self, batch, seed: int, candidate) -> torch.Tensor:
        """Per-sample training loss [B], routed by `candidate` (None: unrouted) in training mode."""
        self.set_route(candidate)
        self.net.train()
        images, labels = batch
        torch.manual_seed(seed)
        return self.loss_fn(self.net, images, labels, routing_seed=seed).flatten(1).mean(1)

    def blocks(self):
        return list(self.model.blocks)

    def block_tokens(self, block, args, kwargs, output):
        return args[0], output

    def cost(self, candidate) -> dict:
        """What `python -m training.flops` reports for the route, per sample; the dense count once."""
        params = dict(self.params, routes=[candidate.as_route()], enable_routing=True)
        if self.dense_flops is None:
            self.dense_flops = training_step_flops(self.backbone_type, params, 1, routing=False)
        return {"flop_speedup_bound": self.dense_flops / training_step_flops(self.backbone_type, params, 1),
                "activation_memory_fraction": activation_memory_fraction(self.backbone_type, params)}

    def train_step(self, batch, seed: int, candidate) -> None:
        self.model.requires_grad_(True)
        try:
            self.losses(batch, seed, candidate).mean().backward()
        finally:
            self.model.zero_grad(set_to_none=True)
            self.model.requires_grad_(False)


class DiffusersSubject:
    """A FLUX or SD3 transformer (the flow-matching step of tools/diffusers_toy.py), routed by apply_tread."""
    kind = "diffusers"
    FAMILIES = ("FluxTransformer2DModel", "SD3Transformer2DModel")

    def __init__(self, transformer, tensors: dict, source: str):
        name = type(transformer).__name__
        family_of(transformer)  # a class apply_tread does not route is refused here
        if name not in self.FAMILIES:
            raise UserError(f"the probe's flow-matching objective covers {', '.join(self.FAMILIES)}; got {name}")
        self.model, self.tensors, self.source = transformer.requires_grad_(False), tensors, source
        self.family = family_of(transformer)
        self.depth = sum(len(getattr(transformer, n)) for n in self.family.block_lists)
        self.description = f"{name}, {sum(p.numel() for p in transformer.parameters()) / 1e6:.2f}M parameters"
        self.trained = unknown("a diffusers transformer's config.json does not record how it was trained")
        self.handle = None

    def samples(self, count: int, seed: int):
        n = len(self.tensors["latents"])
        if n < count:
            raise UserError(f"the latents file holds {n} samples, fewer than --batches x --batch-size = {count}")
        order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))[:count]
        return tuple(self.tensors[k][order].float() for k in ("latents", "text", "pooled"))

    def set_route(self, candidate):
        if self.handle is not None:
            self.handle.remove()
        self.handle = apply_tread(self.model, {"routes": [candidate.as_route()]}) if candidate else None

    def losses(self, batch, seed: int, candidate) -> torch.Tensor:
        """Per-sample flow-matching loss [B]: apply_tread routes only with gradients enabled, so the forward runs
        under enable_grad with every weight frozen (no graph is built)."""
        self.set_route(candidate)
        self.model.train()
        out = []
        with torch.enable_grad():
            for i in range(len(batch[0])):
                torch.manual_seed(seed * 100_003 + i)  # one sample at a time: the loss reduces over the batch
                out.append(flow_matching_loss(self.model, *(t[i:i + 1] for t in batch)).detach())
        return torch.stack(out)

    def blocks(self):
        return [b for n in self.family.block_lists for b in getattr(self.model, n)]

    def block_tokens(self, block, args, kwargs, output):
        hidden = bound_kwargs(positional_names(block), args, kwargs)["hidden_states"]
        kind = next(n for n in self.family.block_lists if any(b is block for b in getattr(self.model, n)))
        out = self.family.image(output, kind)
        return hidden[:, hidden.shape[1] - out.shape[1]:] if hidden.shape[1] != out.shape[1] else hidden, out

    def _forward_flops(self, batch, candidate) -> int:
        self.set_route(candidate)
        self.model.train()
        with torch.enable_grad(), FlopCounterMode(display=False) as counter:
            flow_matching_loss(self.model, *(t[:1] for t in batch))
        return counter.get_total_flops()

    def cost(self, candidate, batch=None) -> dict:
        """A training step's FLOPs are ~3x its forward's, routed or not: the bound is the forward ratio. The
        activation fraction counts the text tokens, which every block holds and no route drops."""
        dense, routed = self._forward_flops(batch, None), self._forward_flops(batch, candidate)
        image, text = self.image_tokens(batch), batch[1].shape[1]
        routes = resolve_routes([candidate.as_route()], self.depth)
        kept = tokens_per_block(self.depth, image, routes)
        return {"flop_speedup_bound": dense / routed,
                "activation_memory_fraction": (sum(kept) + self.depth * text) / (self.depth * (image + text))}

    def image_tokens(self, batch) -> int:
        latents = batch[0]
        if latents.ndim == 3:  # FLUX: packed tokens
            return latents.shape[1]
        patch = self.model.config.patch_size
        return (latents.shape[-2] // patch) * (latents.shape[-1] // patch)

    def train_step(self, batch, seed: int, candidate) -> None:
        self.set_route(candidate)
        self.model.train()
        self.model.requires_grad_(True)
        try:
            torch.manual_seed(seed)
            flow_matching_loss(self.model, *batch).backward()
        finally:
            self.model.zero_grad(set_to_none=True)
            self.model.requires_grad_(False)


def batches(samples, batch_size: int):
    count = len(samples[0])
    return [tuple(t[i:i + batch_size] for t in samples) for i in range(0, count, batch_size)]


def batch_seed(seed: int, index: int) -> int:
    return seed * 1000 + index


@torch.no_grad()
def unrouted(subject, data, seed: int) -> tuple:
    """(per-sample unrouted losses [n], per-block mean cosine similarity between input and output tokens)."""
    sums, count = torch.zeros(subject.depth, dtype=torch.float64), 0
    hooks = []
    for k, block in enumerate(subject.blocks()):
        def hook(module, args, kwargs, output, k=k):
            sums[k] += block_cosine(*subject.block_tokens(module, args, kwargs, output)).sum().double()
        hooks.append(block.register_forward_hook(hook, with_kwargs=True))
    try:
        losses = []
        for b, batch in enumerate(data):
            losses.append(subject.losses(batch, batch_seed(seed, b), None))
            count += len(batch[0])
    finally:
        for h in hooks:
            h.remove()
    return torch.cat(losses), (sums / count).tolist()


def interval(differences: torch.Tensor) -> tuple:
    """(mean, half-width of the two-sided t interval at CONFIDENCE) of paired per-sample differences."""
    d = differences.double()
    n = len(d)
    if n < 2:
        return float(d.mean()), float("nan")
    half = stats.t.ppf(0.5 + CONFIDENCE / 2, n - 1) * float(d.std(unbiased=True)) / n ** 0.5
    return float(d.mean()), half


@torch.no_grad()
def damage(subject, data, seed: int, candidate, dense: torch.Tensor) -> dict:
    routed = torch.cat([subject.losses(batch, batch_seed(seed, b), candidate) for b, batch in enumerate(data)])
    mean, half = interval(routed - dense)
    base = float(dense.double().mean())
    return {"loss": float(routed.double().mean()), "damage": mean, "damage_ci": [mean - half, mean + half],
            "relative_damage": mean / base if base else float("nan")}


def step_times(subject, batch, seed: int, candidate, steps: int) -> tuple:
    """Median seconds of a forward + backward of the training loss (no optimizer), unrouted and routed, the two
    alternating step by step so both see the same machine load; one warm-up step each."""
    times = {None: [], candidate: []}
    for k in range(steps + 1):
        for which in times:
            start = time.perf_counter()
            subject.train_step(batch, seed, which)
            if k:
                times[which].append(time.perf_counter() - start)
    return statistics.median(times[None]), statistics.median(times[candidate])


def measure(subject, candidates, batch_count: int, batch_size: int, seed: int, time_steps: int = 0,
            progress=print) -> dict:
    """Every candidate's cost and damage, the unrouted loss and the similarity curve, as a JSON-ready dict."""
    data = batches(subject.samples(batch_count * batch_size, seed), batch_size)
    dense, similarity = unrouted(subject, data, seed)
    rows = []
    for i, candidate in enumerate(candidates):
        cost = subject.cost(candidate) if subject.kind == "dit" else subject.cost(candidate, data[0])
        row = {"route": candidate.name, "start": candidate.start, "end": candidate.end, "ratio": candidate.ratio,
               **cost, **damage(subject, data, seed, candidate, dense)}
        if time_steps:
            dense_time, routed_time = step_times(subject, data[0], seed, candidate, time_steps)
            row.update(unrouted_step_ms=dense_time * 1e3, step_ms=routed_time * 1e3,
                       measured_speedup=dense_time / routed_time)
        rows.append(row)
        progress(f"[{i + 1}/{len(candidates)}] {candidate.name}: speed-up bound {row['flop_speedup_bound']:.3f}x, "
                 f"damage {row['damage']:+.5f} [{row['damage_ci'][0]:+.5f}, {row['damage_ci'][1]:+.5f}]")
    if subject.kind == "diffusers":
        subject.set_route(None)
    mean_dense, _ = interval(dense)
    return {"model": subject.description, "source": subject.source, "depth": subject.depth,
            "samples": batch_count * batch_size, "batches": batch_count, "batch_size": batch_size, "seed": seed,
            "confidence": CONFIDENCE, "unrouted_loss": mean_dense, "time_steps": time_steps,
            "trained_routes": subject.trained,
            "block_similarity": similarity, "routes": rows}


def default_candidates(depth: int) -> list:
    """A grid from the depth: starts at block 0, 2 and a quarter of the way in; ends half way, 4 before the
    last block (the paper's 2 -> 8 on 12 blocks, 2 -> 24 on 28) and 2 before it; ratios 0.25, 0.5, 0.75."""
    starts = sorted({0, min(2, depth - 1), depth // 4})
    ends = sorted({e for e in (depth // 2, depth - 4, depth - 2) if 0 <= e < depth})
    return [Candidate(s, e, r) for s in starts for e in ends if s <= e for r in (0.25, 0.5, 0.75)]
