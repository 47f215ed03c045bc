"""The words a config schema is written in: `key` (a field with its documentation, value rule and example),
the `Rule`s a value follows, and the types a field may have with the words that name them (`TYPE_WORDS`).

Torch-free and omegaconf-free (dit.py imports it), below every layer that declares keys: training/config_schema.py
(the configs) and tread_utils/model_spec.py (`model.params`, which the model reads to check a Python caller's
arguments).
"""
import importlib
import typing
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Union

from tread_utils.route_spec import is_number

# OmegaConf's MISSING by its value: `import dit` reads the model's fields from here and must not load omegaconf
MISSING = "???"


@dataclass(frozen=True)
class Rule:
    """What a key's value may be: `ok(value)` and the words that say it (`allowed`: a string, or a function
    that reads a registry when a config is checked or documented, so the names have one home)."""
    ok: Callable[[Any], bool]
    words: Union[str, Callable[[], str]]
    reads_registry: bool = False

    @property
    def allowed(self) -> str:
        return self.words() if callable(self.words) else self.words


def at_least(n) -> Rule:
    return Rule(lambda v: v >= n, f">= {n}")


def above(n) -> Rule:
    return Rule(lambda v: v > n, f"> {n}")


UNIT = Rule(lambda v: 0 <= v < 1, "in [0, 1)")


def one_of(*names) -> Rule:
    return Rule(lambda v: v in names, f"one of {', '.join(names)}")


def _wrapped(rule: Rule, ok: Callable[[Any], bool], words: Callable[[str], str]) -> Rule:
    """A rule built on `rule`: a registry it reads is read when the new rule runs, never when it is built."""
    if rule.reads_registry:
        return Rule(ok, lambda: words(rule.allowed), reads_registry=True)
    return Rule(ok, words(rule.allowed))


def or_null(rule: Rule, meaning: str) -> Rule:
    return _wrapped(rule, lambda v: v is None or rule.ok(v), lambda allowed: f"null ({meaning}) or {allowed}")


def each(rule: Rule, empty: str = "") -> Rule:
    """A list whose every value follows `rule`; `empty`: what an empty list means (absent: refused)."""
    return _wrapped(rule, lambda v: (bool(empty) or len(v) > 0) and all(x is not None and rule.ok(x) for x in v),
                    lambda allowed: f"a list of values {allowed}" + (f" ({empty}: [])" if empty else ", at least one"))


def registry(path: str) -> Rule:
    """A name in a registry, `module:attribute`; read when the rule runs (the registries import torch)."""
    def names():
        module, _, attr = path.partition(":")
        return tuple(getattr(importlib.import_module(module), attr))
    return Rule(lambda v: v in names(), lambda: f"one of {', '.join(names())}", reads_registry=True)


def key(doc: str, default=MISSING, factory=None, *, rule: Optional[Rule] = None, eg=None):
    """A schema field with its documentation, the rule its value follows (checked by training.config_check, shown
    by the reference) and an example value for a refusal's fix; `factory` builds a mutable default (a list)."""
    metadata = {"doc": doc, "rule": rule, "eg": eg}
    if factory is not None:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


TYPE_WORDS = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}


def plain_type(tp):
    """X for a field typed X or Optional[X]."""
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    return args[0] if typing.get_origin(tp) is typing.Union and len(args) == 1 else tp


def scalar_type(tp):
    """bool, int or float for such a field (Optional or not), else None."""
    tp = plain_type(tp)
    return tp if tp in (bool, int, float) else None


def takes(tp, value) -> bool:
    """A Python value as it is, never converted, in a field of type `tp` named in TYPE_WORDS: an integer is never a
    bool or a string of digits (an integral float is one), a number never a bool; other types: not checked here."""
    kind = plain_type(tp)
    if kind in (int, float):
        return is_number(value, integer=kind is int)
    return kind not in TYPE_WORDS or isinstance(value, kind)
