"""More diffusers transformer families for TREAD, registered into tread_diffusers/families.py's tables
(FAMILIES), whose docstring says what a Family holds and describes the families before these.

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
from typing import Tuple

import torch

from tread_diffusers.families import (FAMILIES, Family, SampleRope, latent_grid, _ltx_grid, _rows,
                                      gather_attention_mask)


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


VIDEO_FAMILIES = {
    "CosmosTransformer3DModel": Family(("transformer_blocks",), None, _cosmos_narrow, latent_grid("patch_size", 3),
                                       ("block_controlnet_hidden_states",),
                                       name="Cosmos",
                                       relies_on={"forward": ("hidden_states", "timestep", "encoder_hidden_states",
                                                              "block_controlnet_hidden_states"),
                                                  "transformer_blocks": ("hidden_states", "embedded_timestep", "temb",
                                                                         "image_rotary_emb", "extra_pos_emb")}),
    "Kandinsky5Transformer3DModel": Family(("visual_transformer_blocks",), None, _kandinsky_narrow, _kandinsky_grid,
                                           ("sparse_params",), tokens="visual_embed",
                                           name="Kandinsky 5",
                                           relies_on={"forward": ("hidden_states", "encoder_hidden_states",
                                                                  "sparse_params"),
                                                      "visual_transformer_blocks": ("visual_embed", "text_embed",
                                                                                    "time_embed", "rope",
                                                                                    "sparse_params")}),
    "LTX2VideoTransformer3DModel": Family(("transformer_blocks",), 0, _ltx2_narrow, _ltx_grid,
                                          name="LTX-2",
                                          relies_on={"forward": ("hidden_states", "audio_hidden_states", "num_frames",
                                                                 "height", "width", "video_coords"),
                                                     "transformer_blocks": ("hidden_states", "audio_hidden_states",
                                                                            "temb", "temb_ca_scale_shift",
                                                                            "temb_ca_gate", "video_rotary_emb",
                                                                            "ca_video_rotary_emb",
                                                                            "self_attention_mask")}),
}
FAMILIES.update(VIDEO_FAMILIES)

