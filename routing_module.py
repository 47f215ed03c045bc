"""TREAD token routing (Krause et al., ICCV 2025): selection rules (`SELECTIONS`), fusions' registry entry
(`Fusion`), the one route resolver (`resolve_routes`), the primitives a block loop routes with
(`select_kept_tokens`, `start_route`, `end_route`) and `TokenRouter`, which says which routes a forward pass runs
and at what ratio. A route itself (`Route`, its `Schedule`) is declared torch-free in tread_utils/route_spec.py.

What a route does, its keys and how to add a rule or a fusion: docs/extensions.md and docs/configuration.md.
`selection_ratio` is the fraction of tokens that skip (the authors' count, `num_skip = int(N * ratio)`); routing
runs only in training mode unless a forward forces a ratio (`force_routing_ratio`, routing guidance).
"""
import inspect
import re
from collections.abc import Mapping
from dataclasses import fields, replace
from typing import Annotated, Any, Callable, Literal, NamedTuple, Optional, Sequence, get_args, get_origin

import torch
import torch.nn as nn

from tread_utils.route_spec import Route, RouteError, Schedule, is_number, ratio_problem  # noqa: F401  (re-exported)


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


# ---- options: a rule's or a fusion builder's keyword-only parameters ----

class Option(NamedTuple):
    """One keyword-only parameter: its type, the values it allows in words (an interval such as "[0, 1)" from
    `Annotated[float, "[0, 1)"]`, "[0.0, 2.0]" from `Annotated[float, 0.0, 2.0]`, or "one of a, b" from
    `Literal["a", "b"]`; "" when any value of the type goes) and its default."""
    kind: type
    allowed: str
    default: Any


def _interval(text: str):
    match = re.fullmatch(r"\s*([\[(])\s*([^,]+?)\s*,\s*([^,]+?)\s*([\])])\s*", text)
    assert match, f"an option's interval is written like [0, 1) or (0, inf], got {text!r}"
    return match[1] == "[", float(match[2]), float(match[3]), match[4] == "]"


def _allows(option: Option, value) -> bool:
    if option.allowed.startswith("one of "):
        return value in option.allowed[len("one of "):].split(", ")
    if not option.allowed:
        return True
    closed_low, low, high, closed_high = _interval(option.allowed)
    return (low <= value if closed_low else low < value) and (value <= high if closed_high else value < high)


def keyword_options(fn) -> dict:
    """A function's options, name -> `Option`, from its keyword-only parameters."""
    options = {}
    for p in inspect.signature(fn).parameters.values():
        if p.kind is not p.KEYWORD_ONLY:
            continue
        kind, allowed = p.annotation, ""
        if get_origin(kind) is Annotated:  # Annotated[float, "[0, 1)"], or Annotated[float, low, high]: [low, high]
            kind, *bounds = get_args(kind)
            allowed = bounds[0] if len(bounds) == 1 else f"[{bounds[0]}, {bounds[1]}]"
            _interval(allowed)
        if get_origin(kind) is Literal:
            allowed, kind = "one of " + ", ".join(get_args(kind)), str
        options[p.name] = Option(kind, allowed, p.default)
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
        option = accepted[key]
        kind = option.kind
        ok = is_number(value, integer=kind is int) if kind in (int, float) else isinstance(value, kind)
        if not ok:
            raise RouteError(f"{name}: {what.split()[0]} option {key} must be {kind.__name__}, got {value!r}")
        if not _allows(option, value):
            where = "in " if option.allowed[0] in "[(" else ""
            raise RouteError(f"{name}: {key} must be {where}{option.allowed}, got {value!r}")
        checked[key] = kind(value)
    return dict(sorted(checked.items()))


def check_selection(rule, options, name: str) -> dict:
    """The route's rule and options, checked against the rule's signature: {key: value} in key order."""
    if rule not in SELECTIONS:
        raise RouteError(f"{name}: selection must be one of {', '.join(SELECTIONS)}, got {rule!r}{IMPORTS_HINT}")
    return check_options(SELECTIONS[rule], options, name, f"selection {rule}")


# a name a registry does not hold may be one the user registers in a module of their own
IMPORTS_HINT = " (one registered in a module of yours: imports=[your_module])"


class Fusion(NamedTuple):
    """How a route gives the full sequence back when it is not TREAD's rejoin (a route's `fusion` other than
    none; docs/extensions.md, "Fusions"). `build(hidden_size, route, **fusion_options)` makes the model's module
    for one route, `flops(hidden_size, num_tokens)` counts its forward per sample for the FLOP report, and
    `drops_deep_path` says that its module also builds the sequence without the route's blocks, which is what
    path-drop guidance needs."""
    build: Callable
    flops: Callable
    drops_deep_path: bool = False


def check_fusion(route: Route, fusions: dict, name: str) -> Route:
    """The route with its fusion's name and options checked against `fusions` (a model's registry)."""
    if route.fusion == "none":
        if route.fusion_options:
            raise RouteError(f"{name}: fusion_options {route.fusion_options} need a fusion other than none")
        return route
    if route.fusion not in fusions:
        raise RouteError(f"{name}: fusion must be one of none, {', '.join(fusions)}, got {route.fusion!r}"
                         f"{IMPORTS_HINT}")
    options = check_options(fusions[route.fusion].build, route.fusion_options, name, f"fusion {route.fusion}")
    return replace(route, fusion_options=options)


def saved_routes(routes: Optional[Sequence], fusions: dict) -> list:
    """Routes as a run or an export saved them, in today's keys: a fusion's setting once kept beside the route
    (sprint's `path_drop_prob`, ...) moves into its `fusion_options`, and one the route's fusion does not take is
    dropped if it holds that setting's default. Only for saved configs: the command line's old keys are refused."""
    known = {f.name for f in fields(Route)}
    defaults = {key: option.default for entry in fusions.values() for key, option in keyword_options(entry.build).items()}
    out = []
    for r in routes or []:
        if not isinstance(r, Mapping) or not set(r) - known:
            out.append(r)
            continue
        r = dict(r)
        fusion = r.get("fusion") or "none"
        takes = keyword_options(fusions[fusion].build) if fusion in fusions else {}
        for key in sorted(set(r) - known):
            if key in takes:
                r["fusion_options"] = {key: r.pop(key), **(r.get("fusion_options") or {})}
            elif key in defaults and r[key] == defaults[key]:
                del r[key]
        out.append(r)
    return out


def resolve_routes(routes: Optional[Sequence], depth: int, fusions: Optional[dict] = None) -> list:
    """The one resolver: routes from the config (mappings) or `Route`s, placed in a model of `depth` blocks
    (negative indices as block numbers, in order, without overlap), each selection rule and, with `fusions` (a
    model's registry), each fusion checked with its options. Idempotent: resolved routes come back equal."""
    placed = []
    for i, r in enumerate(routes or []):
        route = Route.placed(r, depth, i)
        if placed and route.start_layer_idx <= placed[-1].end_layer_idx:
            prev = placed[-1]
            raise RouteError(f"route {i} ({route.start_layer_idx} -> {route.end_layer_idx}): overlaps or comes "
                             f"before route {i - 1} ({prev.start_layer_idx} -> {prev.end_layer_idx}) in a model of "
                             f"depth {depth}; list routes in order, each starting after the previous one ends")
        name = f"route {i} ({route.start_layer_idx} -> {route.end_layer_idx}, ratio {route.selection_ratio})"
        route = replace(route, options=check_selection(route.selection, route.options, name))
        placed.append(route if fusions is None else check_fusion(route, fusions, name))
    return placed


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


def end_route(x_kept: torch.Tensor, x_shallow: torch.Tensor, keep_idx: torch.Tensor) -> torch.Tensor:
    """The full sequence: processed kept tokens at their positions, skipped tokens as they left (`x_shallow`, the
    route's input)."""
    return x_shallow.to(x_kept.dtype).scatter(1, _expand(keep_idx, x_shallow.shape[-1]), x_kept)


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
                   positions: Optional[torch.Tensor] = None, tap=None, droppable=frozenset()) -> "RoutingPass":
        """The routing state of one forward pass over tokens x [B, N, C] (the model's forward keywords; `fusions`:
        the model's fusion modules by route index, `droppable` the indices of those that can drop their route's
        deep path; `positions`: per-token tensors that travel with the kept tokens)."""
        fusions = {} if fusions is None else fusions
        if drop_deep_path and not droppable:
            raise RouteError("drop_deep_path (path-drop guidance) needs a route whose fusion can drop its deep path "
                             "(e.g. fusion=sprint); this model has none")
        starts = self.plan(force_ratio, fused=fusions)
        generator = None
        if seed is not None and starts:
            generator = torch.Generator(device=x.device).manual_seed(int(seed))
        return RoutingPass(starts, fusions, generator, force_keep, drop_deep_path and droppable, positions, tap,
                           self.fp32_after_route)


class RoutingPass:
    """One forward pass's routing, for a block loop that reads as the paper's:

        for i, block in enumerate(blocks):
            x = routing.enter(i, x)          # a route starts: its kept tokens go on, the full sequence waits
            if routing.runs(i):              # not a block that path-drop guidance skips
                x = routing.tap(i, run(block, x, c, routing.fp32(i), routing.positions))
            x = routing.leave(i, x)          # a route ends: the full sequence restored

    It holds the route in flight (its kept tokens' indices, its input, its fusion module), the positions of the
    tokens in flight, and the block after a route that dropped tokens (`fp32`). The primitives are called through
    this module's names, so code that patches `routing_module.select_kept_tokens`, `start_route` or `end_route`
    (the paper-parity harness) routes every model's loop."""

    def __init__(self, starts: dict, fusions, generator, force_keep, dropped_paths, positions, tap,
                 fp32_after_route: bool):
        self.starts, self.fusions, self.generator = starts, fusions, generator
        self.force_keep, self.dropped_paths, self._tap = force_keep, dropped_paths or frozenset(), tap
        self.fp32_after_route = fp32_after_route
        self.all_positions = self.positions = positions
        self.end = self.key = self.keep_idx = self.x_shallow = self.fusion = self.fp32_block = None
        self.dropped = False

    def enter(self, i: int, x: torch.Tensor) -> torch.Tensor:
        """Before block i: where a route starts, its kept tokens (every token, in order, at ratio 0: a fusion's
        route, whose module is then given all the indices)."""
        if i not in self.starts:
            return x
        k, route, ratio = self.starts[i]
        self.end, self.key, self.x_shallow = route.end_layer_idx, str(k), x
        self.fusion = self.fusions[self.key] if self.key in self.fusions else None
        self.dropped = ratio > 0
        if not self.dropped:
            self.keep_idx = torch.arange(x.shape[1], device=x.device).expand(x.shape[0], -1)
            return x
        self.keep_idx = select_kept_tokens(x, ratio, self.generator, route.selection, self.force_keep,
                                           **route.options)
        if self.positions is not None:  # the kept tokens carry their own positions through the route
            self.positions = start_route(self.positions, self.keep_idx)
        return start_route(x, self.keep_idx)

    def runs(self, i: int) -> bool:
        """False for a route's blocks when path-drop guidance drops its deep path (a fusion that can)."""
        return not (self.end is not None and self.key in self.dropped_paths)

    def fp32(self, i: int) -> bool:
        """Block i follows a route that dropped tokens: it sees tokens from two depths at once, and with
        fp32_after_route runs outside autocast, as the official code does."""
        return self.fp32_after_route and i == self.fp32_block

    def tap(self, i: int, x: torch.Tensor) -> torch.Tensor:
        """Block i's output, shown to the tap (REPA's alignment: the tokens and, inside a route that dropped
        tokens, their indices)."""
        if self._tap is not None and i == self._tap.block:
            self._tap(x, self.keep_idx if self.dropped else None)
        return x

    def leave(self, i: int, x: torch.Tensor) -> torch.Tensor:
        """After block i: where the route in flight ends, the full sequence (the skipped tokens rejoin, TREAD's
        end_route, or the route's fusion)."""
        if i != self.end:
            return x
        if self.fusion is None:
            x = end_route(x, self.x_shallow, self.keep_idx) if self.dropped else x
        elif not self.runs(i):
            x = self.fusion(None, self.x_shallow, self.keep_idx, drop_all=True)
        else:
            x = self.fusion(x, self.x_shallow, self.keep_idx)
        self.fp32_block = i + 1 if self.dropped else None
        self.end = self.key = self.keep_idx = self.x_shallow = self.fusion = None
        self.dropped = False
        self.positions = self.all_positions
        return x
