"""DiT backbones (Peebles & Xie, 2023) with TREAD routing.

One file: embedders, the adaLN-Zero block, the final layer, the model, the `DiT_models` registry and
`get_model(backbone_type, params)`. The backbone predicts F in EDM's D = c_skip x + c_out F, so its
output has the input's channels (no learned sigma). The backbone's initialisation is in `initialize_weights` (a
route's fusion module initialises itself, in its builder):

* `init="official"` (the default) is what the authors' code (CompVis/tread) trains: their blocks zero the
  adaLN modulation when built, but their `initialize_weights` then applies xavier to every Linear and never
  zeroes again, so the modulation, the final adaLN and the final linear start with xavier weights (a fresh
  DiT-S/2 outputs std ~1.1);
* `init="adaln_zero"` is DiT's adaLN-Zero (Peebles & Xie): those layers start at zero (output exactly 0).
"""
import dataclasses
import inspect
import math
import typing

import numpy as np
import torch
import torch.nn as nn
from huggingface_hub import PyTorchModelHubMixin
from torch.utils.checkpoint import checkpoint

from backbones import Mlp, modulate
from backbones.lightningdit import LightningDiTBlock
from backbones.sprint import SPRINT
from backbones.ssm import SSMBlock
import routing_module
from routing_module import TokenRouter, autocast_on, resolve_routes
from tread_utils.errors import UserError
from tread_utils.hub import (CONFIG_NAME, WEIGHTS_NAME, hub_errors_as_user_errors, load_exact, model_file, read_config,
                             read_weights, refuse_missing_folder)
from tread_utils import model_spec
from tread_utils.attention import attention
from tread_utils.schema_fields import TYPE_WORDS, plain_type, takes


class PatchEmbed(nn.Module):
    """Latent image [B, C, H, W] -> patch tokens [B, (H/p)(W/p), D] by a strided convolution (timm's
    `PatchEmbed` as DiT uses it: the same `proj` parameter, so checkpoints match the authors')."""

    def __init__(self, img_size, patch_size, in_channels, hidden_size):
        super().__init__()
        self.img_size = (img_size, img_size)
        self.grid_size = (img_size // patch_size, img_size // patch_size)
        self.num_patches = self.grid_size[0] * self.grid_size[1]
        self.proj = nn.Conv2d(in_channels, hidden_size, kernel_size=patch_size, stride=patch_size)

    def forward(self, x):
        return self.proj(x).flatten(2).transpose(1, 2)


class TimestepEmbedder(nn.Module):
    """Scalar noise level (EDM's c_noise) -> vector, through sinusoidal features and an MLP."""

    def __init__(self, hidden_size, frequency_embedding_size=256):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(frequency_embedding_size, hidden_size), nn.SiLU(),
                                 nn.Linear(hidden_size, hidden_size))
        self.frequency_embedding_size = frequency_embedding_size

    @staticmethod
    def timestep_embedding(t, dim, max_period=10000):
        half = dim // 2
        freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
        args = t.float()[:, None] * freqs[None]
        return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)

    def forward(self, t):
        return self.mlp(self.timestep_embedding(t, self.frequency_embedding_size).to(self.mlp[0].weight.dtype))


class LabelEmbedder(nn.Module):
    """Class label -> vector. Row `num_classes` is the null class used for class dropout and CFG."""

    def __init__(self, num_classes, hidden_size):
        super().__init__()
        self.num_classes = num_classes
        self.embedding_table = nn.Embedding(num_classes + 1, hidden_size)

    def forward(self, labels):
        return self.embedding_table(labels)


class Attention(nn.Module):
    """Multi-head self-attention through F.scaled_dot_product_attention (flash / memory-efficient)."""

    def __init__(self, dim, num_heads, qk_norm=False):
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(dim, dim * 3)
        self.q_norm = nn.LayerNorm(dim // num_heads, eps=1e-6) if qk_norm else nn.Identity()
        self.k_norm = nn.LayerNorm(dim // num_heads, eps=1e-6) if qk_norm else nn.Identity()
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        B, N, C = x.shape
        q, k, v = self.qkv(x).reshape(B, N, 3, self.num_heads, C // self.num_heads).permute(2, 0, 3, 1, 4)
        x = attention(self.q_norm(q), self.k_norm(k), v)
        return self.proj(x.transpose(1, 2).reshape(B, N, C))


class DiTBlock(nn.Module):
    """Transformer block with adaLN-Zero conditioning (6 modulation vectors from c)."""

    def __init__(self, hidden_size, num_heads, mlp_ratio=4.0, qk_norm=False):
        super().__init__()
        self.norm1 = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.attn = Attention(hidden_size, num_heads, qk_norm=qk_norm)
        self.norm2 = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.mlp = Mlp(hidden_size, int(hidden_size * mlp_ratio))
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden_size, 6 * hidden_size))

    def forward(self, x, c):
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.adaLN_modulation(c).chunk(6, dim=1)
        x = x + gate_msa.unsqueeze(1) * self.attn(modulate(self.norm1(x), shift_msa, scale_msa))
        return x + gate_mlp.unsqueeze(1) * self.mlp(modulate(self.norm2(x), shift_mlp, scale_mlp))


class FinalLayer(nn.Module):
    def __init__(self, hidden_size, patch_size, out_channels, norm=None):
        super().__init__()  # norm: the blocks' `final_norm` class (LightningDiT's RMSNorm); DiT's LayerNorm if None
        self.norm_final = norm(hidden_size) if norm else nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.linear = nn.Linear(hidden_size, patch_size * patch_size * out_channels)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden_size, 2 * hidden_size))

    def forward(self, x, c):
        shift, scale = self.adaLN_modulation(c).chunk(2, dim=1)
        return self.linear(modulate(self.norm_final(x), shift, scale))


def sincos_pos_embed_2d(embed_dim, grid_size):
    """Fixed 2-D sine-cosine position embedding [grid_size**2, embed_dim] (half the dims per axis).
    The first half encodes the column index, as in DiT/MAE, so DiT-family weights transfer unchanged."""

    def axis_embed(dim, pos):
        omega = 1.0 / 10000 ** (np.arange(dim // 2, dtype=np.float64) / (dim / 2.0))
        out = np.einsum("m,d->md", pos.reshape(-1), omega)
        return np.concatenate([np.sin(out), np.cos(out)], axis=1)

    grid_w, grid_h = np.meshgrid(np.arange(grid_size, dtype=np.float64), np.arange(grid_size, dtype=np.float64))
    emb = np.concatenate([axis_embed(embed_dim // 2, grid_w), axis_embed(embed_dim // 2, grid_h)], axis=1)
    return torch.from_numpy(emb).float()


class DiT(nn.Module, PyTorchModelHubMixin, library_name="tread", tags=["diffusion", "tread", "dit"],
          paper_url="https://arxiv.org/abs/2501.04765"):
    def __init__(self, input_size=32, patch_size=2, in_channels=4, hidden_size=1152, depth=28, num_heads=16,
                 mlp_ratio=4.0, num_classes=1000, enable_routing=False, routes=None, qk_norm=False,
                 fp32_after_route=True, grad_checkpointing=False, block_type="attention", init="official"):
        super().__init__()
        self.in_channels = self.out_channels = in_channels
        self.patch_size = patch_size
        self.num_heads = num_heads
        self.num_classes = num_classes
        self.grad_checkpointing = grad_checkpointing
        self.x_embedder = PatchEmbed(input_size, patch_size, in_channels, hidden_size)
        self.t_embedder = TimestepEmbedder(hidden_size)
        self.y_embedder = LabelEmbedder(num_classes, hidden_size)
        grid = self.x_embedder.grid_size[0]
        self.register_buffer("pos_embed", sincos_pos_embed_2d(hidden_size, grid).unsqueeze(0), persistent=False)
        block_cls = BLOCK_TYPES[block_type]
        # A block class with `takes_positions = True` (one with RoPE, say) is called `block(x, c, positions)`, each
        # token's (row, column) on the patch grid [B, N, 2]; inside a route, the kept tokens' own.
        rows, columns = torch.meshgrid(torch.arange(grid), torch.arange(grid), indexing="ij")
        self.register_buffer("grid_positions", torch.stack([rows, columns], -1).reshape(1, -1, 2).float(),
                             persistent=False)
        self.takes_positions = getattr(block_cls, "takes_positions", False)
        self.blocks = nn.ModuleList([block_cls(hidden_size, num_heads, mlp_ratio, qk_norm) for _ in range(depth)])
        self.router = TokenRouter(resolve_routes(routes, depth, FUSIONS), enable_routing, fp32_after_route)
        self.final_layer = FinalLayer(hidden_size, patch_size, self.out_channels,
                                      getattr(block_cls, "final_norm", None))
        self.initialize_weights(init)
        # each fusion's module (SPRINT's mask token and projection; none for TREAD routes, whose state dict is
        # unchanged), built after the backbone's initialisation: the fusion's own, from its builder, stands
        self.fusions = nn.ModuleDict({str(k): FUSIONS[r.fusion].build(hidden_size, r, **r.fusion_options)
                                      for k, r in enumerate(self.router.routes) if r.fusion != "none"})
        self.droppable = frozenset(str(k) for k, r in enumerate(self.router.routes) if drops_deep_path(r))

    def initialize_weights(self, init="official"):
        def basic_init(module):
            if isinstance(module, nn.Linear):
                nn.init.xavier_uniform_(module.weight)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)

        for name, child in self.named_children():  # a fusion keeps the initialisation its builder gave it
            if name != "fusions":
                child.apply(basic_init)
        w = self.x_embedder.proj.weight.data
        nn.init.xavier_uniform_(w.view(w.shape[0], -1))
        nn.init.zeros_(self.x_embedder.proj.bias)
        nn.init.normal_(self.y_embedder.embedding_table.weight, std=0.02)
        nn.init.normal_(self.t_embedder.mlp[0].weight, std=0.02)
        nn.init.normal_(self.t_embedder.mlp[2].weight, std=0.02)
        if init == "official":  # the authors' code stops here: modulation and output layers keep xavier
            return
        # adaLN-Zero: every residual branch and the output start at zero.
        for block in self.blocks:
            nn.init.zeros_(block.adaLN_modulation[-1].weight)
            nn.init.zeros_(block.adaLN_modulation[-1].bias)
        nn.init.zeros_(self.final_layer.adaLN_modulation[-1].weight)
        nn.init.zeros_(self.final_layer.adaLN_modulation[-1].bias)
        nn.init.zeros_(self.final_layer.linear.weight)
        nn.init.zeros_(self.final_layer.linear.bias)

    def unpatchify(self, x):
        """[B, N, p*p*C] -> [B, C, H, W]."""
        c, p = self.out_channels, self.patch_size
        h = w = int(x.shape[1] ** 0.5)
        x = x.reshape(x.shape[0], h, w, p, p, c)
        return torch.einsum("nhwpqc->nchpwq", x).reshape(x.shape[0], c, h * p, w * p)

    def run_block(self, block, x, c, fp32: bool = False, positions=None):
        """One block, recomputed in the backward pass under grad_checkpointing. `fp32`: run outside autocast (the
        block after a route, RoutingPass.fp32). `positions`: the tokens' grid positions, for a block that takes
        them."""
        if fp32 and autocast_on(x.device.type):
            with torch.autocast(device_type=x.device.type, enabled=False):
                return self.run_block(block, x.float(), c.float(), positions=positions)
        inputs = (x, c) if positions is None else (x, c, positions)
        if self.grad_checkpointing and torch.is_grad_enabled():
            return checkpoint(block, *inputs, use_reentrant=False)
        return block(*inputs)

    def forward(self, x, t, y=None, force_routing_ratio=None, routing_seed=None, force_keep=None,
                drop_deep_path=False, repa_tap=None):
        """x [B, C, H, W], t [B] noise level, y [B] labels (None or `num_classes` = unconditional).

        force_routing_ratio: every route runs at this ratio, in eval mode too (routing guidance); routing_seed: the
        kept tokens drawn from this seed. force_keep: optional [B, N] bool mask of tokens (patch grid, row-major)
        that are never routed. drop_deep_path: every route whose fusion can (SPRINT's: mask tokens instead) skips
        its blocks, path-drop guidance's weak branch; refused on a model with no such route. repa_tap: a
        training.repa.Tap, called with one block's output tokens and, inside
        a route, their positions (REPA's alignment)."""
        if y is None:
            y = torch.full((x.shape[0],), self.num_classes, dtype=torch.long, device=x.device)
        x = self.x_embedder(x) + self.pos_embed
        c = self.t_embedder(t) + self.y_embedder(y)
        # contiguous, as the gathered positions inside a route are: compiled per block, one graph serves both
        positions = self.grid_positions.expand(x.shape[0], -1, -1).contiguous() if self.takes_positions else None
        routing = self.router.start_pass(x, force_routing_ratio, routing_seed, force_keep, drop_deep_path,
                                         self.fusions, positions, repa_tap, self.droppable)
        for i, block in enumerate(self.blocks):
            x = routing.enter(i, x)
            if routing.runs(i):
                x = routing.tap(i, self.run_block(block, x, c, routing.fp32(i), routing.positions))
            x = routing.leave(i, x)
        return self.unpatchify(self.final_layer(x, c))

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, **kwargs):
        """An exported model (`python -m tools.export`): a local folder (offline), or a Hub repository id (through
        the Hub cache). Keyword arguments override the config, e.g. `routes=[], enable_routing=False` for an
        unrouted model from a TREAD export. `save_pretrained(DIR)` and `push_to_hub(REPO_ID)` write the same layout."""
        refuse_missing_folder(pretrained_model_name_or_path)
        with hub_errors_as_user_errors(pretrained_model_name_or_path):
            return super().from_pretrained(pretrained_model_name_or_path, **kwargs)

    @classmethod
    def _from_pretrained(cls, *, model_id, revision, cache_dir, force_download, local_files_only, token,
                         map_location="cpu", strict=True, config=None, **model_kwargs):
        # the mixin's own loader falls back to a pickled file and accepts missing keys: safetensors only, exact
        config_file = model_file(model_id, CONFIG_NAME, revision=revision, cache_dir=cache_dir,
                                 force_download=force_download, local_files_only=local_files_only, token=token)
        weights = model_file(model_id, WEIGHTS_NAME, revision=revision, cache_dir=cache_dir,
                             force_download=force_download, local_files_only=local_files_only, token=token)
        on_file = {k: v for k, v in (config or read_config(config_file)).items() if k != "tread"}
        on_file["routes"] = routing_module.saved_routes(on_file.get("routes"), FUSIONS)  # an older export's keys
        model = cls(**checked_arguments({**on_file, **model_kwargs}, where=str(config_file)))  # sample.py's rule
        model._hub_mixin_config = {**(config or {}), **model_kwargs}  # save/push_to_hub keep the "tread" entry
        load_exact(model, read_weights(weights), model_id)
        return model.to(map_location).eval()


# The block registry (model.params.block_type): the schema's rule reads it, so a block added here, by this file
# or from outside, is a config value at once. A block is built as cls(hidden_size, num_heads, mlp_ratio, qk_norm).
BLOCK_TYPES = {"attention": DiTBlock, "ssm": SSMBlock, "lightningdit": LightningDiTBlock}
# The fusion registry (a route's `fusion` other than none): routing_module.Fusion entries, checked like BLOCK_TYPES.
FUSIONS = {"sprint": SPRINT}


def drops_deep_path(route) -> bool:
    """Whether path-drop guidance can use this route: its fusion builds the sequence without the route's blocks."""
    return route.fusion != "none" and FUSIONS[route.fusion].drops_deep_path


def _registry():
    sizes = {"D": (12, 64, 4), "T": (12, 128, 4), "S": (12, 384, 6), "B": (12, 768, 12), "L": (24, 1024, 16), "XL": (28, 1152, 16)}
    models = {f"DiT-{name}/{p}": dict(depth=d, hidden_size=h, num_heads=n, patch_size=p)
              for name, (d, h, n) in sizes.items() for p in (2, 4, 8)}
    models.update({f"DiS-{name}/{p}": dict(depth=d, hidden_size=h, num_heads=n, patch_size=p, block_type="ssm")
                   for name, (d, h, n) in sizes.items() if name in ("T", "S", "B") for p in (2, 4, 8)})
    models.update({f"LightningDiT-{name}/{p}": dict(depth=d, hidden_size=h, num_heads=n, patch_size=p,
                                                    block_type="lightningdit")
                   for name, (d, h, n) in sizes.items() for p in (1, 2, 4, 8)})
    return models


# "DiT-D/*" (12 blocks, 64 wide, 4 heads) is the embedded digits preset's model, sized so the demo draws digits
# within minutes on 2 CPU cores; "DiT-T/*" (128 wide) is the tiny model of tests and benchmarks.
# "DiS-*": the same embedders and adaLN-Zero conditioning with state-space blocks instead of attention
# (backbones/ssm.py), a backbone that is not a transformer, routed by the same block loop.
# "LightningDiT-*": LightningDiT's blocks (backbones/lightningdit.py: RMSNorm, 2-D RoPE from each token's grid
# position, SwiGLU), its sizes DiT's; /1 is its ImageNet latents' patch size.
DiT_models = _registry()

INITS = ("official", "adaln_zero")  # initialize_weights's (model.params.init; the schema's rule reads it)


def checked_arguments(params, where: str = "model.params") -> dict:
    """The checked arguments of `DiT` (nulls dropped): the keys, types and value rules of `model.params`
    (tread_utils.model_spec, the config's own; an int is never a bool or a string of digits), the values this
    code builds, sizes that fit, routes resolved into `Route`s. The one check of a model's values, for the config,
    exported config.json files and Python callers alike; `where` names the source in its one-line UserError."""
    def name(key):  # model.params.depth, or depth in exported/x/config.json
        return f"{where}.{key}" if where == "model.params" else f"{key} in {where}"

    params = {k: v for k, v in dict(params).items() if v is not None}
    fields = {f.name: f for f in dataclasses.fields(model_spec.ModelParamsSchema)}
    unknown = sorted(set(params) - set(fields))
    if unknown:
        raise UserError(f"unknown {where} key(s) {unknown}; accepted: {sorted(fields)}")
    for key, (supported, why) in model_spec.PAPER_ONLY_VALUES.items():
        value = params.pop(key, supported)
        if value != supported:
            raise UserError(f"{name(key)}={value!r} is not supported: only {supported!r} ({why}); "
                            f"remove the key or set it to {supported!r}")
    types = typing.get_type_hints(model_spec.ModelParamsSchema)
    for key, value in params.items():
        kind, rule = plain_type(types[key]), fields[key].metadata["rule"]
        if not takes(kind, value):  # routes: checked by resolve_routes below
            raise UserError(f"{name(key)} must be {TYPE_WORDS[kind]}, got {value!r} ({type(value).__name__})")
        if kind in (int, float):
            params[key] = kind(value)
        if rule is not None and not rule.ok(params[key]):
            raise UserError(f"{name(key)} must be {rule.allowed}, got {value!r}"
                            f"{routing_module.IMPORTS_HINT if key == 'block_type' else ''}")
    kwargs = {**dit_defaults(), **params}
    if kwargs["input_size"] % kwargs["patch_size"]:
        raise UserError(f"input_size {kwargs['input_size']} is not divisible by patch size {kwargs['patch_size']}")
    params["routes"] = resolve_routes(params.get("routes"), kwargs["depth"], FUSIONS)  # resolved once, as objects
    return params


def dit_defaults() -> dict:
    """Every argument of `DiT` with its default value."""
    return {n: p.default for n, p in inspect.signature(DiT.__init__).parameters.items() if n != "self"}


def model_kwargs(backbone_type: str, params, where: str = "model.params") -> dict:
    """`checked_arguments` for a registry name and the config's `model.params`, which may override its sizes
    (a null value keeps the registry's or DiT's default)."""
    if backbone_type not in DiT_models:
        raise UserError(unknown_backbone(backbone_type))
    return checked_arguments({**DiT_models[backbone_type], **{k: v for k, v in dict(params).items()
                                                              if v is not None}}, where)


def unknown_backbone(name) -> str:
    """The refusal of a name not in the registry, short enough to read: the closest name, then each family as
    its sizes and patches (the registry is every size of a family at every one of its patches)."""
    import difflib  # only on this error's path

    families = {}
    for known in DiT_models:
        family, _, shape = known.partition("-")
        size, _, patch = shape.partition("/")
        sizes, patches = families.setdefault(family, ({}, {}))
        sizes[size] = patches[patch] = None
    lowered = {known.lower(): known for known in DiT_models}  # `dit-b/2` is DiT-B/2 mistyped
    close = [lowered[k] for k in difflib.get_close_matches(str(name).lower(), lowered, n=1, cutoff=0.75)]
    return (f"unknown backbone {name!r} (model.backbone_type)" + (f"; did you mean {close[0]}?" if close else "")
            + "; families: " + ", ".join(f"{f}-{{{','.join(s)}}}/{{{','.join(p)}}}" for f, (s, p) in families.items()))


def get_model(backbone_type: str, params, where: str = "model.params") -> DiT:
    """Build a backbone from the registry; `params` holds the config keys (and may override sizes)."""
    return DiT(**model_kwargs(backbone_type, params, where))
