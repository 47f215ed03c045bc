"""TREAD token routing (Krause et al., ICCV 2025).

A route `start -> end` takes a random subset of tokens out of the sequence before block `start` and
puts them back, unchanged, after block `end` (inclusive). Only the kept tokens pass through the
blocks in between; the skipped ones travel one way along an identity path, so the full sequence is
restored and gradients reach every token. `selection_ratio` is the fraction of tokens that SKIP
(official count: `num_skip = int(N * ratio)`).

Routing is active only while the model is in training mode. To force it at inference (e.g. for
routing guidance), pass `force_routing_ratio=r` to the model's forward: every configured route then
runs with ratio r. `routing_seed=s` makes the token choice reproducible (same seed, same tokens).

Selection per route: a rule of `SELECTIONS` scores every token and the router keeps the highest-scoring
ones. `random` (the paper's, the default) scores uniformly; `importance` scores by the L1 norm of the
hidden vector (see its function). A rule's keyword-only options are the route's `options`, checked
against its signature when the routes are resolved; a new rule is one function added to `SELECTIONS`.

Ratio schedules: a route may vary its ratio with the training step, `schedule = {kind: constant | linear
| cosine, start_ratio, end_ratio, start_step, end_step, levels}`. `constant` (the default) is
`selection_ratio` throughout; `linear` / `cosine` hold `start_ratio` (null: `selection_ratio`) up to
`start_step`, move to `end_ratio` by `end_step` (cosine: slow at both ends) and hold it after. `levels=L`
rounds the ratio to L evenly spaced values from start_ratio to end_ratio. The router is told the step by
`set_step(step, off_after)` (training/loop.py, before each step) and the ratio is a pure function of it, so a
resumed run routes as an uninterrupted one; `off_after=S` turns every route off from step S on. The kept
count changes with the ratio, and torch.compile recompiles the model for each distinct count (dynamo
keeps 8 by default): a smooth schedule over many steps wants `levels` of a few values.

Fusion per route: `none` (TREAD, above) or `sprint` (backbones/sprint.py): the skipped positions come back
as a mask token, and the route's output is a projection of [deep output, route input]; the model owns
those parameters and passes them in (`fusions`), so the router itself still holds none.

`force_keep` ([B, N] bool, a forward keyword) marks tokens that are never skipped. The kept count
must be the same for every sample of a batch, so it is `max(N - int(N * ratio), most forced tokens
in any sample)`: a sample with many forced tokens raises the kept count of the whole batch, and
samples with fewer fill the rest by their selection rule.
"""
import inspect
import math
from dataclasses import dataclass, fields
from typing import Annotated, Optional, Sequence, get_args, get_origin

import torch
import torch.nn as nn

from tread_utils.errors import UserError

SCHEDULE_KINDS = ("constant", "linear", "cosine")
FUSIONS = ("none", "sprint")                  # how a route ends: end_route, or SPRINT's (backbones/sprint.py)
MASK_TOKEN_INITS = ("normal", "zeros")
FUSION_INITS = ("xavier", "deep")


# ---- selection rules: fn(x [B, N, D], generator or None, **options) -> scores [B, N]; the highest are kept ----

@torch.compiler.disable
def _seeded_uniform(B: int, N: int, device, generator: torch.Generator) -> torch.Tensor:
    """A seeded draw (routing guidance at inference) runs eagerly: dynamo cannot trace a Generator argument."""
    return torch.rand(B, N, device=device, generator=generator)


def random_scores(x: torch.Tensor, generator: Optional[torch.Generator]) -> torch.Tensor:
    """Uniform noise in [0, 1): a random subset, the paper's rule."""
    if generator is None:  # rand_like traces with a symbolic batch size (torch.rand(B, N, generator=None) does not)
        return torch.rand_like(x[:, :, 0], dtype=torch.float32, memory_format=torch.contiguous_format)
    return _seeded_uniform(x.shape[0], x.shape[1], x.device, generator)


def importance_scores(x: torch.Tensor, generator: Optional[torch.Generator], *,
                      importance_mix: Annotated[float, 0.0, 1.0] = 0.0) -> torch.Tensor:
    """The L1 norm of each token, min-max normalised per sample, mixed with uniform noise:
    `importance_mix * norm + (1 - importance_mix) * noise` (1: the highest-norm tokens; 0: random)."""
    noise = random_scores(x, generator)
    if importance_mix == 0:
        return noise
    norm = x.detach().float().abs().sum(-1)
    lo, hi = norm.amin(1, keepdim=True), norm.amax(1, keepdim=True)
    norm = (norm - lo) / (hi - lo).clamp_min(1e-12)
    return importance_mix * norm + (1.0 - importance_mix) * noise


SELECTIONS = {"random": random_scores, "importance": importance_scores}


def selection_options(rule: str) -> dict:
    """A rule's options: name -> (type, (low, high) or None, default), from its keyword-only parameters
    (`Annotated[float, low, high]` gives an inclusive range)."""
    options = {}
    for p in inspect.signature(SELECTIONS[rule]).parameters.values():
        if p.kind is p.KEYWORD_ONLY:
            kind, bounds = p.annotation, None
            if get_origin(kind) is Annotated:
                kind, *bounds = get_args(kind)
            options[p.name] = (kind, tuple(bounds) if bounds else None, p.default)
    return options


def is_number(value, integer: bool = False) -> bool:
    """An int or float (never a bool), integral when `integer`: a config value taken as it is, never converted
    (2.5 is not a block, false is not a ratio)."""
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    return number and (not integer or float(value).is_integer())


def check_selection(rule, options, name: str) -> tuple:
    """The route's rule and options, checked against the rule's signature: ((key, value), ...) sorted."""
    if rule not in SELECTIONS:
        raise RouteError(f"{name}: selection must be one of {', '.join(SELECTIONS)}, got {rule!r}")
    accepted, checked = selection_options(rule), {}
    for key, value in dict(options or {}).items():
        if key not in accepted:
            raise RouteError(f"{name}: selection {rule} has no option {key!r}; its options: "
                             f"{', '.join(accepted) or 'none'}")
        kind, bounds, _ = accepted[key]
        ok = is_number(value, integer=kind is int) if kind in (int, float) else isinstance(value, kind)
        if not ok:
            raise RouteError(f"{name}: selection option {key} must be {kind.__name__}, got {value!r}")
        if bounds and not bounds[0] <= value <= bounds[1]:
            raise RouteError(f"{name}: {key} must be in [{bounds[0]}, {bounds[1]}], got {value}")
        checked[key] = kind(value)
    return tuple(sorted(checked.items()))


@dataclass(frozen=True)
class Schedule:
    kind: str = "constant"
    start_ratio: float = 0.0
    end_ratio: float = 0.0
    start_step: int = 0
    end_step: int = 0
    levels: Optional[int] = None

    def ratio_at(self, step: int) -> float:
        """The ratio at a training step (not for kind constant: the route's selection_ratio is)."""
        t = min(max((step - self.start_step) / (self.end_step - self.start_step), 0.0), 1.0)
        if self.kind == "cosine":
            t = 0.5 * (1.0 - math.cos(math.pi * t))
        if self.levels:
            t = round(t * (self.levels - 1)) / (self.levels - 1)
        return self.start_ratio + (self.end_ratio - self.start_ratio) * t


@dataclass(frozen=True)
class Route:
    start_layer_idx: int
    end_layer_idx: int
    selection_ratio: float
    selection: str = "random"
    options: tuple = ()                       # the selection rule's keyword options, ((key, value), ...)
    schedule: Schedule = Schedule()
    fusion: str = "none"
    path_drop_prob: float = 0.1
    mask_token_trainable: bool = False
    mask_token_init: str = "normal"
    fusion_init: str = "xavier"

    def ratio_at(self, step: Optional[int]) -> float:
        """The ratio in training at `step` (None: not told, the schedule's start)."""
        if self.schedule.kind == "constant":
            return self.selection_ratio
        return self.schedule.ratio_at(self.schedule.start_step if step is None else step)


DEFAULT_ROUTE = Route(0, 0, 0.0)  # its optional keys' defaults (tests/test_config_schema.py: the schema's are these)


class RouteError(UserError):
    """An invalid route configuration."""


LEGACY_OPTIONS = ("importance_mix",)  # a selection option also accepted as a key of the route itself
ROUTE_KEYS = tuple(f.name for f in fields(Route)) + LEGACY_OPTIONS
SCHEDULE_KEYS = tuple(f.name for f in fields(Schedule))


def resolve_schedule(spec, ratio: float, name: str) -> Schedule:
    """A route's `schedule` mapping (None: constant) as a checked `Schedule`."""
    spec = dict(spec or {})
    unknown = sorted(set(spec) - set(SCHEDULE_KEYS))
    if unknown:
        raise RouteError(f"{name}: unknown schedule key(s) {unknown}; accepted: {', '.join(SCHEDULE_KEYS)}")
    kind = str(spec.get("kind") or DEFAULT_ROUTE.schedule.kind)
    if kind not in SCHEDULE_KINDS:
        raise RouteError(f"{name}: schedule.kind must be one of {', '.join(SCHEDULE_KINDS)}, got {kind!r}")
    if kind == "constant":
        return Schedule()
    try:
        start_ratio = float(ratio if spec.get("start_ratio") is None else spec["start_ratio"])
        end_ratio, end_step = float(spec["end_ratio"]), int(spec["end_step"])
        start_step = int(spec.get("start_step") or 0)
        levels = None if spec.get("levels") is None else int(spec["levels"])
    except (KeyError, TypeError, ValueError):
        raise RouteError(f"{name}: a {kind} schedule needs a float end_ratio and an integer end_step (and "
                         f"optionally start_ratio, start_step, levels), got {spec}") from None
    for which, r in (("start_ratio", start_ratio), ("end_ratio", end_ratio)):
        if not 0.0 <= r < 1.0:
            raise RouteError(f"{name}: schedule.{which} must be in [0, 1), got {r}")
    if not 0 <= start_step < end_step:
        raise RouteError(f"{name}: the schedule needs 0 <= start_step < end_step, got {start_step} and {end_step}")
    if levels is not None and levels < 2:
        raise RouteError(f"{name}: schedule.levels must be at least 2 (or null: no rounding), got {levels}")
    return Schedule(kind, start_ratio, end_ratio, start_step, end_step, levels)


def resolve_fusion(r, name: str) -> dict:
    """A route's fusion options (backbones/sprint.py), checked; a key left out or null takes `Route`'s default."""
    out = {key: DEFAULT_ROUTE.__dict__[key] if r.get(key) is None else r[key]
           for key in ("fusion", "path_drop_prob", "mask_token_trainable", "mask_token_init", "fusion_init")}
    for key, allowed in (("fusion", FUSIONS), ("mask_token_init", MASK_TOKEN_INITS), ("fusion_init", FUSION_INITS)):
        if out[key] not in allowed:
            raise RouteError(f"{name}: {key} must be one of {', '.join(allowed)}, got {out[key]!r}")
    if not isinstance(out["path_drop_prob"], (int, float)) or not 0.0 <= out["path_drop_prob"] < 1.0:
        raise RouteError(f"{name}: path_drop_prob must be in [0, 1) (the fraction of training samples whose deep "
                         f"path is replaced by mask tokens), got {out['path_drop_prob']!r}")
    if not isinstance(out["mask_token_trainable"], bool):
        raise RouteError(f"{name}: mask_token_trainable must be true or false, got {out['mask_token_trainable']!r}")
    out["path_drop_prob"] = float(out["path_drop_prob"])
    return out


def resolve_routes(routes: Optional[Sequence], depth: int) -> list:
    """Validate routes from the config and return them as `Route`s with non-negative indices.

    Negative indices count from the last block (-1 = block depth-1). Routes must lie inside the
    model, start <= end, ratio in [0, 1), and be ordered without overlap.
    """
    resolved = []
    for i, r in enumerate(routes or []):
        unknown = sorted(set(r) - set(ROUTE_KEYS)) if hasattr(r, "keys") else []
        if unknown:  # a misspelt option would otherwise fall back to its default unseen
            raise RouteError(f"route {i}: unknown key(s) {unknown}; accepted: {', '.join(ROUTE_KEYS)}")
        if not hasattr(r, "keys"):
            raise RouteError(f"route {i} ({r!r}) needs integer start_layer_idx, end_layer_idx and a float "
                             f"selection_ratio")
        missing = [k for k in ("start_layer_idx", "end_layer_idx", "selection_ratio") if r.get(k) is None]
        if missing:
            raise RouteError(f"route {i} needs integer start_layer_idx, end_layer_idx and a float selection_ratio; "
                             f"it has no {' or '.join(missing)}")
        start, end, ratio = r["start_layer_idx"], r["end_layer_idx"], r["selection_ratio"]
        for which, value, integer in (("start_layer_idx", start, True), ("end_layer_idx", end, True),
                                      ("selection_ratio", ratio, False)):
            if not is_number(value, integer):
                raise RouteError(f"route {i}: {which} must be {'an integer' if integer else 'a number'}, "
                                 f"got {value!r}")
        start, end, ratio = int(start), int(end), float(ratio)
        name = f"route {i} ({start} -> {end}, ratio {ratio})"
        for which, idx in (("start_layer_idx", start), ("end_layer_idx", end)):
            if not -depth <= idx < depth:
                raise RouteError(f"{name}: {which}={idx} is outside a model of depth {depth} "
                                 f"(valid: 0..{depth - 1}, or -{depth}..-1 counting from the last block)")
        start, end = start % depth, end % depth
        if start > end:
            raise RouteError(f"{name}: start block {start} comes after end block {end} (depth {depth}); "
                             f"a route runs forward from start_layer_idx to end_layer_idx")
        if not 0.0 <= ratio < 1.0:
            raise RouteError(f"{name}: selection_ratio must be in [0, 1) (the fraction of tokens that skip), "
                             f"got {ratio}")
        selection = str(DEFAULT_ROUTE.selection if r.get("selection") is None else r["selection"])
        options = dict(r.get("options") or {})
        options.update({k: r[k] for k in LEGACY_OPTIONS if r.get(k) is not None})
        options = check_selection(selection, options, name)
        if resolved and start <= resolved[-1].end_layer_idx:
            prev = resolved[-1]
            raise RouteError(f"{name}: overlaps or comes before route {i - 1} ({prev.start_layer_idx} -> "
                             f"{prev.end_layer_idx}) in a model of depth {depth}; list routes in order, "
                             f"each starting after the previous one ends")
        schedule = resolve_schedule(r.get("schedule"), ratio, name)
        resolved.append(Route(start, end, ratio, selection, options, schedule, **resolve_fusion(r, name)))
    return resolved


def as_routes(routes: Optional[Sequence], depth: int) -> list:
    """Routes already resolved (`Route`s, e.g. a model's `router.routes`) as they are; a config's mappings
    resolved (`resolve_routes`). Resolving happens once, where a launch reads the config; the model, the FLOP
    report and the exports then pass the objects along."""
    routes = list(routes or [])
    if all(isinstance(r, Route) for r in routes):
        assert all(r.end_layer_idx < depth for r in routes), f"routes {routes} do not fit {depth} blocks"
        return routes
    return resolve_routes(routes, depth)


def num_kept(num_tokens: int, ratio: float) -> int:
    return num_tokens - int(num_tokens * ratio)


def select_kept_tokens(x: torch.Tensor, ratio: float, generator: Optional[torch.Generator] = None,
                       selection: str = "random", force_keep: Optional[torch.Tensor] = None, **options):
    """Indices [B, K] of the tokens that go through the route: the K highest-scoring under the selection rule
    (forced tokens first), sorted so that kept tokens keep their order."""
    score = SELECTIONS[selection](x, generator, **options)
    k = num_kept(x.shape[1], ratio)
    if force_keep is not None:
        force_keep = force_keep.to(device=x.device, dtype=torch.bool)
        score = score.masked_fill(force_keep, float("inf"))
        k = max(k, int(force_keep.sum(1).max()))
    keep = score.topk(k, dim=1, sorted=False).indices
    return keep.sort(dim=1).values


def _expand(idx: torch.Tensor, dim: int) -> torch.Tensor:
    return idx.unsqueeze(-1).expand(-1, -1, dim)


def start_route(x: torch.Tensor, keep_idx: torch.Tensor) -> torch.Tensor:
    """The kept tokens [B, K, D] that go through the route's blocks."""
    return torch.gather(x, 1, _expand(keep_idx, x.shape[-1]))


def end_route(x_kept: torch.Tensor, x_full: torch.Tensor, keep_idx: torch.Tensor) -> torch.Tensor:
    """The full sequence: processed kept tokens at their positions, skipped tokens as they left."""
    return x_full.to(x_kept.dtype).scatter(1, _expand(keep_idx, x_full.shape[-1]), x_kept)


def _call_block(block, x, c):
    return block(x, c)


def _autocast_on(device_type: str) -> bool:
    return device_type in ("cuda", "cpu", "xpu", "mps") and torch.is_autocast_enabled(device_type)


class TokenRouter(nn.Module):
    """Runs a stack of blocks `block(x, c) -> x` over tokens [B, N, D] with TREAD routes.

    Architecture-agnostic: any block that maps a token sequence to one of the same length works,
    whatever N is; the router holds no parameters and does not own the blocks, so a backbone's
    state dict is the same with and without routing. It follows the model's train()/eval() mode.
    `fp32_after_route` runs the block right after a route ends outside autocast, as the official
    code does, since it sees tokens from two depths at once.
    """

    def __init__(self, routes: Sequence[Route], enable_routing: bool = True, fp32_after_route: bool = True):
        super().__init__()
        self.routes = list(routes)
        self.enable_routing = enable_routing
        self.fp32_after_route = fp32_after_route
        self.step: Optional[int] = None       # the training step, for ratio schedules (set_step)
        self._step_ratios = tuple(r.ratio_at(None) for r in self.routes)

    def set_step(self, step: int, off_after: Optional[int] = None):
        """Tell the router the training step about to run: scheduled ratios follow it, and from step `off_after`
        on (train.routing_off_after; None: never) every route is off. The ratios are computed here, not in
        forward, so a compiled forward guards on them, not on the step."""
        self.step = int(step)
        off = off_after is not None and self.step >= off_after
        self._step_ratios = tuple(0.0 if off else r.ratio_at(self.step) for r in self.routes)

    def extra_repr(self):
        return f"routes={self.routes}, enable_routing={self.enable_routing}"

    def active_ratios(self, force_ratio: Optional[float]) -> list:
        """The ratio each route runs with in this call (0 = route off)."""
        if force_ratio is not None:
            if not self.routes:
                raise RouteError("force_routing_ratio needs at least one configured route (model.params.routes)")
            if not 0.0 <= force_ratio < 1.0:
                raise RouteError(f"force_routing_ratio must be in [0, 1), got {force_ratio}")
            return [float(force_ratio)] * len(self.routes)
        on = self.training and self.enable_routing
        return [ratio if on else 0.0 for ratio in self._step_ratios]

    def _plan(self, force_ratio: Optional[float], fusions) -> list:
        """(route, ratio, fusion or None) for each route this call runs: ratio > 0, or a fusion, which ends its
        route even when no token is dropped."""
        plan = []
        for k, (route, ratio) in enumerate(zip(self.routes, self.active_ratios(force_ratio))):
            fusion = fusions[str(k)] if fusions is not None and str(k) in fusions else None
            if ratio > 0 or fusion is not None:
                plan.append((route, ratio, fusion))
        return plan

    def forward(self, blocks: Sequence[nn.Module], x, c, force_ratio: Optional[float] = None,
                seed: Optional[int] = None, run_block=None, force_keep: Optional[torch.Tensor] = None,
                fusions: Optional[nn.ModuleDict] = None, drop_deep_path: bool = False, tap=None):
        """Each route: select the kept tokens, run the route's blocks on them, restore the full sequence.

        `run_block(block, x, c)` lets the caller wrap each call (e.g. activation checkpointing).
        `fusions`: route index (str) -> the module that restores that route instead of `end_route`, called as
        `fusion(x_deep, x_route_input, keep_idx)` (SPRINT's, backbones/sprint.py); `drop_deep_path` skips the
        blocks of those routes and calls `fusion(None, x_route_input, keep_idx, drop_all=True)`.
        `tap`: an object with a `block` index, called as `tap(hidden, keep_idx)` after that block (REPA's,
        training/repa.py); inside a route `hidden` holds the kept tokens only and keep_idx their positions."""
        if run_block is None:
            run_block = _call_block
        plan = self._plan(force_ratio, fusions)
        generator = None
        if seed is not None and plan:
            generator = torch.Generator(device=x.device).manual_seed(int(seed))
        done, fp32_block = 0, None
        for route, ratio, fusion in plan:
            first, last = route.start_layer_idx, route.end_layer_idx
            x = self._run_blocks(blocks, done, first, x, c, run_block, tap, None, fp32_block)
            x_route, keep_idx = x, None
            if ratio > 0:  # select
                keep_idx = select_kept_tokens(x, ratio, generator, route.selection, force_keep, **dict(route.options))
                x = start_route(x, keep_idx)
            if drop_deep_path and fusion is not None:  # path-drop guidance's weak branch: mask tokens only
                x = fusion(None, x_route, keep_idx, drop_all=True)
            else:  # run, restore
                x = self._run_blocks(blocks, first, last + 1, x, c, run_block, tap, keep_idx, fp32_block)
                x = end_route(x, x_route, keep_idx) if fusion is None else fusion(x, x_route, keep_idx)
            done = last + 1
            fp32_block = done if keep_idx is not None else None
        return self._run_blocks(blocks, done, len(blocks), x, c, run_block, tap, None, fp32_block)

    def _run_blocks(self, blocks, first: int, stop: int, x, c, run_block, tap, keep_idx, fp32_block):
        """Blocks first..stop-1. Block `fp32_block` follows a route that dropped tokens: with fp32_after_route it
        runs outside autocast, as the official code does, since it sees tokens from two depths at once."""
        for i in range(first, stop):
            if i == fp32_block and self.fp32_after_route and _autocast_on(x.device.type):
                with torch.autocast(device_type=x.device.type, enabled=False):
                    x = run_block(blocks[i], x.float(), c.float())
            else:
                x = run_block(blocks[i], x, c)
            if tap is not None and i == tap.block:
                tap(x, keep_idx)
        return x
