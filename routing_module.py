"""TREAD token routing (Krause et al., ICCV 2025): the selection rules, the primitives a model's block loop
routes with (`select_kept_tokens` before a route's first block, `start_route`, `end_route` after its last;
dit.DiT.forward, and the diffusers hooks of tread_diffusers/tread.py) and `TokenRouter`, which says which
routes a forward pass runs and at what ratio. A route itself (`Route`, its `Schedule`) is declared in
tread_utils/route_spec.py, torch-free, and re-exported here.

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

Fusion per route, how it restores the sequence: `none` (TREAD: `end_route`) or `sprint` (backbones/sprint.py):
the skipped positions come back as a mask token, and the route's output is a projection of [deep output, route
input]; the model owns those parameters (`DiT.fusions`), so the router holds none.

`force_keep` ([B, N] bool, a forward keyword) marks tokens that are never skipped. The kept count
must be the same for every sample of a batch, so it is `max(N - int(N * ratio), most forced tokens
in any sample)`: a sample with many forced tokens raises the kept count of the whole batch, and
samples with fewer fill the rest by their selection rule.
"""
import inspect
from dataclasses import replace
from typing import Annotated, Callable, NamedTuple, Optional, Sequence, get_args, get_origin

import torch
import torch.nn as nn

from tread_utils.route_spec import (Route, RouteError, Schedule, is_number, place_routes,  # noqa: F401  (re-exported)
                                    ratio_problem)


# ---- selection rules: fn(x [B, N, D], generator or None, **options) -> scores [B, N]; the highest are kept ----

@torch._disable_dynamo  # torch.compiler.disable's lazy form: dynamo (two seconds) is imported at the first call
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


def keyword_options(fn) -> dict:
    """A function's options: name -> (type, (low, high) or None, default), from its keyword-only parameters
    (`Annotated[float, low, high]` gives an inclusive range)."""
    options = {}
    for p in inspect.signature(fn).parameters.values():
        if p.kind is p.KEYWORD_ONLY:
            kind, bounds = p.annotation, None
            if get_origin(kind) is Annotated:
                kind, *bounds = get_args(kind)
            options[p.name] = (kind, tuple(bounds) if bounds else None, p.default)
    return options


def selection_options(rule: str) -> dict:
    """A selection rule's options (`keyword_options`)."""
    return keyword_options(SELECTIONS[rule])


def check_options(fn, options, name: str, what: str) -> dict:
    """`options` checked against `fn`'s keyword-only parameters: {key: value} in key order."""
    accepted, checked = keyword_options(fn), {}
    for key, value in dict(options or {}).items():
        if key not in accepted:
            raise RouteError(f"{name}: {what} has no option {key!r}; its options: {', '.join(accepted) or 'none'}")
        kind, bounds, _ = accepted[key]
        ok = is_number(value, integer=kind is int) if kind in (int, float) else isinstance(value, kind)
        if not ok:
            raise RouteError(f"{name}: {what.split()[0]} option {key} must be {kind.__name__}, got {value!r}")
        if bounds and not bounds[0] <= value <= bounds[1]:
            raise RouteError(f"{name}: {key} must be in [{bounds[0]}, {bounds[1]}], got {value}")
        checked[key] = kind(value)
    return dict(sorted(checked.items()))


def check_selection(rule, options, name: str) -> dict:
    """The route's rule and options, checked against the rule's signature: {key: value} in key order."""
    if rule not in SELECTIONS:
        raise RouteError(f"{name}: selection must be one of {', '.join(SELECTIONS)}, got {rule!r}")
    return check_options(SELECTIONS[rule], options, name, f"selection {rule}")


class Restore(NamedTuple):
    """A restore strategy: how a route gives the full sequence back other than by rejoining the skipped tokens
    unchanged (`end_route`, the route's `fusion: none`). A model registers its strategies by name
    (dit.RESTORES).

    build(hidden_size, route, **options) -> the model's module for one route (its parameters in the state dict
    under `fusions.K`); the route's `fusion_options` are checked against build's keyword-only parameters. The
    module is called where the route ends, module(x_deep [B, K, C], x_shallow [B, N, C] the route's input,
    keep_idx [B, K]) -> [B, N, C]; `reset_parameters()`, if it has one, runs after the model's initialisation.
    A module with `drops_deep_path = True` also takes (None, x_shallow, keep_idx, drop_all=True): the route's
    blocks skipped (path-drop guidance).
    flops(hidden_size, num_tokens) -> its forward FLOPs per sample, for the FLOP report's analytic count."""
    build: Callable
    flops: Callable


def check_restore(route: Route, restores: dict, name: str) -> Route:
    """The route with its restore strategy's name and options checked against `restores` (a model's registry)."""
    if route.fusion == "none":
        if route.fusion_options:
            raise RouteError(f"{name}: fusion_options {route.fusion_options} need a restore strategy (fusion)")
        return route
    if route.fusion not in restores:
        raise RouteError(f"{name}: fusion must be one of none, {', '.join(restores)}, got {route.fusion!r}")
    options = check_options(restores[route.fusion].build, route.fusion_options, name, f"fusion {route.fusion}")
    return replace(route, fusion_options=options)


def resolve_routes(routes: Optional[Sequence], depth: int, restores: Optional[dict] = None) -> list:
    """Routes from the config (or `Route`s) placed in a model of `depth` blocks (tread_utils.route_spec.place_routes: negative
    indices as block numbers, in order, without overlap), each with its selection rule and options checked against
    the rule's signature, and with `restores` (a model's registry, dit.RESTORES) its restore strategy too."""
    placed = place_routes(routes, depth)
    for i, route in enumerate(placed):
        name = f"route {i} ({route.start_layer_idx} -> {route.end_layer_idx}, ratio {route.selection_ratio})"
        placed[i] = replace(route, options=check_selection(route.selection, route.options, name))
        if restores is not None:
            placed[i] = check_restore(placed[i], restores, name)
    return placed


def as_routes(routes: Optional[Sequence], depth: int, restores: Optional[dict] = None) -> list:
    """Routes already placed in the model (`Route`s, e.g. a model's `router.routes`) as they are; a config's
    mappings, or `Route`s with negative indices, resolved (`resolve_routes`). Resolving happens once, where a launch reads the config; the model, the FLOP
    report and the exports then pass the objects along."""
    routes = list(routes or [])
    if all(isinstance(r, Route) and 0 <= r.start_layer_idx <= r.end_layer_idx < depth for r in routes):
        return routes
    return resolve_routes(routes, depth, restores)  # mappings, or Routes built with negative indices


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


def autocast_on(device_type: str) -> bool:
    return device_type in ("cuda", "cpu", "xpu", "mps") and torch.is_autocast_enabled(device_type)


class TokenRouter(nn.Module):
    """Which routes a forward pass runs, and at what ratio; `start_pass` gives the block loop of one forward pass
    its `RoutingPass` (dit.DiT.forward).

    It holds no parameters and no blocks, so a backbone's state dict is the same with and without routing, and it
    follows the model's train()/eval() mode. `fp32_after_route`: the block right after a route that dropped
    tokens runs outside autocast, as the official code does, since it sees tokens from two depths at once.
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
            problem = ratio_problem(force_ratio, "force_routing_ratio")
            if problem:
                raise RouteError(problem)
            return [float(force_ratio)] * len(self.routes)
        on = self.training and self.enable_routing
        return [ratio if on else 0.0 for ratio in self._step_ratios]

    def plan(self, force_ratio: Optional[float], fused=()) -> dict:
        """This call's routes by their start block: start -> (route index, route, ratio). A route runs when it
        drops tokens (ratio > 0) or when its index is in `fused` (it ends in a fusion, run even at ratio 0)."""
        return {route.start_layer_idx: (k, route, ratio)
                for k, (route, ratio) in enumerate(zip(self.routes, self.active_ratios(force_ratio)))
                if ratio > 0 or str(k) in fused}

    def start_pass(self, x: torch.Tensor, force_ratio: Optional[float] = None, seed: Optional[int] = None,
                   force_keep: Optional[torch.Tensor] = None, drop_deep_path: bool = False, fusions=None,
                   positions: Optional[torch.Tensor] = None, tap=None) -> "RoutingPass":
        """The routing state of one forward pass over tokens x [B, N, C] (the model's forward keywords; `fusions`:
        the model's restore modules by route index; `positions`: per-token tensors that travel with the kept
        tokens)."""
        fusions = {} if fusions is None else fusions
        starts = self.plan(force_ratio, fused=fusions)
        generator = None
        if seed is not None and starts:
            generator = torch.Generator(device=x.device).manual_seed(int(seed))
        return RoutingPass(starts, fusions, generator, force_keep, drop_deep_path, positions, tap,
                           self.fp32_after_route)


class RoutingPass:
    """One forward pass's routing, for a block loop that reads as the paper's:

        for i, block in enumerate(blocks):
            x = routing.enter(i, x)          # a route starts: its kept tokens go on, the full sequence waits
            if routing.runs(i):              # not a block that path-drop guidance skips
                x = routing.tap(i, run(block, x, c, routing.fp32(i), routing.positions))
            x = routing.leave(i, x)          # a route ends: the full sequence restored

    It holds the route in flight (its kept tokens' indices, the sequence it left, its restore module), the
    positions of the tokens in flight, and the block after a route that dropped tokens (`fp32`). The primitives
    are called through this module's names, so code that patches `routing_module.select_kept_tokens`,
    `start_route` or `end_route` (the paper-parity harness) routes every model's loop."""

    def __init__(self, starts: dict, fusions, generator, force_keep, drop_deep_path: bool, positions, tap,
                 fp32_after_route: bool):
        self.starts, self.fusions, self.generator = starts, fusions, generator
        self.force_keep, self.drop_deep_path, self._tap = force_keep, drop_deep_path, tap
        self.fp32_after_route = fp32_after_route
        self.all_positions = self.positions = positions
        self.end = self.keep_idx = self.x_route = self.fusion = self.fp32_block = None

    def enter(self, i: int, x: torch.Tensor) -> torch.Tensor:
        """Before block i: where a route starts, its kept tokens (all of them at ratio 0: a fusion route)."""
        if i not in self.starts:
            return x
        k, route, ratio = self.starts[i]
        self.end, self.x_route = route.end_layer_idx, x
        self.fusion = self.fusions[str(k)] if str(k) in self.fusions else None
        if ratio > 0:
            self.keep_idx = select_kept_tokens(x, ratio, self.generator, route.selection, self.force_keep,
                                               **route.options)
            x = start_route(x, self.keep_idx)
            if self.positions is not None:  # the kept tokens carry their own positions through the route
                self.positions = start_route(self.positions, self.keep_idx)
        return x

    def runs(self, i: int) -> bool:
        """False for a route's blocks when path-drop guidance skips its deep path (its restore module drops it)."""
        return not (self.end is not None and self.drop_deep_path and getattr(self.fusion, "drops_deep_path", False))

    def fp32(self, i: int) -> bool:
        """Block i follows a route that dropped tokens: it sees tokens from two depths at once, and with
        fp32_after_route runs outside autocast, as the official code does."""
        return self.fp32_after_route and i == self.fp32_block

    def tap(self, i: int, x: torch.Tensor) -> torch.Tensor:
        """Block i's output, shown to the tap (REPA's alignment: the tokens and, inside a route, their indices)."""
        if self._tap is not None and i == self._tap.block:
            self._tap(x, self.keep_idx)
        return x

    def leave(self, i: int, x: torch.Tensor) -> torch.Tensor:
        """After block i: where the route in flight ends, the full sequence (the skipped tokens rejoin, TREAD's
        end_route, or the route's restore strategy)."""
        if i != self.end:
            return x
        if self.fusion is None:
            x = end_route(x, self.x_route, self.keep_idx)
        elif not self.runs(i):
            x = self.fusion(None, self.x_route, self.keep_idx, drop_all=True)
        else:
            x = self.fusion(x, self.x_route, self.keep_idx)
        self.fp32_block = None if self.keep_idx is None else i + 1
        self.end = self.keep_idx = self.x_route = self.fusion = None
        self.positions = self.all_positions
        return x
