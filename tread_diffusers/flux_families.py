"""FLUX, FLUX.2 and Chroma for TREAD, registered into tread_diffusers/families.py's FAMILIES (whose docstring says
what a Family holds); their joint RoPE over [text, image] is cut here for Krea2 too (image_families.py).

- FLUX (`transformer_blocks`, then `single_transformer_blocks`): route indices number the dual-stream blocks
  0..D-1 and the single-stream blocks D..D+S-1 (negative indices count from the last single-stream block).
  Its RoPE table `(cos, sin)` is [T + N, head_dim], text rows first, without a batch dimension. A routed block
  gets, per sample, the text rows followed by that sample's kept image rows, [B, T + K, head_dim], wrapped in
  `SampleRope` so that diffusers' `apply_rotary_emb` broadcasts it as [B, T + K, 1, head_dim]: each kept token
  keeps its own angles.
- FLUX.2 and Chroma (`transformer_blocks`, then `single_transformer_blocks`, numbered as FLUX's): the same joint
  RoPE table, cut the same way; their single-stream blocks take [text, image] as one `hidden_states`, where
  only the image part is routed. Chroma's attention mask [B, T + N] is cut like the table. FLUX.2's KV-cache
  modes (reference tokens modulated apart) are refused.
- FLUX Kontext's reference images' tokens follow the target's in `hidden_states` (img_ids' first coordinate not 0):
  never routed, they pass every block whole; their RoPE rows follow the kept target rows.
"""
from typing import Tuple

import torch

from tread_diffusers.families import FAMILIES, Example, Family, SampleRope, gather_attention_mask
from tread_utils.errors import UserError


def _joint_narrow(kw: dict, keep: torch.Tensor) -> None:
    """FLUX, FLUX.2, Chroma: the joint sequence is [text, image]. Its batch-shared RoPE (cos, sin) [T + N, head_dim]
    becomes each sample's text rows and kept image rows; Chroma's attention mask and FLUX's (in
    joint_attention_kwargs) are cut at the same positions."""
    if kw.get("encoder_hidden_states") is not None:
        text = kw["encoder_hidden_states"].shape[1]
    else:  # FLUX.2 and Chroma single-stream blocks: the text leads the (already cut) hidden_states
        text = kw["hidden_states"].shape[1] - keep.shape[1]
    rope = kw.get("image_rotary_emb")
    positions = torch.cat([torch.arange(text, device=keep.device).expand(keep.shape[0], -1), text + keep], 1)
    refs = kw["hidden_states"].shape[1] - keep.shape[1] if kw.get("encoder_hidden_states") is not None else 0
    if refs:  # FLUX Kontext: the reference images' rows, last in the joint table, follow the kept target rows
        rows = (rope[0].shape[0] if rope is not None else text + refs) - refs
        positions = torch.cat([positions, torch.arange(rows, rows + refs, device=keep.device).expand(len(keep), -1)], 1)
    if rope is not None:
        kw["image_rotary_emb"] = tuple(SampleRope(table[positions.to(table.device)]) for table in rope)
    if kw.get("attention_mask") is not None:  # Chroma's [B, T + N]
        kw["attention_mask"] = gather_attention_mask(kw["attention_mask"], positions, "Chroma")
    extra = kw.get("joint_attention_kwargs") or {}
    if extra.get("attention_mask") is not None:  # FLUX's, [B, T + N] or [B, 1 or heads, T + N, T + N]
        kw["joint_attention_kwargs"] = dict(extra, attention_mask=gather_attention_mask(extra["attention_mask"],
                                                                                        positions, "FLUX"))


def _flux_grid(transformer, kw: dict) -> Tuple[int, ...]:
    """Rows x columns of the packed target image, read from img_ids (the latents are already tokens)."""
    ids = kw.get("img_ids")
    if ids is None:
        return (kw["hidden_states"].shape[1],)
    ids = ids[0] if ids.ndim == 3 else ids
    ids = ids[ids[:, 0] == 0]  # the target's; Kontext's reference images have another first coordinate
    return (int(ids[:, 1].unique().numel()), int(ids[:, 2].unique().numel()))


def _flux_tail(transformer, kw: dict) -> int:
    """FLUX Kontext's reference-image tokens: after the target's in hidden_states, told apart by img_ids' first
    coordinate (0 for the target, as diffusers' FluxKontextPipeline builds them); never routed. Read from data, so
    under torch.compile only a count given as `tread_reference_tokens` is used (none: 0), which
    `check_reference_ids` checks against the ids when the compiled forward runs."""
    ids = kw.get("img_ids")
    if ids is None or torch.compiler.is_compiling():
        return 0
    return reference_tokens(ids)


def reference_tokens(ids: torch.Tensor) -> int:
    """The number of reference-image tokens in img_ids (first coordinate not 0), checked to be the last ones: one
    read of the device's values, the one wait for the GPU that an eager routed FLUX forward has."""
    first = (ids[0] if ids.ndim == 3 else ids)[:, 0] != 0
    found, trailing = torch.stack([first.sum(), first.flip(0).long().cumprod(0).sum()]).tolist()
    if found != trailing:
        raise UserError("TREAD reads FLUX Kontext's reference-image tokens as the last ones of hidden_states (img_ids' "
                        "first coordinate not 0); put them after the target's tokens, as FluxKontextPipeline does")
    return found


@torch.library.custom_op("tread::check_reference_ids", mutates_args=())
def check_reference_ids(ids: torch.Tensor, keep: torch.Tensor, references: int, given: bool) -> torch.Tensor:
    """The kept tokens `keep`, copied once FLUX Kontext's img_ids are checked against the reference-image count
    the routes use (`given`: from tread_reference_tokens; else 0 under torch.compile). An op is opaque to
    torch.compile: a compiled forward, which cannot read the ids while tracing, runs this check on their values
    when it runs, inside its one graph; returning the kept tokens keeps it in the data path."""
    found = reference_tokens(ids)
    counted = f"{found} FLUX Kontext reference-image tokens (img_ids' first coordinate not 0)"
    if found != references and given:
        raise UserError(f"tread_reference_tokens={references}, but img_ids has {counted}; pass "
                        f"tread_reference_tokens={found}")
    if found != references:
        raise UserError(f"img_ids has {counted}, which a compiled forward cannot read; pass "
                        f"tread_reference_tokens={found} to the forward")
    return keep.clone()


@check_reference_ids.register_fake
def _(ids: torch.Tensor, keep: torch.Tensor, references: int, given: bool) -> torch.Tensor:
    return torch.empty_like(keep)


def _text_lead(transformer, kw: dict) -> dict:
    """FLUX.2's and Chroma's single-stream blocks get [text, image] in one tensor."""
    return {"single_transformer_blocks": kw["encoder_hidden_states"].shape[1]}


def pack(latents: torch.Tensor) -> torch.Tensor:
    """FLUX's 2x2 packing: [B, C, H, W] -> [B, (H/2)(W/2), 4C], rows of tokens in row-major order."""
    b, c, h, w = latents.shape
    return latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(b, (h // 2) * (w // 2), c * 4)


def image_ids(h: int, w: int, axes: int = 3) -> torch.Tensor:
    """Packed-latent position ids [h * w, axes]: (row, column) at axes 1 and 2, zeros elsewhere."""
    ids = torch.zeros(h, w, axes)
    ids[..., 1], ids[..., 2] = torch.arange(h)[:, None], torch.arange(w)[None]
    return ids.reshape(-1, axes)


def packed_latents(batch: int, channels: int, side: int, frames: int) -> torch.Tensor:
    """Latents of side x side tokens, packed 2 x 2 (FLUX's, FLUX.2's, Chroma's, Qwen-Image's, Krea2's)."""
    return pack(torch.randn(batch, channels, 2 * side, 2 * side))


def packed_grid(x_t: torch.Tensor) -> tuple:
    """The rows x columns of a square-ish packed grid of x_t's tokens."""
    rows = int(round(x_t.shape[1] ** 0.5))
    return rows, x_t.shape[1] // rows


def _joint_inputs(model, x_t, text, pooled, t) -> dict:
    """FLUX.2, Chroma: packed tokens of a square-ish grid with their ids (the text's zeros), t in [0, 1]."""
    rows, columns = packed_grid(x_t)
    axes = len(model.config.axes_dims_rope)
    return dict(hidden_states=x_t, encoder_hidden_states=text, timestep=t,
                img_ids=image_ids(rows, columns, axes).to(x_t.device), txt_ids=text.new_zeros(text.shape[1], axes))


def _flux_inputs(model, x_t, text, pooled, t) -> dict:
    """As FLUX.2's, with the pooled text and, for FLUX.1-dev (guidance_embeds), guidance 1."""
    guidance = torch.ones_like(t) if model.config.guidance_embeds else None
    return dict(_joint_inputs(model, x_t, text, pooled, t), pooled_projections=pooled, guidance=guidance)


def _joint_config(channels: int, width: int, depth: int, text_dim: int) -> dict:
    """A quarter of the blocks dual-stream, the rest single-stream, head_dim 64, over 2 x 2-packed latents."""
    return dict(in_channels=channels * 4, num_layers=depth // 4, num_single_layers=depth - depth // 4,
                attention_head_dim=64, num_attention_heads=width // 64, joint_attention_dim=text_dim)


def _flux_model(channels: int, width: int, depth: int, text_dim: int, side: int):
    from diffusers import FluxTransformer2DModel

    return FluxTransformer2DModel(pooled_projection_dim=text_dim, axes_dims_rope=(16, 24, 24),
                                  **_joint_config(channels, width, depth, text_dim))


def _flux2_model(channels: int, width: int, depth: int, text_dim: int, side: int):
    from diffusers import Flux2Transformer2DModel

    return Flux2Transformer2DModel(axes_dims_rope=(16, 16, 16, 16), guidance_embeds=False,
                                   **_joint_config(channels, width, depth, text_dim))


def _chroma_model(channels: int, width: int, depth: int, text_dim: int, side: int):
    from diffusers import ChromaTransformer2DModel

    return ChromaTransformer2DModel(axes_dims_rope=(16, 24, 24), approximator_hidden_dim=width, approximator_layers=2,
                                    **_joint_config(channels, width, depth, text_dim))


FLUX_BLOCKS = ("transformer_blocks", "single_transformer_blocks")  # dual-stream, then single-stream
FLUX_CONTROLNET = ("controlnet_block_samples", "controlnet_single_block_samples")
_FLUX_BLOCK = ("hidden_states", "encoder_hidden_states", "temb", "image_rotary_emb", "joint_attention_kwargs")
FLUX_FAMILIES = {
    "FluxTransformer2DModel": Family(FLUX_BLOCKS, 1, _joint_narrow, _flux_grid, FLUX_CONTROLNET, tail=_flux_tail,
                                     tail_ids="img_ids",
                                     name="FLUX",
                                     example=Example("flux", _flux_model, packed_latents, _flux_inputs),
                                     relies_on={"forward": ("hidden_states", "encoder_hidden_states", "img_ids",
                                                            "controlnet_block_samples",
                                                            "controlnet_single_block_samples"),
                                                "transformer_blocks": _FLUX_BLOCK,
                                                "single_transformer_blocks": _FLUX_BLOCK}),
    "Flux2Transformer2DModel": Family(FLUX_BLOCKS, 1, _joint_narrow, _flux_grid, ("kv_cache", "kv_cache_mode"),
                                      lead=_text_lead, tensor_lists=("single_transformer_blocks",),
                                      name="FLUX.2",
                                      example=Example("flux2", _flux2_model, packed_latents, _joint_inputs),
                                      relies_on={"forward": ("hidden_states", "encoder_hidden_states", "img_ids",
                                                             "kv_cache", "kv_cache_mode"),
                                                 "transformer_blocks": ("hidden_states", "encoder_hidden_states",
                                                                        "image_rotary_emb"),
                                                 "single_transformer_blocks": ("hidden_states",
                                                                               "encoder_hidden_states",
                                                                               "image_rotary_emb")}),
    "ChromaTransformer2DModel": Family(FLUX_BLOCKS, 1, _joint_narrow, _flux_grid, FLUX_CONTROLNET, lead=_text_lead,
                                       tensor_lists=("single_transformer_blocks",),
                                       name="Chroma",
                                       example=Example("chroma", _chroma_model, packed_latents, _joint_inputs),
                                       relies_on={"forward": ("hidden_states", "encoder_hidden_states", "img_ids",
                                                              "attention_mask", "controlnet_block_samples",
                                                              "controlnet_single_block_samples"),
                                                  "transformer_blocks": ("hidden_states", "encoder_hidden_states",
                                                                         "image_rotary_emb", "attention_mask"),
                                                  "single_transformer_blocks": ("hidden_states", "image_rotary_emb",
                                                                                "attention_mask")}),
}
FAMILIES.update(FLUX_FAMILIES)
