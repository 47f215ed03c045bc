"""TREAD on diffusers transformers, attached by module hooks: `apply_tread(transformer, routes)`.

    handle = apply_tread(transformer, {"routes": [{"selection_ratio": 0.5, "start_layer_idx": 2,
                                                   "end_layer_idx": -2}]})
    ...train...
    handle.remove()   # the model is exactly as before: no hook, no attribute, same state dict

`routes` is SimpleTuner's `tread_config` as it is (a dict with `routes`, or the list itself). Each route
takes a subset of the image tokens out before block `start_layer_idx` and puts them back, unchanged, after
block `end_layer_idx` (inclusive); negative indices count from the last block (-1 = the last). The routes are
checked by `routing_module.resolve_routes`, the validation of `model.params.routes`, against the number of
blocks (for two-list families, both lists: backbones/diffusers_families.py says how they are numbered).

The kept tokens are chosen by `routing_module.select_kept_tokens` (a rule of `routing_module.SELECTIONS`),
with the mask (below) as its `force_keep`; routing runs only while the transformer is in training mode and
gradients are enabled, so evaluation, sampling and `torch.no_grad()` see the unchanged model.

Mask: `handle.set_mask(mask)`, or `tread_mask=mask` as a keyword of the transformer's forward, marks image
tokens that are never routed (SimpleTuner's force-keep for masked-loss training). `mask` is [B, N] over the
tokens, or [B, H, W] ([B, F, H, W] for video) over the image at any resolution, max-pooled to the token grid:
a token is kept if any of its pixels is in the mask. `masked_loss` weights a loss by the same mask.

Gradient checkpointing (`transformer.enable_gradient_checkpointing()`): diffusers runs each block through
`transformer._gradient_checkpointing_func`, and the hooks run inside it, again when backward recomputes
the block. The handle wraps that function so each checkpointed call records the kept indices its first run
used and its recomputation replays them: the recomputed forward routes the same tokens. (It needs a
non-reentrant checkpoint, diffusers' default: the skipped tokens rejoin from outside the block.)
"""
import contextvars
import inspect
from typing import Optional

import torch
import torch.nn.functional as F

from backbones.diffusers_families import Family, family_of
from routing_module import RouteError, end_route, resolve_routes, select_kept_tokens, start_route
from tread_utils.errors import UserError

TESTED_DIFFUSERS = ("0.42",)  # major.minor versions whose block signatures and forward loops were checked
MISSING_ROUTES = "TREAD training requires you to configure the routes"
_RECORD = contextvars.ContextVar("tread_checkpoint_record", default=None)


def check_diffusers_version(version: Optional[str] = None) -> None:
    import diffusers

    version = version or diffusers.__version__
    if ".".join(version.split(".")[:2]) not in TESTED_DIFFUSERS:
        raise UserError(f"apply_tread is tested on diffusers {', '.join(v + '.*' for v in TESTED_DIFFUSERS)}, "
                        f"found {version}; install one of those (pip install 'diffusers~=0.42.0')")


def routes_from_config(tread_config, depth: int, selection: str = "random", **options) -> list:
    """SimpleTuner's tread_config (a dict with `routes`, or the list) as checked `Route`s over `depth` blocks.
    A route that names no `selection` takes the call's, with its options."""
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


def mask_to_tokens(mask: torch.Tensor, grid: tuple, num_tokens: int) -> torch.Tensor:
    """A per-sample mask [B, N] or [B, *image] as a [B, N] bool token mask over `grid` (max-pooled)."""
    if mask.ndim == 2 and mask.shape[1] == num_tokens:
        return mask.bool()
    if mask.ndim != len(grid) + 1 or len(grid) not in (2, 3):
        raise UserError(f"the TREAD mask must be [B, {num_tokens}] over the tokens or [B, "
                        f"{', '.join('*' * len(grid))}] over the image (token grid {grid}); got {tuple(mask.shape)}")
    pool = F.adaptive_max_pool2d if len(grid) == 2 else F.adaptive_max_pool3d
    return pool(mask[:, None].float(), grid).flatten(1).bool()


def masked_loss(loss: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The mean of an unreduced loss over the masked region: `loss` [B, C, *image] with `mask` [B, *image'] at
    any resolution (nearest-resized), or token layout `loss` [B, N, C] with `mask` [B, N]."""
    weight = mask.to(loss.dtype)
    if loss.ndim == 3 and weight.shape == loss.shape[:2]:
        weight = weight[..., None]
    else:
        if weight.shape[1:] != loss.shape[2:]:
            weight = F.interpolate(weight[:, None], size=loss.shape[2:], mode="nearest")[:, 0]
        weight = weight[:, None]
    weight = weight.expand_as(loss)
    return (loss * weight).sum() / weight.sum().clamp_min(1.0)


def _as_kwargs(signature: inspect.Signature, args, kwargs) -> dict:
    bound = signature.bind(*args, **kwargs)
    out = {}
    for name, value in bound.arguments.items():
        if signature.parameters[name].kind is inspect.Parameter.VAR_KEYWORD:
            out.update(value)
        else:
            out[name] = value
    return out


class TreadHandle:
    """Routes a diffusers transformer's image tokens through its blocks; `.remove()` detaches it.

    `last_keep[k]`: the kept token indices [B, K] of route k in the latest routed forward (for REPA-style
    losses on the kept tokens, and for checks)."""

    def __init__(self, transformer, family: Family, routes: list):
        self.transformer, self.family, self.routes = transformer, family, routes
        self.mask: Optional[torch.Tensor] = None
        self.last_keep: dict = {}
        self._on, self._force_keep, self._pending_mask, self._grid, self._live = False, None, None, None, {}
        self._lead: dict = {}  # block list -> leading text tokens in its hidden_states (this forward)
        self._tail = 0  # conditioning tokens after the image in every block's hidden_states (this forward)
        self._signatures: dict = {}
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
                    self._pre_hook(k, kind, i == route.start_layer_idx), with_kwargs=True))
            kind, block = blocks[route.end_layer_idx]
            self._hooks.append(block.register_forward_hook(self._post_hook(k, kind)))
        transformer._tread_handle = self

    # -- the model-level hooks -------------------------------------------------------------------------
    def set_mask(self, mask: Optional[torch.Tensor]) -> None:
        """A per-sample mask (see the module doc) used by every following forward; None clears it."""
        self.mask = mask

    def _before_model(self, module, args, kwargs):
        mask = kwargs.pop("tread_mask", None)
        mask = self.mask if mask is None else mask
        self._live, self._force_keep = {}, None
        self._on = module.training and torch.is_grad_enabled() and any(r.selection_ratio > 0 for r in self.routes)
        if getattr(module, "gradient_checkpointing", False):
            func = getattr(module, "_gradient_checkpointing_func", None)
            if func is not None and not hasattr(func, "_tread_original"):
                module._gradient_checkpointing_func = _replaying(func)
        if not self._on:
            return args, kwargs
        kw = _as_kwargs(self._signature(module), args, kwargs)
        for name in self.family.refused:
            if kw.get(name) is not None:
                raise UserError(f"TREAD cannot route a {type(module).__name__} forward given {name}; train "
                                f"without it, or call handle.remove() first")
        self._grid, self._lead = self.family.grid(module, kw), self.family.lead(module, kw)
        self._tail = self.family.tail(module, kw)
        self._pending_mask = mask
        return args, kwargs

    def _after_model(self, module, args, output):
        self._live, self._pending_mask = {}, None

    def _signature(self, module) -> inspect.Signature:
        key = type(module)
        if key not in self._signatures:
            self._signatures[key] = inspect.signature(module.forward)
        return self._signatures[key]

    # -- the block-level hooks -------------------------------------------------------------------------
    def _select(self, route, x: torch.Tensor) -> torch.Tensor:
        if self._pending_mask is not None:
            self._force_keep = mask_to_tokens(self._pending_mask.to(x.device), self._grid, x.shape[1])
            self._pending_mask = None
        force_keep = self._force_keep
        if force_keep is not None and force_keep.shape != x.shape[:2]:
            raise UserError(f"the TREAD mask gives {tuple(force_keep.shape)} token flags for image tokens of shape "
                            f"{tuple(x.shape[:2])}; give one mask per sample over this image")
        return select_kept_tokens(x, route.selection_ratio, None, route.selection, force_keep, **dict(route.options))

    def _span_of(self, kind: str, record: Optional[dict]) -> tuple:
        """Tokens before and after the image in this block's hidden_states; a recomputation reads its forward's."""
        span = (self._lead.get(kind, 0), self._tail)
        return span if record is None else record.setdefault("span", span)

    def _pre_hook(self, k: int, kind: str, is_start: bool):
        route = self.routes[k]

        def hook(module, args, kwargs):
            record = _RECORD.get()
            lead, tail = self._span_of(kind, record)
            if record is not None and "ctx" in record:  # backward recomputes a checkpointed block
                ctx = record["ctx"]
            elif not self._on:
                ctx = None
            elif is_start:
                x = _as_kwargs(self._signature(module), args, kwargs)["hidden_states"]
                x = x[:, lead:x.shape[1] - tail]
                ctx = (self._select(route, x), x)
                self._live[k], self.last_keep[k] = ctx, ctx[0]
            else:
                ctx = self._live[k]
            if record is not None:
                record["ctx"] = ctx
            if ctx is None:
                return None
            keep = ctx[0]
            kw = _as_kwargs(self._signature(module), args, kwargs)
            if is_start:
                x = kw["hidden_states"]
                image = start_route(x[:, lead:x.shape[1] - tail], keep)
                kw["hidden_states"] = _join(x[:, :lead], image, x[:, x.shape[1] - tail:])
            self.family.narrow(kw, keep)
            return (), kw
        return hook

    def _post_hook(self, k: int, kind: str):
        def hook(module, args, output):
            record = _RECORD.get()
            lead, tail = self._span_of(kind, record)
            ctx = record.get("ctx") if record is not None else (self._live.get(k) if self._on else None)
            self._live.pop(k, None)
            if ctx is None:
                return None
            keep, x_full = ctx
            out = self.family.image(output, kind)
            image = end_route(out[:, lead:out.shape[1] - tail], x_full, keep)
            return self.family.with_image(output, kind, _join(out[:, :lead], image, out[:, out.shape[1] - tail:]))
        return hook

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
        self._live, self.last_keep, self.mask = {}, {}, None


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
        return checkpoint_func(call, *args, **kwargs)
    run._tread_original = checkpoint_func
    return run


def apply_tread(transformer, routes, *, selection: str = "random", **options) -> TreadHandle:
    """Attach TREAD routes to a diffusers PixArt, SD3, FLUX, FLUX.2, Chroma, Qwen-Image, Wan, LTX-Video,
    HunyuanVideo or AuraFlow transformer; returns the handle.
    `selection` (a rule of routing_module.SELECTIONS) and its options apply to each route that names none."""
    check_diffusers_version()
    family = family_of(transformer)
    if getattr(transformer, "_tread_handle", None) is not None:
        raise UserError("this transformer already has TREAD routes; call .remove() on the first handle first")
    depth = sum(len(getattr(transformer, name)) for name in family.block_lists)
    return TreadHandle(transformer, family, routes_from_config(routes, depth, selection, **options))
