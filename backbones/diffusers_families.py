"""What TREAD needs to know about each diffusers transformer family (backbones/diffusers_tread.py routes them).

For every family: the block lists in route order, whether one selection is shared by the batch, where a
block's output holds the image tokens, how a block's other per-token inputs (RoPE tables, per-token
timestep embeddings) are cut to the kept tokens, and the token grid of the image (for masks).

Text tokens are never routed: the routed tensor is always the block's `hidden_states`, which in these four
families holds image (or video) tokens only; text travels in `encoder_hidden_states`.

- PixArt (`transformer_blocks`): cross-attention to text, no RoPE. Selection per sample.
- SD3 (`transformer_blocks`): joint attention; the text stream passes every block whole. Per sample.
- FLUX (`transformer_blocks`, then `single_transformer_blocks`): route indices number the dual-stream blocks
  0..D-1 and the single-stream blocks D..D+S-1 (negative indices count from the last single-stream block).
  Its RoPE table `(cos, sin)` is [T + N, head_dim], text rows first, shared by the batch, and diffusers'
  attention applies it without a batch dimension; so one selection is shared by the batch and the table
  passed to a routed block is the text rows followed by the kept image tokens' rows, each token keeping
  its own angles.
- AuraFlow (`joint_transformer_blocks`, then `single_transformer_blocks`, numbered as FLUX's): no RoPE (learned
  positions added at the input); per sample. Its single-stream blocks take [register tokens, text, image] as one
  `hidden_states`: only the image part (after the leading register and text tokens) is routed there.
- Wan (`blocks`): 3-D RoPE `(cos, sin)` [1, N, 1, head_dim] (frames x rows x columns, so a single frame
  is the F=1 case of the same table); it broadcasts over the batch, so the selection is per sample and each
  sample's kept rows are gathered to [B, K, 1, head_dim]. A per-token timestep embedding (Wan 2.2 TI2V,
  [B, N, 6, D]) is gathered with the tokens.
"""
from dataclasses import dataclass
from typing import Callable, Optional, Tuple

import torch

from tread_utils.errors import UserError


def _rows(keep: torch.Tensor) -> torch.Tensor:
    return torch.arange(keep.shape[0], device=keep.device)[:, None]


def _flux_narrow(kw: dict, keep: torch.Tensor) -> None:
    """The RoPE rows of the text tokens, then those of the kept image tokens (batch-shared selection)."""
    rope = kw.get("image_rotary_emb")
    if rope is None:
        return
    text = kw["encoder_hidden_states"].shape[1]
    rows = torch.cat([torch.arange(text, device=keep.device), text + keep[0]])
    kw["image_rotary_emb"] = tuple(table.index_select(0, rows.to(table.device)) for table in rope)
    _flux_attention_mask(kw, keep)


def _flux_attention_mask(kw: dict, keep: torch.Tensor) -> None:
    """An attention mask in joint_attention_kwargs ([B, T + N] over the keys, or [B, 1 or heads, T + N, T + N],
    text first; bool or additive) as its text part followed by each sample's kept image tokens' part."""
    extra = kw.get("joint_attention_kwargs") or {}
    if extra.get("attention_mask") is None:
        return
    text = kw["encoder_hidden_states"].shape[1]
    text_rows = torch.arange(text, device=keep.device).expand(keep.shape[0], -1)
    positions = torch.cat([text_rows, text + keep], 1)
    kw["joint_attention_kwargs"] = dict(extra, attention_mask=gather_attention_mask(extra["attention_mask"],
                                                                                    positions, "FLUX"))


def _wan_narrow(kw: dict, keep: torch.Tensor) -> None:
    """Each sample's kept RoPE rows [B, K, 1, head_dim]; a per-token timestep embedding likewise."""
    rope = kw.get("rotary_emb")
    if rope is not None:
        kw["rotary_emb"] = tuple(table[0][keep.to(table.device)] for table in rope)
    if kw["temb"].ndim == 4:
        kw["temb"] = kw["temb"][_rows(keep), keep]


def gather_attention_mask(mask: torch.Tensor, positions: torch.Tensor, family: str) -> torch.Tensor:
    """The part of an attention mask [b, L] (keys) or [b, (h,) L or 1, L] at each sample's kept `positions`
    [B, K'] of the L-token sequence: the key axis always, the query axis where it has the keys' length."""
    length, batch = mask.shape[-1], positions.shape[0]
    if mask.ndim not in (2, 3, 4) or mask.shape[0] not in (1, batch) or (mask.ndim > 2 and mask.shape[-2] not in
                                                                          (1, length)):
        raise UserError(f"TREAD cannot route a {family} attention mask of shape {tuple(mask.shape)}; give it "
                        f"as [B, L] over the keys or [B, heads or 1, L or 1, L]")
    mask = mask.expand(batch, *mask.shape[1:])
    index = positions.to(mask.device).view(batch, *[1] * (mask.ndim - 2), -1)
    mask = mask.gather(-1, index.expand(*mask.shape[:-1], -1))
    if mask.ndim > 2 and mask.shape[-2] == length:
        mask = mask.gather(-2, index.transpose(-1, -2).expand(*mask.shape[:-2], -1, mask.shape[-1]))
    return mask


def _pixart_narrow(kw: dict, keep: torch.Tensor) -> None:
    """PixArt's image attention mask, a bias [B, 1, N] by the time it reaches the blocks, at the kept tokens."""
    if kw.get("attention_mask") is not None:
        kw["attention_mask"] = gather_attention_mask(kw["attention_mask"], keep, "PixArt")


def _no_narrow(kw: dict, keep: torch.Tensor) -> None:
    return None


def _latent_grid(patch_key: str, spatial: int) -> Callable:
    """Token grid of a [B, C, (F,) H, W] latent input split into patches of config[patch_key]."""
    def grid(transformer, kw: dict) -> Tuple[int, ...]:
        patch = transformer.config[patch_key]
        patch = tuple(patch) if isinstance(patch, (tuple, list)) else (patch,) * spatial
        shape = kw["hidden_states"].shape[-spatial:]
        return tuple(size // p for size, p in zip(shape, patch))
    return grid


def _flux_grid(transformer, kw: dict) -> Tuple[int, ...]:
    """Rows x columns of the packed image, read from img_ids (the latents are already tokens)."""
    ids = kw.get("img_ids")
    if ids is None:
        return (kw["hidden_states"].shape[1],)
    ids = ids[0] if ids.ndim == 3 else ids
    return (int(ids[:, 1].unique().numel()), int(ids[:, 2].unique().numel()))


def _no_lead(transformer, kw: dict) -> dict:
    return {}


def _auraflow_lead(transformer, kw: dict) -> dict:
    """AuraFlow's single-stream blocks get [register tokens, text, image] in one tensor."""
    return {"single_transformer_blocks": transformer.register_tokens.shape[1] + kw["encoder_hidden_states"].shape[1]}


@dataclass(frozen=True)
class Family:
    block_lists: Tuple[str, ...]   # the transformer's block lists, in route-index order
    shared: bool                   # one selection for the whole batch (RoPE table without a batch dimension)
    out_index: Optional[int]       # where a block's output tuple holds the image tokens (None: it is them)
    narrow: Callable               # (block kwargs, keep [B, K]) -> None: other per-token inputs, cut in place
    grid: Callable                 # (transformer, forward kwargs) -> the image's token grid
    refused: Tuple[str, ...] = ()  # forward arguments that add per-block residuals of the full length
    lead: Callable = _no_lead      # (transformer, forward kwargs) -> {block list: text tokens before the image}
    tensor_lists: Tuple[str, ...] = ()  # block lists whose output is the tensor itself, whatever out_index says

    def image(self, output, kind: str):
        return output if self.out_index is None or kind in self.tensor_lists else output[self.out_index]

    def with_image(self, output, kind: str, image: torch.Tensor):
        if self.out_index is None or kind in self.tensor_lists:
            return image
        return tuple(image if i == self.out_index else part for i, part in enumerate(output))


FAMILIES = {
    "PixArtTransformer2DModel": Family(("transformer_blocks",), False, None, _pixart_narrow,
                                       _latent_grid("patch_size", 2)),
    "SD3Transformer2DModel": Family(("transformer_blocks",), False, 1, _no_narrow, _latent_grid("patch_size", 2),
                                    ("block_controlnet_hidden_states", "skip_layers")),
    "FluxTransformer2DModel": Family(("transformer_blocks", "single_transformer_blocks"), True, 1, _flux_narrow,
                                     _flux_grid, ("controlnet_block_samples", "controlnet_single_block_samples")),
    "WanTransformer3DModel": Family(("blocks",), False, None, _wan_narrow, _latent_grid("patch_size", 3)),
    "AuraFlowTransformer2DModel": Family(("joint_transformer_blocks", "single_transformer_blocks"), False, 1,
                                         _no_narrow, _latent_grid("patch_size", 2), lead=_auraflow_lead,
                                         tensor_lists=("single_transformer_blocks",)),
}


def family_of(transformer) -> Family:
    """The family of a diffusers transformer; an unsupported class is refused in one line."""
    import diffusers

    for name, family in FAMILIES.items():
        if isinstance(transformer, getattr(diffusers, name)):
            return family
    raise UserError(f"apply_tread does not support {type(transformer).__name__}; supported diffusers "
                    f"transformers: {', '.join(FAMILIES)}")


# What routing reads from each family's code, checked when apply_tread attaches: the transformer forward's
# parameters (the grid, the text length, the refused inputs) and each block list's forward parameters (the
# routed hidden_states and the per-token inputs `narrow` cuts). A diffusers version whose code differs here is
# refused, naming the difference.
_FLUX_BLOCK = ("hidden_states", "encoder_hidden_states", "temb", "image_rotary_emb", "joint_attention_kwargs")
RELIES_ON = {
    "PixArtTransformer2DModel": {"forward": ("hidden_states", "attention_mask", "encoder_hidden_states"),
                                 "transformer_blocks": ("hidden_states", "attention_mask")},
    "SD3Transformer2DModel": {"forward": ("hidden_states", "encoder_hidden_states", "block_controlnet_hidden_states",
                                          "skip_layers"),
                              "transformer_blocks": ("hidden_states", "encoder_hidden_states", "temb")},
    "FluxTransformer2DModel": {"forward": ("hidden_states", "encoder_hidden_states", "img_ids",
                                           "controlnet_block_samples", "controlnet_single_block_samples"),
                               "transformer_blocks": _FLUX_BLOCK, "single_transformer_blocks": _FLUX_BLOCK},
    "WanTransformer3DModel": {"forward": ("hidden_states", "encoder_hidden_states", "timestep"),
                              "blocks": ("hidden_states", "encoder_hidden_states", "temb", "rotary_emb")},
    "AuraFlowTransformer2DModel": {"forward": ("hidden_states", "encoder_hidden_states"),
                                   "joint_transformer_blocks": ("hidden_states", "encoder_hidden_states", "temb"),
                                   "single_transformer_blocks": ("hidden_states", "temb")},
}
