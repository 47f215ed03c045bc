"""Diffusers image families for TREAD, registered into tread_diffusers/families.py's FAMILIES (whose docstring says
what a Family holds); the hooks in tread_diffusers/tread.py read them from there. FLUX, FLUX.2 and Chroma are in
flux_families.py.

- PixArt (`transformer_blocks`): cross-attention to text, no RoPE.
- SD3 (`transformer_blocks`): joint attention; the text stream passes every block whole.
- Qwen-Image (`transformer_blocks`): dual-stream, the text in `encoder_hidden_states` (its mask is joined with
  the image inside the attention, so it fits any cut). `hidden_states` is the target image's tokens followed,
  in the edit models, by reference images' tokens (`img_shapes` per sample: the target's (frames, rows,
  columns), then the references'); only the target's are routed, the references pass every block whole. The
  image RoPE is complex, [N + R, head_dim / 2] without a batch dimension, and the text has its own table: a
  routed block gets each sample's kept target rows followed by every reference row (`SampleRope`). The edit
  model's per-token modulation index (`zero_cond_t`: target 0, reference 1) is gathered with the tokens.
- AuraFlow (`joint_transformer_blocks`, then `single_transformer_blocks`, numbered as FLUX's): no RoPE (learned
  positions added at the input); per sample. Its single-stream blocks take [register tokens, text, image] as one
  `hidden_states`: only the image part (after the leading register and text tokens) is routed there.
- Z-Image (`layers`; the refiners `noise_refiner` and `context_refiner` run before the route, whole): a single
  stream whose block argument is `x`, per sample [image, padding to a multiple of 32, caption tokens padded to a
  multiple of 32], the batch padded to its longest caption. Only the image's first N = F/pf x H/p x W/p tokens
  are routed; its padding and the caption follow as conditioning tokens that pass every block whole. The RoPE
  table `freqs_cis` is complex, per sample, [B, L, head_dim / 2]: each sample's kept rows, then the conditioning
  rows. Its attention mask [B, L] (present when the captions differ in length) is cut the same way. The
  modulation `adaln_input` [B, D] is one per sample. The omni variant (nested image lists, SigLIP features,
  per-token noise masks) and ControlNet residuals are refused.
- Krea2 (`transformer_blocks`): a single stream [text, image] in every block's `hidden_states`, the text leading
  (its length is `encoder_hidden_states`'); only the image part is routed. Its RoPE (cos, sin) [T + N, head_dim]
  over the joint sequence has no batch dimension, and its attention mask [B, 1, 1, T + N] masks padded text:
  both are cut as FLUX's single-stream blocks' are (`_joint_narrow`). The modulation [B, 1, 6 * D] is one per
  sample.
- Lumina2 (`layers`; the refiners `noise_refiner` (image alone) and `context_refiner` (caption alone) run before
  the route, whole): a single stream whose block argument is `hidden_states`, per sample [its caption, the N image
  tokens, padding to the batch's longest], the caption as long as the ones of its `encoder_attention_mask`. So the
  image starts at a per-sample offset (`SampleLead`), and only those N tokens are routed; the caption and the
  padding pass every block whole. The RoPE table `image_rotary_emb` is complex, per sample, [B, L, head_dim / 2],
  and the attention mask [B, L] (present when the captions differ in length) marks each sample's caption and
  image: both are cut at each sample's routed positions (caption, kept image tokens, padding). The modulation
  `temb` [B, D] is one per sample.
"""
from typing import Tuple

import torch

from tread_diffusers.families import (FAMILIES, Example, Family, SampleLead, SampleRope, _no_narrow,
                                      gather_attention_mask, latent_grid, splice)
from tread_diffusers.flux_families import _joint_narrow, image_ids, packed_grid, packed_latents
from tread_utils.errors import UserError

ZIMAGE_PATCH = 2, 1  # ZImageTransformer2DModel.forward's default patch_size and f_patch_size


def _zimage_shape(kw: dict) -> tuple:
    """The (C, F, H, W) of Z-Image's latents, given as [B, C, F, H, W] or a list of [C, F, H, W] (read from their
    shapes alone: no tensor op, so that a compiled model makes no graph of it); the omni variant is refused."""
    images = kw["x"]
    if isinstance(images, torch.Tensor):
        return tuple(images.shape[1:])
    if isinstance(images[0], (list, tuple)):
        raise UserError("TREAD cannot route Z-Image's omni mode (a list of condition images and a target per "
                        "sample); train the basic mode, or call handle.remove()")
    shapes = sorted({tuple(image.shape) for image in images})
    if len(shapes) > 1:
        raise UserError(f"TREAD routes Z-Image batches whose latents share one shape; got {shapes}: bucket the "
                        f"batch by size")
    return shapes[0]


def _zimage_grid(transformer, kw: dict) -> tuple:
    """Frames x rows x columns of the image tokens (rows x columns for a still image)."""
    patch, f_patch = kw.get("patch_size", ZIMAGE_PATCH[0]), kw.get("f_patch_size", ZIMAGE_PATCH[1])
    _, frames, rows, columns = _zimage_shape(kw)
    grid = (frames // f_patch, rows // patch, columns // patch)
    return grid[1:] if grid[0] == 1 else grid


def _zimage_tail(transformer, kw: dict) -> int:
    """The tokens after the image in the main layers' sequence: the image's padding to a multiple of the model's
    SEQ_MULTI_OF, then the captions, each padded likewise, the batch padded to its longest."""
    from diffusers.models.transformers.transformer_z_image import SEQ_MULTI_OF

    n = 1
    for size in _zimage_grid(transformer, kw):
        n *= size
    caps = kw["cap_feats"]
    lengths = [caps.shape[1]] if isinstance(caps, torch.Tensor) else [cap.shape[0] for cap in caps]
    return max(n + (-n) % SEQ_MULTI_OF + t + (-t) % SEQ_MULTI_OF for t in lengths) - n


def _zimage_narrow(kw: dict, keep: torch.Tensor) -> None:
    """Each sample's kept rows of the complex RoPE table [B, L, head_dim / 2] and of the attention mask [B, L],
    then the rows of the conditioning tokens (the tail after the N image tokens)."""
    tail = kw["x"].shape[1] - keep.shape[1]
    length = kw["freqs_cis"].shape[1]
    rest = torch.arange(length - tail, length, device=keep.device).expand(keep.shape[0], -1)
    positions = torch.cat([keep, rest], 1)
    kw["freqs_cis"] = kw["freqs_cis"].gather(1, positions.to(kw["freqs_cis"].device)[..., None].expand(
        -1, -1, kw["freqs_cis"].shape[-1]))
    if kw.get("attn_mask") is not None:
        kw["attn_mask"] = gather_attention_mask(kw["attn_mask"], positions, "Z-Image")


def _krea2_lead(transformer, kw: dict) -> dict:
    """Krea2's blocks get [text, image] in one tensor."""
    return {"transformer_blocks": kw["encoder_hidden_states"].shape[1]}


def _krea2_grid(transformer, kw: dict) -> tuple:
    """Rows x columns of the packed image, read from the image rows of position_ids [T + N, 3]."""
    ids = kw["position_ids"][kw["encoder_hidden_states"].shape[1]:]
    return (int(ids[:, 1].unique().numel()), int(ids[:, 2].unique().numel()))


def _lumina2_lead(transformer, kw: dict) -> dict:
    """Each sample's caption length (the ones of its mask, as diffusers counts them), before its image tokens."""
    p = transformer.config.patch_size
    rows, columns = (size // p for size in kw["hidden_states"].shape[-2:])
    return {"layers": SampleLead(kw["encoder_attention_mask"], rows * columns)}


def _lumina2_narrow(kw: dict, keep: torch.Tensor) -> None:
    """The per-sample complex RoPE [B, L, head_dim / 2] and attention mask [B, L] at each sample's routed positions:
    its caption, its kept image tokens, its padding. The caption lengths are read back from the mask (it marks
    caption and image); without one every caption has the same length."""
    freqs, mask = kw["image_rotary_emb"], kw.get("attention_mask")
    length = freqs.shape[1]
    n = length - kw["hidden_states"].shape[1] + keep.shape[1]  # the image tokens before the cut
    caption = mask.sum(1) - n if mask is not None else keep.new_full((keep.shape[0],), length - n)
    positions = splice(torch.arange(length, device=keep.device).expand(keep.shape[0], -1), caption, n,
                       caption.to(keep.device)[:, None] + keep)
    kw["image_rotary_emb"] = freqs.gather(1, positions.to(freqs.device)[..., None].expand(-1, -1, freqs.shape[-1]))
    if mask is not None:
        kw["attention_mask"] = gather_attention_mask(mask, positions, "Lumina2")


def _pixart_narrow(kw: dict, keep: torch.Tensor) -> None:
    """PixArt's image attention mask, a bias [B, 1, N] by the time it reaches the blocks, at the kept tokens."""
    if kw.get("attention_mask") is not None:
        kw["attention_mask"] = gather_attention_mask(kw["attention_mask"], keep, "PixArt")


def _qwen_narrow(kw: dict, keep: torch.Tensor) -> None:
    """Qwen-Image: the image RoPE (complex [N + R, head_dim / 2]: the target's rows, then the reference images')
    as each sample's kept target rows followed by every reference row; the edit model's per-token modulation
    index [B, N + R] likewise. The text keeps its own table."""
    refs = kw["hidden_states"].shape[1] - keep.shape[1]
    if kw.get("image_rotary_emb") is not None:
        image, text = kw["image_rotary_emb"]
        n = image.shape[0] - refs
        references = torch.arange(n, n + refs, device=image.device).expand(len(keep), -1)
        kw["image_rotary_emb"] = (SampleRope(image[torch.cat([keep.to(image.device), references], 1)]), text)
    index = kw.get("modulate_index")
    if index is not None:
        kw["modulate_index"] = torch.cat([index.gather(1, keep.to(index.device)), index[:, index.shape[1] - refs:]], 1)


def _qwen_target(kw: dict) -> tuple:
    """The target image's (frames, rows, columns) in Qwen-Image's img_shapes: a shape, a list of them (one per
    sample), or per sample a list whose first shape is the target and the rest reference images."""
    shapes = kw.get("img_shapes")
    while isinstance(shapes, list) and shapes:
        shapes = shapes[0]
    if not (isinstance(shapes, tuple) and len(shapes) == 3):
        raise UserError(f"TREAD reads Qwen-Image's target image from img_shapes, as (frames, height, width) per "
                        f"sample; got {kw.get('img_shapes')!r}")
    return shapes


def _qwen_grid(transformer, kw: dict) -> Tuple[int, ...]:
    frames, rows, columns = _qwen_target(kw)
    return (rows, columns) if frames == 1 else (frames, rows, columns)


def _qwen_tail(transformer, kw: dict) -> int:
    """Qwen-Image-Edit's reference-image tokens follow the target's in hidden_states; they are never routed."""
    frames, rows, columns = _qwen_target(kw)
    return kw["hidden_states"].shape[1] - frames * rows * columns


def _auraflow_lead(transformer, kw: dict) -> dict:
    """AuraFlow's single-stream blocks get [register tokens, text, image] in one tensor."""
    return {"single_transformer_blocks": transformer.register_tokens.shape[1] + kw["encoder_hidden_states"].shape[1]}


def image_latents(batch: int, channels: int, side: int, frames: int) -> torch.Tensor:
    """Latents [B, C, H, W] of side x side tokens in 2 x 2 patches."""
    return torch.randn(batch, channels, 2 * side, 2 * side)


def latents_at_t1000(model, x_t, text, pooled, t) -> dict:
    """PixArt, AuraFlow, Wan: the latents as they are, t * 1000."""
    return dict(hidden_states=x_t, encoder_hidden_states=text, timestep=t * 1000)


def _sd3_inputs(model, x_t, text, pooled, t) -> dict:
    return dict(hidden_states=x_t, encoder_hidden_states=text, pooled_projections=pooled, timestep=t * 1000)


def _qwen_inputs(model, x_t, text, pooled, t) -> dict:
    """Packed tokens of a square-ish grid, told by img_shapes, t in [0, 1]."""
    return dict(hidden_states=x_t, encoder_hidden_states=text, timestep=t,
                img_shapes=[[(1, *packed_grid(x_t))]] * len(t))


def _zimage_inputs(model, x_t, text, pooled, t) -> dict:
    """Latents [B, C, 1, H, W] (one frame), t in [0, 1]."""
    return dict(x=x_t[:, :, None], cap_feats=text, t=t)


def _lumina2_inputs(model, x_t, text, pooled, t) -> dict:
    """Latents [B, C, H, W], t in [0, 1]; every other caption 4 tokens shorter (a padded batch)."""
    lengths = text.shape[1] - 4 * (torch.arange(len(t), device=text.device) % 2)
    return dict(hidden_states=x_t, timestep=t, encoder_hidden_states=text,
                encoder_attention_mask=torch.arange(text.shape[1], device=text.device)[None] < lengths[:, None])


def _pixart_model(channels: int, width: int, depth: int, text_dim: int, side: int):
    from diffusers import PixArtTransformer2DModel

    return PixArtTransformer2DModel(sample_size=2 * side, patch_size=2, in_channels=channels, out_channels=channels,
                                    attention_head_dim=64, num_attention_heads=width // 64, num_layers=depth,
                                    cross_attention_dim=width, caption_channels=text_dim, norm_type="ada_norm_single",
                                    use_additional_conditions=False)


def _sd3_model(channels: int, width: int, depth: int, text_dim: int, side: int):
    from diffusers import SD3Transformer2DModel

    return SD3Transformer2DModel(sample_size=2 * side, patch_size=2, in_channels=channels, num_layers=depth,
                                 attention_head_dim=64, num_attention_heads=width // 64, joint_attention_dim=text_dim,
                                 caption_projection_dim=width, pooled_projection_dim=text_dim, out_channels=channels,
                                 pos_embed_max_size=side)


def _auraflow_model(channels: int, width: int, depth: int, text_dim: int, side: int):
    """A quarter joint blocks, the rest single-stream."""
    from diffusers import AuraFlowTransformer2DModel

    return AuraFlowTransformer2DModel(sample_size=2 * side, patch_size=2, in_channels=channels, out_channels=channels,
                                      attention_head_dim=64, num_attention_heads=width // 64,
                                      num_mmdit_layers=depth // 4, num_single_dit_layers=depth - depth // 4,
                                      joint_attention_dim=text_dim, caption_projection_dim=width,
                                      pos_embed_max_size=side ** 2)


def _qwen_model(channels: int, width: int, depth: int, text_dim: int, side: int):
    """Every block dual-stream."""
    from diffusers import QwenImageTransformer2DModel

    return QwenImageTransformer2DModel(patch_size=2, in_channels=channels * 4, out_channels=channels, num_layers=depth,
                                       attention_head_dim=64, num_attention_heads=width // 64,
                                       joint_attention_dim=text_dim, axes_dims_rope=(16, 24, 24))


def _zimage_model(channels: int, width: int, depth: int, text_dim: int, side: int):
    """One noise and one context refiner before `depth` main layers."""
    from diffusers import ZImageTransformer2DModel

    return ZImageTransformer2DModel(in_channels=channels, dim=width, n_layers=depth, n_refiner_layers=1,
                                    n_heads=width // 64, n_kv_heads=width // 64, cap_feat_dim=text_dim,
                                    axes_dims=[16, 24, 24], axes_lens=[256, 64, 64])


def _lumina2_model(channels: int, width: int, depth: int, text_dim: int, side: int):
    """One noise and one context refiner before `depth` main layers; half as many key-value heads as query heads
    (grouped-query attention, as Lumina-Image 2.0)."""
    from diffusers import Lumina2Transformer2DModel

    return Lumina2Transformer2DModel(in_channels=channels, hidden_size=width, num_layers=depth, num_refiner_layers=1,
                                     num_attention_heads=width // 64, num_kv_heads=max(1, width // 128),
                                     axes_dim_rope=(16, 24, 24), axes_lens=(256, 64, 64), cap_feat_dim=text_dim)


def _krea2_inputs(model, x_t, text, pooled, t) -> dict:
    """Packed tokens after the text [B, T, text layers = 1, D], with the positions of [text, image], text at 0."""
    ids = torch.cat([text.new_zeros(text.shape[1], 3), image_ids(*packed_grid(x_t)).to(text)])
    return dict(hidden_states=x_t, encoder_hidden_states=text[:, :, None], timestep=t, position_ids=ids)


def _krea2_model(channels: int, width: int, depth: int, text_dim: int, side: int):
    """Every block single-stream on [text, image]."""
    from diffusers import Krea2Transformer2DModel

    return Krea2Transformer2DModel(in_channels=channels * 4, num_layers=depth, attention_head_dim=64,
                                   num_attention_heads=width // 64, num_key_value_heads=width // 64,
                                   intermediate_size=4 * width, text_hidden_dim=text_dim, num_text_layers=1,
                                   text_num_attention_heads=1, text_num_key_value_heads=1,
                                   text_intermediate_size=2 * text_dim, num_layerwise_text_blocks=1,
                                   num_refiner_text_blocks=1, axes_dims_rope=(16, 24, 24))


IMAGE_FAMILIES = {
    "QwenImageTransformer2DModel": Family(("transformer_blocks",), 1, _qwen_narrow, _qwen_grid,
                                          ("controlnet_block_samples",), tail=_qwen_tail,
                                          name="Qwen-Image",
                                          example=Example("qwen", _qwen_model, packed_latents, _qwen_inputs),
                                          relies_on={"forward": ("hidden_states", "encoder_hidden_states",
                                                                 "img_shapes", "controlnet_block_samples"),
                                                     "transformer_blocks": ("hidden_states", "encoder_hidden_states",
                                                                            "image_rotary_emb",
                                                                            "modulate_index")}),
    "Krea2Transformer2DModel": Family(("transformer_blocks",), None, _joint_narrow, _krea2_grid, lead=_krea2_lead,
                                      name="Krea2",
                                      example=Example("krea2", _krea2_model, packed_latents, _krea2_inputs),
                                      relies_on={"forward": ("hidden_states", "encoder_hidden_states", "position_ids"),
                                                 "transformer_blocks": ("hidden_states", "temb", "image_rotary_emb",
                                                                        "attention_mask")}),
    "SD3Transformer2DModel": Family(("transformer_blocks",), 1, _no_narrow, latent_grid("patch_size", 2),
                                    ("block_controlnet_hidden_states", "skip_layers"),
                                    name="SD3",
                                    example=Example("sd3", _sd3_model, image_latents, _sd3_inputs),
                                    relies_on={"forward": ("hidden_states", "encoder_hidden_states",
                                                           "block_controlnet_hidden_states", "skip_layers"),
                                               "transformer_blocks": ("hidden_states", "encoder_hidden_states",
                                                                      "temb")}),
    "PixArtTransformer2DModel": Family(("transformer_blocks",), None, _pixart_narrow,
                                       latent_grid("patch_size", 2),
                                       name="PixArt",
                                       example=Example("pixart", _pixart_model, image_latents, latents_at_t1000),
                                       relies_on={"forward": ("hidden_states", "attention_mask",
                                                              "encoder_hidden_states"),
                                                  "transformer_blocks": ("hidden_states",
                                                                         "attention_mask")}),
    "AuraFlowTransformer2DModel": Family(("joint_transformer_blocks", "single_transformer_blocks"), 1,
                                         _no_narrow, latent_grid("patch_size", 2), lead=_auraflow_lead,
                                         tensor_lists=("single_transformer_blocks",),
                                         name="AuraFlow",
                                         example=Example("auraflow", _auraflow_model, image_latents, latents_at_t1000),
                                         relies_on={"forward": ("hidden_states", "encoder_hidden_states"),
                                                    "joint_transformer_blocks": ("hidden_states",
                                                                                 "encoder_hidden_states", "temb"),
                                                    "single_transformer_blocks": ("hidden_states", "temb")}),
    "ZImageTransformer2DModel": Family(("layers",), None, _zimage_narrow, _zimage_grid,
                                       ("controlnet_block_samples", "siglip_feats", "image_noise_mask"),
                                       tail=_zimage_tail, tokens="x",
                                       name="Z-Image",
                                       example=Example("zimage", _zimage_model, image_latents, _zimage_inputs),
                                       relies_on={"forward": ("x", "cap_feats", "patch_size", "f_patch_size",
                                                              "controlnet_block_samples", "siglip_feats",
                                                              "image_noise_mask"),
                                                  "layers": ("x", "attn_mask", "freqs_cis", "noise_mask")}),
    "Lumina2Transformer2DModel": Family(("layers",), None, _lumina2_narrow, latent_grid("patch_size", 2),
                                        lead=_lumina2_lead,
                                        name="Lumina2",
                                        example=Example("lumina2", _lumina2_model, image_latents, _lumina2_inputs),
                                        relies_on={"forward": ("hidden_states", "encoder_hidden_states",
                                                               "encoder_attention_mask"),
                                                   "layers": ("hidden_states", "attention_mask", "image_rotary_emb",
                                                              "temb")}),
}
FAMILIES.update(IMAGE_FAMILIES)
