"""More diffusers image families for TREAD, registered into the table of tread_diffusers/families.py (whose
docstring says what a family entry holds); the hooks in tread_diffusers/tread.py read them from there.

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
import torch

from tread_diffusers.families import (FAMILIES, Family, SampleLead, _joint_narrow, latent_grid,
                                      gather_attention_mask, splice)
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


IMAGE_FAMILIES = {
    "ZImageTransformer2DModel": Family(("layers",), None, _zimage_narrow, _zimage_grid,
                                       ("controlnet_block_samples", "siglip_feats", "image_noise_mask"),
                                       tail=_zimage_tail, tokens="x",
                                       name="Z-Image",
                                       relies_on={"forward": ("x", "cap_feats", "patch_size", "f_patch_size",
                                                              "controlnet_block_samples", "siglip_feats",
                                                              "image_noise_mask"),
                                                  "layers": ("x", "attn_mask", "freqs_cis", "noise_mask")}),
    "Krea2Transformer2DModel": Family(("transformer_blocks",), None, _joint_narrow, _krea2_grid, lead=_krea2_lead,
                                      name="Krea2",
                                      relies_on={"forward": ("hidden_states", "encoder_hidden_states", "position_ids"),
                                                 "transformer_blocks": ("hidden_states", "temb", "image_rotary_emb",
                                                                        "attention_mask")}),
    "Lumina2Transformer2DModel": Family(("layers",), None, _lumina2_narrow, latent_grid("patch_size", 2),
                                        lead=_lumina2_lead,
                                        name="Lumina2",
                                        relies_on={"forward": ("hidden_states", "encoder_hidden_states",
                                                               "encoder_attention_mask"),
                                                   "layers": ("hidden_states", "attention_mask", "image_rotary_emb",
                                                              "temb")}),
}
FAMILIES.update(IMAGE_FAMILIES)
