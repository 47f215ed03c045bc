"""A TREAD route, declared once: the config schema node of `model.params.routes` (training/config_schema.py
stores it in Hydra's ConfigStore) and the object the router runs (routing_module.py, whose `resolve_routes`
places a model's routes in its depth and checks the rule and fusion each names). A `Route` holds what every
route has; a fusion's own settings are its `fusion_options`, checked against its builder's signature.

Torch-free, so a config is refused before torch is imported. Both dataclasses are immutable once built, like
`frozen=True` ones, without declaring it: OmegaConf makes the config nodes of a frozen dataclass read-only, and
Hydra's overrides (`model.params.routes.0.selection=...`) write to them.
"""
import math
from dataclasses import MISSING, FrozenInstanceError, dataclass, field, fields, replace
from typing import Any, Dict, Mapping, Optional, Sequence

from tread_utils.errors import UserError

SCHEDULE_KINDS = ("constant", "linear", "cosine")


class RouteError(UserError):
    """An invalid route configuration. `detail`: the message without the route's name and `where` its span, for a
    caller that names the route its own way (by its place in a list)."""

    def __init__(self, message: str, detail: Optional[str] = None, where: str = ""):
        super().__init__(message)
        self.detail, self.where = message if detail is None else detail, where


def is_number(value, integer: bool = False) -> bool:
    """An int or float (never a bool), integral when `integer`: a config value taken as it is, never converted
    (2.5 is not a block, false is not a ratio)."""
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    return number and (not integer or float(value).is_integer())


def ratio_problem(value, what: str, meaning: str = "") -> Optional[str]:
    """What is wrong with `value` as a routing ratio (a selection ratio, a schedule's ends, the path-drop
    probability, a forced ratio), or None: every one of them is a number in [0, 1)."""
    if is_number(value) and 0.0 <= value < 1.0:
        return None
    return f"{what} must be in [0, 1){meaning}, got {value!r}"


def doc(text: str, default=MISSING, factory=MISSING):
    """A field with its documentation (docs/configuration.md); neither default nor factory: a required key."""
    return field(default=default, default_factory=factory, metadata={"doc": text})


class Immutable:
    """No field changes once `__post_init__` has checked them (it sets them through `_set`)."""

    def __setattr__(self, name, value):
        if self.__dict__.get("_checked"):
            raise FrozenInstanceError(f"cannot assign to field {name!r}: build another with dataclasses.replace")
        object.__setattr__(self, name, value)

    def _set(self, **values):
        self.__dict__.update(values)


def from_mapping(cls, spec: Mapping, noun: str = ""):
    """`cls` built from a config mapping: a null value takes the field's default; an unknown key is refused (a
    misspelt option would otherwise fall back to its default unseen)."""
    accepted = [f.name for f in fields(cls)]
    unknown = sorted(set(spec) - set(accepted))
    if unknown:
        hint = getattr(cls, "UNKNOWN_KEY_HINT", "").format(parent="model.params.routes.N", key=unknown[0])
        raise RouteError(f"unknown {noun}key(s) {unknown}; accepted: {', '.join(accepted)}{hint}")
    return cls(**{k: v for k, v in spec.items() if v is not None})


@dataclass
class Schedule(Immutable):
    kind: str = doc("constant (selection_ratio throughout), linear or cosine", "constant")
    start_ratio: Optional[float] = doc("the ratio up to start_step, in [0, 1) (null: selection_ratio)", None)
    end_ratio: Optional[float] = doc("the ratio from end_step on, in [0, 1) (linear, cosine: required)", None)
    start_step: int = doc("the ratio starts moving after this training step, >= 0", 0)
    end_step: Optional[int] = doc("... and reaches end_ratio here, > start_step (linear, cosine: required)", None)
    levels: Optional[int] = doc("round the ratio to this many values from start to end, >= 2 (null: none)", None)

    def __post_init__(self):
        if self.kind not in SCHEDULE_KINDS:
            raise RouteError(f"schedule.kind must be one of {', '.join(SCHEDULE_KINDS)}, got {self.kind!r}")
        if self.kind != "constant":
            if not (is_number(self.end_ratio) and is_number(self.end_step, integer=True)
                    and is_number(self.start_step, integer=True)
                    and (self.start_ratio is None or is_number(self.start_ratio))
                    and (self.levels is None or is_number(self.levels, integer=True))):
                raise RouteError(f"a {self.kind} schedule needs a float end_ratio and an integer end_step (and "
                                 f"optionally start_ratio, start_step, levels), got {self.as_dict()}")
            for which in ("start_ratio", "end_ratio"):
                problem = getattr(self, which) is not None and ratio_problem(getattr(self, which), f"schedule.{which}")
                if problem:
                    raise RouteError(problem)
            if not 0 <= self.start_step < self.end_step:
                raise RouteError(f"the schedule needs 0 <= start_step < end_step, got {self.start_step} and "
                                 f"{self.end_step}")
            if self.levels is not None and self.levels < 2:
                raise RouteError(f"schedule.levels must be at least 2 (or null: no rounding), got {self.levels}")
            self._set(start_ratio=None if self.start_ratio is None else float(self.start_ratio),
                      end_ratio=float(self.end_ratio), start_step=int(self.start_step), end_step=int(self.end_step),
                      levels=None if self.levels is None else int(self.levels))
        self._set(_checked=True)

    def as_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def ratio_at(self, step: int, start_ratio: float) -> float:
        """The ratio at a training step (not for kind constant); `start_ratio` when the schedule names none."""
        start = start_ratio if self.start_ratio is None else self.start_ratio
        t = min(max((step - self.start_step) / (self.end_step - self.start_step), 0.0), 1.0)
        if self.kind == "cosine":
            t = 0.5 * (1.0 - math.cos(math.pi * t))
        if self.levels:
            t = round(t * (self.levels - 1)) / (self.levels - 1)
        return start + (self.end_ratio - start) * t


@dataclass
class Route(Immutable):
    start_layer_idx: int = doc("first routed block (negative: counted from the last block)")
    end_layer_idx: int = doc("last routed block, inclusive (negative: counted from the last block)")
    selection_ratio: float = doc("fraction of tokens that skip the route, in [0, 1)")
    selection: str = doc("the selection rule, a name in routing_module.SELECTIONS: random (the paper's), "
                         "importance (by L1 norm), ...", "random")
    options: Dict[str, Any] = doc("the selection rule's keyword options, e.g. importance_mix", factory=dict)
    importance_mix: Optional[float] = doc("importance: options.importance_mix, also accepted here", None)
    schedule: Schedule = doc("the ratio as a function of the training step", factory=Schedule)
    fusion: str = doc("how the route gives the sequence back: none (TREAD: the skipped tokens rejoin unchanged) "
                      "or a fusion of dit.FUSIONS: sprint (SPRINT's sparse deep path), ...", "none")
    fusion_options: Dict[str, Any] = doc("the fusion's options, its builder's keyword-only parameters", factory=dict)

    # where a key that is no route's goes (an unknown key's refusal says it: config_check and from_mapping)
    UNKNOWN_KEY_HINT = "; a fusion's own setting goes in its fusion_options: +{parent}.fusion_options.{key}=..."

    def __post_init__(self):
        for which, integer in (("start_layer_idx", True), ("end_layer_idx", True), ("selection_ratio", False)):
            value = getattr(self, which)
            if not is_number(value, integer):
                raise self.error(f"{which} must be {'an integer' if integer else 'a number'}, got {value!r}")
        self._set(start_layer_idx=int(self.start_layer_idx), end_layer_idx=int(self.end_layer_idx),
                  selection_ratio=float(self.selection_ratio))
        problem = ratio_problem(self.selection_ratio, "selection_ratio", " (the fraction of tokens that skip)")
        if problem:
            raise self.error(problem)
        if not isinstance(self.selection, str) or not isinstance(self.options, Mapping):
            raise self.error(f"selection must be a rule's name and options a mapping, got {self.selection!r} and "
                             f"{self.options!r}")
        if self.importance_mix is not None:  # the legacy spelling, folded into the rule's options
            self._set(options={**self.options, "importance_mix": self.importance_mix}, importance_mix=None)
        self._set(options=dict(self.options))
        try:
            if isinstance(self.schedule, Mapping):
                self._set(schedule=from_mapping(Schedule, self.schedule, "schedule "))
        except RouteError as e:
            raise self.error(str(e)) from None
        if not isinstance(self.schedule, Schedule):
            raise self.error(f"schedule must be a mapping, got {self.schedule!r}")
        if not isinstance(self.fusion, str) or not isinstance(self.fusion_options, Mapping):
            raise self.error(f"fusion must be a fusion's name and fusion_options a mapping, got "
                             f"{self.fusion!r} and {self.fusion_options!r}")
        self._set(fusion_options=dict(self.fusion_options), _checked=True)

    def error(self, message: str) -> RouteError:
        valid = is_number(self.start_layer_idx, True) and is_number(self.end_layer_idx, True) and \
            is_number(self.selection_ratio)
        where = f" ({self.start_layer_idx} -> {self.end_layer_idx}, ratio {self.selection_ratio})" if valid else ""
        return RouteError(f"route{where}: {message}", message, where)

    @staticmethod
    def placed(r, depth: int, index: int) -> "Route":
        """Route `index` of a list (a `Route` or a config mapping) in a model of `depth` blocks: negative indices as
        block numbers, inside the model, start <= end (routing_module.resolve_routes places the whole list). A
        refusal names the route by its place in the list."""
        missing = [k for k in ("start_layer_idx", "end_layer_idx", "selection_ratio")
                   if isinstance(r, Mapping) and r.get(k) is None]
        if missing or not isinstance(r, (Route, Mapping)):
            raise RouteError(f"route {index} needs integer start_layer_idx, end_layer_idx and a float selection_ratio"
                             + (f"; it has no {' or '.join(missing)}" if missing else f", got {r!r}"))
        try:
            route = from_mapping(Route, r) if isinstance(r, Mapping) else r
            for which in ("start_layer_idx", "end_layer_idx"):
                idx = getattr(route, which)
                if not -depth <= idx < depth:
                    raise route.error(f"{which}={idx} is outside a model of depth {depth} "
                                      f"(valid: 0..{depth - 1}, or -{depth}..-1 counting from the last block)")
            start, end = route.start_layer_idx % depth, route.end_layer_idx % depth
            if start > end:
                raise route.error(f"start block {start} comes after end block {end} (depth {depth}); a route runs "
                                  f"forward from start_layer_idx to end_layer_idx")
        except RouteError as e:
            raise RouteError(f"route {index}{e.where}: {e.detail}") from None
        return replace(route, start_layer_idx=start, end_layer_idx=end)

    def ratio_at(self, step: Optional[int]) -> float:
        """The ratio in training at `step` (None: not told, the schedule's start)."""
        if self.schedule.kind == "constant":
            return self.selection_ratio
        return self.schedule.ratio_at(self.schedule.start_step if step is None else step, self.selection_ratio)
