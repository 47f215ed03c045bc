"""Diffusers video families for TREAD, registered into tread_diffusers/families.py's FAMILIES (whose docstring says
what a Family holds); the hooks in tread_diffusers/tread.py read them from there.

- Wan (`blocks`): 3-D RoPE `(cos, sin)` [1, N, 1, head_dim] (frames x rows x columns, so a single frame
  is the F=1 case of the same table); it broadcasts over the batch, so the selection is per sample and each
  sample's kept rows are gathered to [B, K, 1, head_dim]. A per-token timestep embedding (Wan 2.2 TI2V,
  [B, N, 6, D]) is gathered with the tokens.
- LTX-Video (`transformer_blocks`): video tokens only (packed latents); text by cross-attention, whose mask
  needs nothing. Its RoPE (cos, sin) [B, N, dim] comes per sample from num_frames / height / width or from
  video_coords, so each sample's kept rows are gathered; a per-token timestep (conditioning frames at t = 0)
  gives a per-token embedding [B, N, 6 * dim], gathered with the tokens.
- HunyuanVideo (`transformer_blocks`, then `single_transformer_blocks`, numbered as FLUX's): both kinds take the
  video in `hidden_states` and the text in `encoder_hidden_states` and return (video, text). The RoPE table
  [N, head_dim] covers the video only and has no batch dimension: each sample's kept rows (`SampleRope`). The
  attention mask [B, 1, 1, N + T] (video first, then the text with its padding) is cut with the tokens. The
  image-to-video `token_replace` variant is refused.
- Cosmos (`transformer_blocks`): video tokens only, [B, F * H * W, D] after the (t, h, w) patches; the text
  (and, in Cosmos 2.5, an image context) by cross-attention, whose text mask [B, 1, 1, T] needs nothing. Its
  RoPE (cos, sin) [N, head_dim] has no batch dimension: each sample's kept rows (`SampleRope`). The learnable
  positions `extra_pos_emb` [B, N, D] are added in every block, so each sample's kept rows are gathered; so is
  the per-frame timestep's modulation (`timestep` [B, 1, F, 1, 1] gives `embedded_timestep` and `temb`
  [B, N, D]; [B, D] is shared by the tokens). ControlNet residuals (per token, full length) are refused.
- Kandinsky 5, image and video (`visual_transformer_blocks`; its `text_transformer_blocks` refine the text alone
  before them and are not numbered): the blocks' routed argument is `visual_embed`, the latent tokens
  [B, F * H * W, D] of the channels-last input [B, F, H, W, C]; the text (`text_embed`) by cross-attention,
  without a mask. Its RoPE `rope` [B, N, 1, head_dim / 2, 2, 2] (rotation matrices) is per sample: each sample's
  kept rows. The modulation `time_embed` [B, D] is shared by the tokens. The sparse (NABLA) attention, whose
  block mask and fractal token order cover the whole grid, is refused.
- LTX-2 (`transformer_blocks`): each block runs the video (`hidden_states`) and the audio (`audio_hidden_states`)
  side by side and returns (video, audio). Only the video is routed; the audio is conditioning and passes every
  block whole (its video-to-audio attention reads the kept video tokens); the text by cross-attention, whose
  mask needs nothing. The video RoPE, for self-attention (`video_rotary_emb`) and for the audio-video attention
  (`ca_video_rotary_emb`), is per sample, (cos, sin) [B, N, dim] (interleaved) or [B, heads, N, head_dim / 2]
  (split): each sample's kept rows. A per-token timestep ([B, N]) makes the video modulations (`temb`,
  `temb_ca_scale_shift`, `temb_ca_gate`) [B, N, k * D]: gathered with the tokens ([B, 1, .] is shared). The
  video self-attention mask [B, N, N] (IC-LoRA) is cut on both axes.
"""
from typing import Callable, Tuple

import torch

from tread_diffusers.families import FAMILIES, Example, Family, SampleRope, _rows, gather_attention_mask, latent_grid
from tread_diffusers.flux_families import FLUX_BLOCKS
from tread_diffusers.image_families import latents_at_t1000
from tread_utils.errors import UserError


def _wan_narrow(kw: dict, keep: torch.Tensor) -> None:
    """Each sample's kept RoPE rows [B, K, 1, head_dim]; a per-token timestep embedding likewise."""
    rope = kw.get("rotary_emb")
    if rope is not None:
        kw["rotary_emb"] = tuple(table[0][keep.to(table.device)] for table in rope)
    if kw["temb"].ndim == 4:
        kw["temb"] = kw["temb"][_rows(keep), keep]


def _ltx_narrow(kw: dict, keep: torch.Tensor) -> None:
    """LTX-Video's RoPE (cos, sin) [B, N, dim] is per sample already: each sample's kept rows; a per-token
    timestep embedding [B, N, 6 * dim] likewise ([B, 1, 6 * dim] is shared by the tokens)."""
    rope = kw.get("image_rotary_emb")
    if rope is not None:
        kw["image_rotary_emb"] = tuple(table[_rows(keep), keep.to(table.device)] for table in rope)
    if kw["temb"].shape[1] > 1:
        kw["temb"] = kw["temb"][_rows(keep), keep]


def _hunyuan_narrow(kw: dict, keep: torch.Tensor) -> None:
    """HunyuanVideo: the video's RoPE (cos, sin) [N, head_dim] (the text has none; `freqs_cis` in the dual-stream
    blocks, `image_rotary_emb` in the single-stream ones) as each sample's kept rows, and the attention mask
    [B, 1, 1, N + T], video first, cut the same way."""
    if kw.get("token_replace_emb") is not None:
        raise UserError("TREAD cannot route HunyuanVideo with image_condition_type='token_replace' (its first-frame "
                        "tokens are modulated by position); use a model without it, or call handle.remove()")
    for key in ("freqs_cis", "image_rotary_emb"):
        if kw.get(key) is not None:
            kw[key] = tuple(SampleRope(table[keep.to(table.device)]) for table in kw[key])
    mask = kw.get("attention_mask")
    if mask is not None:
        video = mask.shape[-1] - kw["encoder_hidden_states"].shape[1]
        text = torch.arange(video, mask.shape[-1], device=keep.device).expand(keep.shape[0], -1)
        kw["attention_mask"] = gather_attention_mask(mask, torch.cat([keep, text], 1), "HunyuanVideo")


def _hunyuan_grid(transformer, kw: dict) -> Tuple[int, ...]:
    """Frames x rows x columns of HunyuanVideo's [B, C, F, H, W] latents after its (t, h, w) patches."""
    patch, patch_t = transformer.config.patch_size, transformer.config.patch_size_t
    frames, rows, columns = kw["hidden_states"].shape[2:]
    return (frames // patch_t, rows // patch, columns // patch)


def _ltx_grid(transformer, kw: dict) -> Tuple[int, ...]:
    """Frames x rows x columns of LTX-Video's packed latents, from the forward's num_frames, height and width."""
    if kw.get("video_coords") is not None or kw.get("num_frames") is None:
        return (kw["hidden_states"].shape[1],)  # positions given per token: masks over tokens only
    patch, patch_t = transformer.config.patch_size, transformer.config.patch_size_t
    return (kw["num_frames"] // patch_t, kw["height"] // patch, kw["width"] // patch)


def _cosmos_narrow(kw: dict, keep: torch.Tensor) -> None:
    """Cosmos: each sample's kept RoPE rows, learnable positions and per-token modulation."""
    rope = kw.get("image_rotary_emb")
    if rope is not None:
        kw["image_rotary_emb"] = tuple(SampleRope(table[keep.to(table.device)]) for table in rope)
    for key in ("extra_pos_emb", "embedded_timestep", "temb"):
        if kw.get(key) is not None and kw[key].ndim == 3:
            kw[key] = kw[key][_rows(keep), keep]


def _kandinsky_narrow(kw: dict, keep: torch.Tensor) -> None:
    """Kandinsky 5: each sample's kept rows of its RoPE rotation matrices [B, N, 1, head_dim / 2, 2, 2]."""
    kw["rope"] = kw["rope"][_rows(keep), keep.to(kw["rope"].device)]


def _kandinsky_grid(transformer, kw: dict) -> Tuple[int, ...]:
    """Frames x rows x columns of Kandinsky 5's channels-last latents [B, F, H, W, C] after its patches."""
    shape = kw["hidden_states"].shape[1:4]
    return tuple(size // p for size, p in zip(shape, transformer.config.patch_size))


def _token_rows(table: torch.Tensor, keep: torch.Tensor, dim: int) -> torch.Tensor:
    """Each sample's kept rows [B, ..., K, ...] of a per-sample table whose token axis is `dim`."""
    index = keep.to(table.device).view(keep.shape[0], *[1] * (dim - 1), -1, *[1] * (table.ndim - dim - 1))
    return table.gather(dim, index.expand(*table.shape[:dim], -1, *table.shape[dim + 1:]))


def _ltx2_narrow(kw: dict, keep: torch.Tensor) -> None:
    """LTX-2: each sample's kept rows of the video RoPE tables, per-token modulations and self-attention mask."""
    for key in ("video_rotary_emb", "ca_video_rotary_emb"):
        if kw.get(key) is not None:
            kw[key] = tuple(_token_rows(table, keep, 1 if table.ndim == 3 else 2) for table in kw[key])
    for key in ("temb", "temb_ca_scale_shift", "temb_ca_gate"):
        if kw.get(key) is not None and kw[key].shape[1] > 1:
            kw[key] = kw[key][_rows(keep), keep]
    if kw.get("self_attention_mask") is not None:
        kw["self_attention_mask"] = gather_attention_mask(kw["self_attention_mask"], keep, "LTX-2")


def video_latents(patch: int) -> Callable:
    """Latents [B, C, F, H, W] of frames of side x side tokens in patch x patch patches."""
    return lambda batch, channels, side, frames: torch.randn(batch, channels, frames, patch * side, patch * side)


def _kandinsky_latents(batch: int, channels: int, side: int, frames: int) -> torch.Tensor:
    """Channels-last latents [B, F, H, W, C] in 2 x 2 patches."""
    return torch.randn(batch, frames, 2 * side, 2 * side, channels)


def _video_tokens(x_t: torch.Tensor) -> dict:
    """LTX-Video, LTX-2: video latents [B, C, F, H, W] as tokens (patch 1) and the grid they came from."""
    frames, rows, columns = x_t.shape[2:]
    return dict(hidden_states=x_t.flatten(2).transpose(1, 2), num_frames=frames, height=rows, width=columns)


def _ltx_inputs(model, x_t, text, pooled, t) -> dict:
    return dict(_video_tokens(x_t), encoder_hidden_states=text, timestep=t * 1000,
                encoder_attention_mask=text.new_ones(text.shape[:2]))


def _ltx2_inputs(model, x_t, text, pooled, t) -> dict:
    """The video tokens beside 16 random audio tokens, t * 1000."""
    audio = torch.randn(len(t), 16, model.config.audio_in_channels, device=x_t.device)
    return dict(_video_tokens(x_t), audio_hidden_states=audio, encoder_hidden_states=text,
                audio_encoder_hidden_states=text, timestep=t * 1000, sigma=t, audio_num_frames=audio.shape[1])


def _hunyuan_inputs(model, x_t, text, pooled, t) -> dict:
    return dict(hidden_states=x_t, encoder_hidden_states=text, pooled_projections=pooled, timestep=t * 1000,
                encoder_attention_mask=text.new_ones(text.shape[:2]))


def _cosmos_inputs(model, x_t, text, pooled, t) -> dict:
    return dict(hidden_states=x_t, encoder_hidden_states=text, timestep=t)


def _kandinsky_inputs(model, x_t, text, pooled, t) -> dict:
    """Channels-last latents as they are, with the RoPE positions of their grid and of the text, t * 1000."""
    frames, rows, columns = (size // p for size, p in zip(x_t.shape[1:4], model.config.patch_size))
    return dict(hidden_states=x_t, encoder_hidden_states=text, timestep=t * 1000, pooled_projections=pooled,
                visual_rope_pos=tuple(torch.arange(n, device=x_t.device) for n in (frames, rows, columns)),
                text_rope_pos=torch.arange(text.shape[1], device=x_t.device))


def _wan_model(channels: int, width: int, depth: int, text_dim: int, side: int):
    from diffusers import WanTransformer3DModel

    return WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=width // 64, attention_head_dim=64,
                                 in_channels=channels, out_channels=channels, text_dim=text_dim, ffn_dim=4 * width,
                                 num_layers=depth)


def _ltx_model(channels: int, width: int, depth: int, text_dim: int, side: int):
    from diffusers import LTXVideoTransformer3DModel

    return LTXVideoTransformer3DModel(in_channels=channels, out_channels=channels, num_attention_heads=width // 64,
                                      attention_head_dim=64, cross_attention_dim=width, num_layers=depth,
                                      caption_channels=text_dim)


def _hunyuan_model(channels: int, width: int, depth: int, text_dim: int, side: int):
    """A quarter of the blocks dual-stream."""
    from diffusers import HunyuanVideoTransformer3DModel

    return HunyuanVideoTransformer3DModel(in_channels=channels, out_channels=channels, num_attention_heads=width // 64,
                                          attention_head_dim=64, num_layers=depth // 4,
                                          num_single_layers=depth - depth // 4, num_refiner_layers=1,
                                          guidance_embeds=False, text_embed_dim=text_dim,
                                          pooled_projection_dim=text_dim, rope_axes_dim=(16, 24, 24))


def _cosmos_model(channels: int, width: int, depth: int, text_dim: int, side: int):
    from diffusers import CosmosTransformer3DModel

    return CosmosTransformer3DModel(in_channels=channels, out_channels=channels, num_attention_heads=width // 64,
                                    attention_head_dim=64, num_layers=depth, text_embed_dim=text_dim,
                                    adaln_lora_dim=width, max_size=(16, 128, 128), concat_padding_mask=False)


def _kandinsky_model(channels: int, width: int, depth: int, text_dim: int, side: int):
    """One text block before the video blocks."""
    from diffusers import Kandinsky5Transformer3DModel

    return Kandinsky5Transformer3DModel(in_visual_dim=channels, in_text_dim=text_dim, in_text_dim2=text_dim,
                                        time_dim=width, out_visual_dim=channels, model_dim=width, ff_dim=4 * width,
                                        num_text_blocks=1, num_visual_blocks=depth, axes_dims=(16, 24, 24))


def _ltx2_model(channels: int, width: int, depth: int, text_dim: int, side: int):
    """An audio stream of width 64 beside the video."""
    from diffusers import LTX2VideoTransformer3DModel

    return LTX2VideoTransformer3DModel(in_channels=channels, out_channels=channels, num_attention_heads=width // 64,
                                       attention_head_dim=64, cross_attention_dim=width, audio_in_channels=channels,
                                       audio_out_channels=channels, audio_num_attention_heads=1,
                                       audio_attention_head_dim=64, audio_cross_attention_dim=64, num_layers=depth,
                                       caption_channels=text_dim)


VIDEO_FAMILIES = {
    "WanTransformer3DModel": Family(("blocks",), None, _wan_narrow, latent_grid("patch_size", 3),
                                    name="Wan",
                                    example=Example("wan", _wan_model, video_latents(2), latents_at_t1000, video=True),
                                    relies_on={"forward": ("hidden_states", "encoder_hidden_states", "timestep"),
                                               "blocks": ("hidden_states", "encoder_hidden_states", "temb",
                                                          "rotary_emb")}),
    "LTXVideoTransformer3DModel": Family(("transformer_blocks",), None, _ltx_narrow, _ltx_grid,
                                         name="LTX-Video",
                                         example=Example("ltx", _ltx_model, video_latents(1), _ltx_inputs, video=True),
                                         relies_on={"forward": ("hidden_states", "num_frames", "height", "width",
                                                                "video_coords"),
                                                    "transformer_blocks": ("hidden_states", "temb",
                                                                           "image_rotary_emb")}),
    "HunyuanVideoTransformer3DModel": Family(FLUX_BLOCKS, 0, _hunyuan_narrow, _hunyuan_grid,
                                             name="HunyuanVideo",
                                             example=Example("hunyuan", _hunyuan_model, video_latents(2),
                                                             _hunyuan_inputs, video=True),
                                             relies_on={"forward": ("hidden_states", "encoder_hidden_states"),
                                                        "transformer_blocks": ("hidden_states",
                                                                               "encoder_hidden_states",
                                                                               "attention_mask", "freqs_cis"),
                                                        "single_transformer_blocks": ("hidden_states",
                                                                                      "encoder_hidden_states",
                                                                                      "attention_mask",
                                                                                      "image_rotary_emb")}),
    "CosmosTransformer3DModel": Family(("transformer_blocks",), None, _cosmos_narrow, latent_grid("patch_size", 3),
                                       ("block_controlnet_hidden_states",),
                                       name="Cosmos",
                                       example=Example("cosmos", _cosmos_model, video_latents(2), _cosmos_inputs,
                                                       video=True),
                                       relies_on={"forward": ("hidden_states", "timestep", "encoder_hidden_states",
                                                              "block_controlnet_hidden_states"),
                                                  "transformer_blocks": ("hidden_states", "embedded_timestep", "temb",
                                                                         "image_rotary_emb", "extra_pos_emb")}),
    "Kandinsky5Transformer3DModel": Family(("visual_transformer_blocks",), None, _kandinsky_narrow, _kandinsky_grid,
                                           ("sparse_params",), tokens="visual_embed",
                                           name="Kandinsky 5",
                                           example=Example("kandinsky", _kandinsky_model, _kandinsky_latents,
                                                           _kandinsky_inputs, video=True),
                                           relies_on={"forward": ("hidden_states", "encoder_hidden_states",
                                                                  "sparse_params"),
                                                      "visual_transformer_blocks": ("visual_embed", "text_embed",
                                                                                    "time_embed", "rope",
                                                                                    "sparse_params")}),
    "LTX2VideoTransformer3DModel": Family(("transformer_blocks",), 0, _ltx2_narrow, _ltx_grid,
                                          name="LTX-2",
                                          example=Example("ltx2", _ltx2_model, video_latents(1), _ltx2_inputs,
                                                          video=True),
                                          relies_on={"forward": ("hidden_states", "audio_hidden_states", "num_frames",
                                                                 "height", "width", "video_coords"),
                                                     "transformer_blocks": ("hidden_states", "audio_hidden_states",
                                                                            "temb", "temb_ca_scale_shift",
                                                                            "temb_ca_gate", "video_rotary_emb",
                                                                            "ca_video_rotary_emb",
                                                                            "self_attention_mask")}),
}
FAMILIES.update(VIDEO_FAMILIES)

