"""TREAD on diffusers transformers, attached by module hooks: `apply_tread(transformer, routes)`.

    handle = apply_tread(transformer, {"routes": [{"selection_ratio": 0.5, "start_layer_idx": 2,
                                                   "end_layer_idx": -2}]})
    ...train...
    handle.remove()   # the model is exactly as before: no hook, no attribute, same state dict

`routes` is SimpleTuner's `tread_config` as it is (a dict with `routes`, or the list itself). Each route
takes a subset of the image tokens out before block `start_layer_idx` and puts them back, unchanged, after
block `end_layer_idx` (inclusive); negative indices count from the last block (-1 = the last). The routes are
checked by `routing_module.resolve_routes`, the validation of `model.params.routes`, against the number of
blocks (for two-list families, both lists: tread_diffusers/families.py says how they are numbered).

The kept tokens are chosen by `routing_module.select_kept_tokens` (a rule of `routing_module.SELECTIONS`),
with the mask (below) as its `force_keep`; routing runs only while the transformer is in training mode and
gradients are enabled, so evaluation, sampling and `torch.no_grad()` see the unchanged model.

Mask: `handle.set_mask(mask)`, or `tread_mask=mask` as a keyword of the transformer's forward, marks image
tokens that are never routed (SimpleTuner's force-keep for masked-loss training): a [B, N] token mask, or a
mask image ([B, H, W]; [B, F, H, W] for video) in [0, 1] or SimpleTuner's [-1, 1] made into tokens by the
handle's `mask_rule` (tread_diffusers/masks.py has the forms and rules). `masked_loss` weights a loss by the same mask.

Gradient checkpointing (`transformer.enable_gradient_checkpointing()`): diffusers runs each block through
`transformer._gradient_checkpointing_func`, and the hooks run inside it, again when backward recomputes
the block. The handle wraps that function so each checkpointed call records the kept indices its first run
used and its recomputation replays them: the recomputed forward routes the same tokens. (It needs a
non-reentrant checkpoint, diffusers' default: the skipped tokens rejoin from outside the block.)
"""
import ast
import contextvars
import inspect
import warnings
from typing import Optional

import torch

from routing_module import RouteError, end_route, resolve_routes, select_kept_tokens, start_route
from tread_diffusers.families import FAMILIES, Family, SampleLead, family_of, no_tail, splice
from tread_diffusers.flux_families import check_reference_ids
from tread_diffusers.image_families import IMAGE_FAMILIES  # noqa: F401  (importing registers them)
from tread_diffusers.masks import MASK_RULES, mask_to_tokens, masked_loss, read_mask  # noqa: F401
from tread_diffusers.sequence_families import SEQUENCE_FAMILIES  # noqa: F401  (importing registers them)
from tread_diffusers.video_families import VIDEO_FAMILIES  # noqa: F401  (importing registers them)
from tread_utils.errors import UserError

TESTED_DIFFUSERS = ("0.42",)  # major.minor versions whose forward loops were run in the tests
KEPT_COUNTS = ("authors", "simpletuner")
MISSING_ROUTES = "TREAD training requires you to configure the routes"
_RECORD = contextvars.ContextVar("tread_checkpoint_record", default=None)


def check_diffusers(transformer, family: Family, version: Optional[str] = None) -> None:
    """Refuse a diffusers version whose code differs in what routing reads (`family.relies_on`: the block lists and
    the forward parameters), naming the difference; warn in one line on an untested version that passes."""
    import diffusers

    version = version or diffusers.__version__
    model = next(cls.__name__ for cls in type(transformer).__mro__ if cls.__name__ in FAMILIES)
    for part in ("forward", *family.block_lists):
        needed = family.relies_on.get(part, ())
        if part == "forward":
            modules, where = [transformer], f"{model}.forward"
        else:
            modules, where = getattr(transformer, part, None), f"{model}.{part}"
            if not isinstance(modules, torch.nn.ModuleList) or len(modules) == 0:
                raise UserError(f"diffusers {version}: {where} is not a list of blocks; apply_tread routes through "
                                f"it (tested on diffusers {', '.join(TESTED_DIFFUSERS)})")
            where += "[i].forward"
        for module in modules:
            missing = [name for name in needed if name not in inspect.signature(module.forward).parameters]
            if missing:
                raise UserError(f"diffusers {version}: {where} has no parameter {', '.join(missing)}, which "
                                f"apply_tread relies on (tested on diffusers {', '.join(TESTED_DIFFUSERS)})")
    if ".".join(version.split(".")[:2]) not in TESTED_DIFFUSERS:
        warnings.warn(f"apply_tread: diffusers {version} passes the structural check of {model} but is untested "
                      f"(tested: {', '.join(TESTED_DIFFUSERS)}); compare a routed step with tests/"
                      f"test_diffusers_tread.py", stacklevel=3)


def routes_from_config(tread_config, depth: int, selection: str = "random", **options) -> list:
    """SimpleTuner's tread_config (a dict with `routes`, the list, or its command line's string: one that starts
    with `{` is read as a Python literal, as SimpleTuner reads `--tread_config`) as checked `Route`s over `depth`
    blocks. A route that names no `selection` takes the call's, with its options."""
    if isinstance(tread_config, str) and tread_config.lstrip().startswith("{"):
        try:
            tread_config = ast.literal_eval(tread_config.strip())
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError) as err:
            why = str(err).splitlines()[0] if isinstance(err, SyntaxError) else "a name or call in it"
            raise RouteError(f"the tread_config string is not a Python literal ({why}); write it as SimpleTuner's "
                             f"--tread_config takes it, e.g. '{{\"routes\": [{{\"selection_ratio\": 0.5, "
                             f"\"start_layer_idx\": 2, \"end_layer_idx\": -2}}]}}' (True/False/None, not JSON's "
                             f"true/false/null)") from None
    routes = tread_config.get("routes") if hasattr(tread_config, "keys") else tread_config
    if not routes:
        raise RouteError(MISSING_ROUTES)
    if isinstance(routes, (str, bytes)) or not all(hasattr(r, "keys") for r in routes):
        raise RouteError(f"{MISSING_ROUTES} as a list of mappings with selection_ratio, start_layer_idx and "
                         f"end_layer_idx; got {routes!r}")
    routes = [r if "selection" in r else {"selection": selection, "options": options, **r} for r in routes]
    resolved = resolve_routes(routes, depth)
    for i, r in enumerate(resolved):
        if r.schedule.kind != "constant" or r.fusion != "none":
            raise RouteError(f"route {i}: apply_tread supports constant ratios without fusion; remove the "
                             f"route's schedule / fusion options")
    return resolved


def positional_names(module) -> tuple:
    """The names of `module.forward`'s positional parameters, read once at attach time (the hooks map a call's
    positional arguments onto them without `inspect`, which torch.compile cannot trace)."""
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return tuple(p.name for p in inspect.signature(module.forward).parameters.values() if p.kind in kinds)


def bound_kwargs(names: tuple, args, kwargs) -> dict:
    """A call's arguments by name: its positional ones mapped onto `names` (`positional_names`)."""
    return {**dict(zip(names, args)), **kwargs}


class TreadHandle:
    """Routes a diffusers transformer's image tokens through its blocks; `.remove()` detaches it.

    `last_keep[k]`: the kept token indices [B, K] of route k in the latest routed forward (for REPA-style
    losses on the kept tokens, and for checks)."""

    def __init__(self, transformer, family: Family, routes: list, mask_rule: str = "half",
                 kept_count: str = "authors"):
        self.transformer, self.family, self.routes = transformer, family, routes
        self.mask_rule, self.kept_count = mask_rule, kept_count
        self.mask: Optional[torch.Tensor] = None
        self.last_keep: dict = {}
        self._on, self._force_keep, self._pending_mask, self._grid, self._live = False, None, None, None, {}
        self._lead: dict = {}  # block list -> text tokens before the image (a SampleLead: per sample), this forward
        self._tail = 0  # conditioning tokens after the image in every block's hidden_states (this forward)
        self._tail_ids, self._tail_given = None, False  # where the tail is read from, whether it was given
        self._narrowed: dict = {}  # (route, block kind) -> the per-token inputs cut for it, this forward (eager)
        self._names = positional_names(transformer)
        blocks = [(name, block) for name in family.block_lists for block in getattr(transformer, name)]
        self.depth = len(blocks)
        self._hooks = [transformer.register_forward_pre_hook(self._before_model, with_kwargs=True),
                       transformer.register_forward_hook(self._after_model)]
        for k, route in enumerate(routes):
            if route.selection_ratio == 0:
                continue
            for i in range(route.start_layer_idx, route.end_layer_idx + 1):
                kind, block = blocks[i]
                self._hooks.append(block.register_forward_pre_hook(
                    self._pre_hook(k, kind, i == route.start_layer_idx, positional_names(block)), with_kwargs=True))
            kind, block = blocks[route.end_layer_idx]
            self._hooks.append(block.register_forward_hook(self._post_hook(k, kind)))
        transformer._tread_handle = self

    # -- the model-level hooks -------------------------------------------------------------------------
    def set_mask(self, mask: Optional[torch.Tensor]) -> None:
        """A per-sample mask (see the module doc) used by every following forward; None clears it."""
        self.mask = None if mask is None else read_mask(mask)

    def _before_model(self, module, args, kwargs):
        mask = kwargs.pop("tread_mask", None)
        references = kwargs.pop("tread_reference_tokens", None)
        mask = self.mask if mask is None else read_mask(mask)
        self._live, self._force_keep, self._narrowed = {}, None, {}
        self._on = module.training and torch.is_grad_enabled() and any(r.selection_ratio > 0 for r in self.routes)
        if getattr(module, "gradient_checkpointing", False):
            func = getattr(module, "_gradient_checkpointing_func", None)
            if func is not None and not hasattr(func, "_tread_original"):
                module._gradient_checkpointing_func = _replaying(func)
        if not self._on:
            return args, kwargs
        self.last_keep = {}  # a new dict per routed forward: torch.compile guards on the contents of a kept one
        kw = bound_kwargs(self._names, args, kwargs)
        for name in self.family.refused:
            if kw.get(name) is not None:
                raise UserError(f"TREAD cannot route a {type(module).__name__} forward given {name}; train "
                                f"without it, or call handle.remove() first")
        self._lead, self._tail = self.family.lead(module, kw), self._references(module, kw, references)
        self._tail_ids = kw.get(self.family.tail_ids) if self.family.tail_ids else None
        self._tail_given = references is not None
        self._grid = None if mask is None else self.family.grid(module, kw)  # FLUX reads it from data: no trace
        self._pending_mask = mask
        return args, kwargs

    def _after_model(self, module, args, output):
        self._live, self._pending_mask = {}, None

    def _references(self, module, kw: dict, given) -> int:
        """Reference-image tokens after the target's: `tread_reference_tokens` where given, else the family's."""
        if given is None:
            return self.family.tail(module, kw)
        total = kw["hidden_states"].shape[1]
        counts = isinstance(given, int) and not isinstance(given, bool) and 0 <= given < total
        if self.family.tail is no_tail or not counts:
            raise UserError(f"tread_reference_tokens={given!r}: give the number of reference-image tokens after the "
                            f"target's (an int from 0 to {total - 1}), to a FLUX (Kontext) or Qwen-Image forward")
        return given

    # -- the block-level hooks -------------------------------------------------------------------------
    def _select(self, route, x: torch.Tensor) -> torch.Tensor:
        if self._pending_mask is not None:
            self._force_keep = mask_to_tokens(self._pending_mask.to(x.device), self._grid, x.shape[1],
                                              self.mask_rule)
            self._pending_mask = None
        force_keep = self._force_keep
        if force_keep is not None and force_keep.shape != x.shape[:2]:
            raise UserError(f"the TREAD mask gives {tuple(force_keep.shape)} token flags for image tokens of shape "
                            f"{tuple(x.shape[:2])}; give one mask per sample over this image")
        ratio = self._ratio(route.selection_ratio, x.shape[1])
        return select_kept_tokens(x, ratio, None, route.selection, force_keep, **dict(route.options))

    def _checked(self, keep: torch.Tensor) -> torch.Tensor:
        """The kept tokens, passed through a check of a given or compiled tail count against the ids it is read
        from when the forward runs: in the data path, so a compiled forward runs it in its graph. An eager forward
        that read the count from the ids (and checked them there) skips it: each check waits for the GPU."""
        if self._tail_ids is None or not (self._tail_given or torch.compiler.is_compiling()):
            return keep
        return check_reference_ids(self._tail_ids, keep, self._tail, self._tail_given)

    def _ratio(self, ratio: float, num_tokens: int) -> float:
        """The ratio whose authors' count N - int(N * r) keeps what `kept_count` asks for: SimpleTuner's
        N - round(N * ratio), at least one token (its round can skip all)."""
        if self.kept_count == "authors" or ratio == 0:
            return ratio
        return (min(round(num_tokens * ratio), num_tokens - 1) + 0.5) / num_tokens

    def _span_of(self, kind: str, record: Optional[dict]) -> tuple:
        """Tokens before and after the image in this block's hidden_states; a recomputation reads its forward's."""
        span = (self._lead.get(kind, 0), self._tail)
        return span if record is None else record.setdefault("span", span)

    def _pre_hook(self, k: int, kind: str, is_start: bool, names: tuple):
        route = self.routes[k]

        def hook(module, args, kwargs):
            record = _RECORD.get()
            lead, tail = self._span_of(kind, record)
            image = kw = None  # the image tokens, cut once: a recomputation must save what its forward saved
            if record is not None and "ctx" in record:  # backward recomputes a checkpointed block
                ctx = record["ctx"]
            elif not self._on:
                ctx = None
            elif is_start:
                kw = bound_kwargs(names, args, kwargs)
                image = _image_of(self._batch_first(kw[self.family.tokens]), lead, tail)
                ctx = (self._checked(self._select(route, image)), image)
                self._live[k], self.last_keep[k] = ctx, ctx[0]
            else:
                ctx = self._live[k]
            if record is not None:
                record["ctx"] = ctx
            if ctx is None:
                return None
            keep = ctx[0]
            kw = bound_kwargs(names, args, kwargs) if kw is None else kw
            if is_start:
                x = self._batch_first(kw[self.family.tokens])
                image = _image_of(x, lead, tail) if image is None else image
                kw[self.family.tokens] = self._batch_first(_with_image(x, lead, tail, start_route(image, keep)))
            self._narrow(k, kind, kw, keep)
            return (), kw
        return hook

    def _narrow(self, k: int, kind: str, kw: dict, keep: torch.Tensor) -> None:
        """The family's `narrow` of a block's keywords: its per-token inputs (RoPE tables, masks, per-token
        embeddings) cut to the kept tokens. The transformer passes the same inputs to every block, so an eager
        forward cuts them once per route and block kind and hands the cut ones to the other blocks and to the
        recomputations in backward: per block, a routed step then costs a few dict lookups instead of gathers.
        A compiled forward traces each cut (the graph computes it once). What the cut saves for backward is saved
        as plainly (not left to a checkpoint to recompute): the recomputation, which finds the cut cached, must
        save the same tensors as its forward."""
        if torch.compiler.is_compiling():
            self.family.narrow(kw, keep)
            return
        sizes = tuple(value.shape if isinstance(value, torch.Tensor) else None for value in kw.values())
        cached = self._narrowed.get((k, kind))
        if (cached is not None and cached[0] is keep and cached[1] == sizes
                and all(kw.get(name) is original for name, original, _ in cached[2])):
            kw.update((name, cut) for name, _, cut in cached[2])
            return
        originals = dict(kw)
        with torch.autograd.graph.saved_tensors_hooks(_as_is, _as_is):
            self.family.narrow(kw, keep)
        changed = tuple((name, originals.get(name), kw[name]) for name in kw if kw[name] is not originals.get(name))
        self._narrowed[(k, kind)] = (keep, sizes, changed)

    def _post_hook(self, k: int, kind: str):
        def hook(module, args, output):
            record = _RECORD.get()
            lead, tail = self._span_of(kind, record)
            ctx = record.get("ctx") if record is not None else (self._live.get(k) if self._on else None)
            self._live.pop(k, None)
            if ctx is None:
                return None
            keep, x_shallow = ctx
            out = self._batch_first(self.family.image(output, kind))
            image = end_route(_image_of(out, lead, tail, keep.shape[1]), x_shallow, keep)
            joined = _with_image(out, lead, tail, image, keep.shape[1])
            return self.family.with_image(output, kind, self._batch_first(joined))
        return hook

    def _batch_first(self, x: torch.Tensor) -> torch.Tensor:
        """A sequence-first family's [S, B, D] tokens as [B, S, D] (a view), and back: the cut is on axis 1."""
        return x.transpose(0, 1) if self.family.sequence_first else x

    def remove(self) -> None:
        """Detach every hook and restore the checkpointing function: the model is as it was before."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        func = getattr(self.transformer, "_gradient_checkpointing_func", None)
        if hasattr(func, "_tread_original"):
            self.transformer._gradient_checkpointing_func = func._tread_original
        if getattr(self.transformer, "_tread_handle", None) is self:
            del self.transformer._tread_handle
        self._live, self.last_keep, self.mask, self._narrowed = {}, {}, None, {}


def _as_is(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def _image_of(x: torch.Tensor, lead, tail: int, count: Optional[int] = None) -> torch.Tensor:
    """The image tokens of a block's sequence x: after `lead` text tokens and before `tail` conditioning tokens;
    with a per-sample lead (SampleLead), its tokens, or `count` of them in a routed block, from each sample's offset."""
    if isinstance(lead, SampleLead):
        count = lead.tokens if count is None else count
        index = lead.offsets(x.device)[:, None] + torch.arange(count, device=x.device)
        return x.gather(1, index[..., None].expand(-1, -1, x.shape[-1]))
    return x[:, lead:x.shape[1] - tail]


def _with_image(x: torch.Tensor, lead, tail: int, image: torch.Tensor, count: Optional[int] = None) -> torch.Tensor:
    """x with its image tokens (`_image_of`) replaced by `image`, of any length; the tokens around them unchanged."""
    if isinstance(lead, SampleLead):
        return splice(x, lead.offsets(x.device), lead.tokens if count is None else count, image)
    return _join(x[:, :lead], image, x[:, x.shape[1] - tail:])


def _join(lead: torch.Tensor, image: torch.Tensor, tail: torch.Tensor) -> torch.Tensor:
    """The image tokens between the leading text tokens (single-stream blocks) and the trailing conditioning
    tokens (reference images), where a family has them."""
    parts = [part for part in (lead, image, tail) if part.shape[1]]
    return parts[0] if len(parts) == 1 else torch.cat(parts, 1)


def _replaying(checkpoint_func):
    """Wraps diffusers' `_gradient_checkpointing_func(block, *args)`: each call gets a record that its first
    run fills with the routing it used and its recomputation in backward reads back."""
    def run(block, *args, **kwargs):
        record = {}

        def call(*a, **kw):
            token = _RECORD.set(record)
            try:
                return block(*a, **kw)
            finally:
                _RECORD.reset(token)
        call.__wrapped__ = block  # for a checkpointing function that treats blocks apart (compile.py)
        return checkpoint_func(call, *args, **kwargs)
    run._tread_original = checkpoint_func
    return run


def apply_tread(transformer, routes, *, selection: str = "random", mask_rule: str = "half",
                kept_count: str = "authors", **options) -> TreadHandle:
    """Attach TREAD routes to a diffusers transformer of a class in tread_diffusers.families.FAMILIES (its subclasses
    too); returns the handle.
    `selection` (a rule of routing_module.SELECTIONS) and its options apply to each route that names none.
    `mask_rule` makes a mask image into tokens ("half" or "any", tread_diffusers/masks.py); `kept_count`
    is "authors" (N - int(N * ratio) tokens kept) or "simpletuner" (N - round(N * ratio))."""
    for name, value, choices in (("mask_rule", mask_rule, MASK_RULES), ("kept_count", kept_count, KEPT_COUNTS)):
        if value not in choices:
            raise UserError(f"apply_tread {name}={value!r}; choose one of {', '.join(choices)}")
    if hasattr(transformer, "_orig_mod") or getattr(transformer, "_compiled_call_impl", None) is not None:
        raise UserError("this transformer is already compiled, and its compiled graphs would not see the routes; "
                        "call apply_tread on the model first, then torch.compile it")
    family = family_of(transformer)
    check_diffusers(transformer, family)
    if getattr(transformer, "_tread_handle", None) is not None:
        raise UserError("this transformer already has TREAD routes; call .remove() on the first handle first")
    depth = sum(len(getattr(transformer, name)) for name in family.block_lists)
    return TreadHandle(transformer, family, routes_from_config(routes, depth, selection, **options), mask_rule,
                       kept_count)
