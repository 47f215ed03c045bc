"""What TREAD needs to know about each diffusers transformer family (tread_diffusers/tread.py routes them).

For every family: the block lists in route order, where a block's output holds the image tokens, how a
block's other per-token inputs (RoPE tables, per-token timestep embeddings) are cut to the kept tokens, and the
token grid of the image (for masks). Every family selects its kept tokens per sample.

Text tokens are never routed: the routed tensor is the image (or video) part of a block's `hidden_states`;
text travels in `encoder_hidden_states`, or before the image in the single-stream blocks' `hidden_states`.

- PixArt (`transformer_blocks`): cross-attention to text, no RoPE.
- SD3 (`transformer_blocks`): joint attention; the text stream passes every block whole.
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
- Qwen-Image (`transformer_blocks`): dual-stream, the text in `encoder_hidden_states` (its mask is joined with
  the image inside the attention, so it fits any cut). `hidden_states` is the target image's tokens followed,
  in the edit models, by reference images' tokens (`img_shapes` per sample: the target's (frames, rows,
  columns), then the references'); only the target's are routed, the references pass every block whole. The
  image RoPE is complex, [N + R, head_dim / 2] without a batch dimension, and the text has its own table: a
  routed block gets each sample's kept target rows followed by every reference row (`SampleRope`). The edit
  model's per-token modulation index (`zero_cond_t`: target 0, reference 1) is gathered with the tokens.
- LTX-Video (`transformer_blocks`): video tokens only (packed latents); text by cross-attention, whose mask
  needs nothing. Its RoPE (cos, sin) [B, N, dim] comes per sample from num_frames / height / width or from
  video_coords, so each sample's kept rows are gathered; a per-token timestep (conditioning frames at t = 0)
  gives a per-token embedding [B, N, 6 * dim], gathered with the tokens.
- HunyuanVideo (`transformer_blocks`, then `single_transformer_blocks`, numbered as FLUX's): both kinds take the
  video in `hidden_states` and the text in `encoder_hidden_states` and return (video, text). The RoPE table
  [N, head_dim] covers the video only and has no batch dimension: each sample's kept rows (`SampleRope`). The
  attention mask [B, 1, 1, N + T] (video first, then the text with its padding) is cut with the tokens. The
  image-to-video `token_replace` variant is refused.
- AuraFlow (`joint_transformer_blocks`, then `single_transformer_blocks`, numbered as FLUX's): no RoPE (learned
  positions added at the input); per sample. Its single-stream blocks take [register tokens, text, image] as one
  `hidden_states`: only the image part (after the leading register and text tokens) is routed there.
- Wan (`blocks`): 3-D RoPE `(cos, sin)` [1, N, 1, head_dim] (frames x rows x columns, so a single frame
  is the F=1 case of the same table); it broadcasts over the batch, so the selection is per sample and each
  sample's kept rows are gathered to [B, K, 1, head_dim]. A per-token timestep embedding (Wan 2.2 TI2V,
  [B, N, 6, D]) is gathered with the tokens.
"""
from dataclasses import dataclass, field
from typing import Callable, Mapping, NamedTuple, Optional, Tuple

import torch

from tread_utils.errors import UserError


def _rows(keep: torch.Tensor) -> torch.Tensor:
    return torch.arange(keep.shape[0], device=keep.device)[:, None]


class SampleRope:
    """Each sample's own RoPE rows [B, S, head_dim], answering the indexing by which diffusers' apply_rotary_emb
    broadcasts a batch-shared [S, head_dim] table over [B, S, heads, head_dim] (or [B, heads, S, head_dim]), and
    the `unsqueeze(1)` by which Qwen-Image's broadcasts its complex [S, head_dim / 2] table over [B, S, heads, .]."""

    def __init__(self, table: torch.Tensor):
        self.table = table

    def unsqueeze(self, dim: int) -> torch.Tensor:
        if dim != 1:
            raise TypeError(f"a per-sample RoPE table of a routed block was unsqueezed at {dim}, which TREAD does "
                            f"not know how to serve; call handle.remove() and report the diffusers version")
        return self.table[:, :, None]

    def __getitem__(self, index):
        if index == (None, slice(None), None, slice(None)):  # sequence_dim=1: [B, S, 1, head_dim]
            return self.table[:, :, None]
        if index == (None, None, slice(None), slice(None)):  # sequence_dim=2: [B, 1, S, head_dim]
            return self.table[:, None]
        raise TypeError(f"a per-sample RoPE table of a routed block was indexed by {index!r}, which TREAD does "
                        f"not know how to serve; call handle.remove() and report the diffusers version")


class SampleLead(NamedTuple):
    """Text tokens before the image whose number varies per sample (Lumina2: each caption as long as its own, the
    image, then padding to the batch's longest): sample b's `tokens` image tokens follow its text[b].sum() text
    tokens in a block's sequence, and every other token (the text before them, the padding after) is never routed.
    The sum is taken where a block needs it: in the model's forward hook it would make a graph of its own under
    torch.compile (Lumina2's forward breaks the graph before its blocks)."""
    text: torch.Tensor  # [B, T] each sample's text mask
    tokens: int

    def offsets(self, device) -> torch.Tensor:
        return self.text.to(device).sum(1).long()


def splice(x: torch.Tensor, start: torch.Tensor, count: int, part: torch.Tensor) -> torch.Tensor:
    """Per sample b, x[b] [L, ...] with its `count` tokens from `start[b]` replaced by part[b] [P, ...] (P may differ
    from count): the tokens before and after them keep their order. One gather, so it traces without a break."""
    length, size = x.shape[1] - count + part.shape[1], part.shape[1]
    j = torch.arange(length, device=x.device)[None]
    rel = j - start.to(x.device)[:, None]
    index = torch.where(rel < 0, j, j + (count - size))  # before the part: as it was; after it: shifted
    index = torch.where((rel >= 0) & (rel < size), x.shape[1] + rel, index)  # the part, after x in the cat
    index = index.view(*index.shape, *[1] * (x.ndim - 2)).expand(-1, -1, *x.shape[2:])
    return torch.cat([x, part.to(x.dtype)], 1).gather(1, index)


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


def _pixart_narrow(kw: dict, keep: torch.Tensor) -> None:
    """PixArt's image attention mask, a bias [B, 1, N] by the time it reaches the blocks, at the kept tokens."""
    if kw.get("attention_mask") is not None:
        kw["attention_mask"] = gather_attention_mask(kw["attention_mask"], keep, "PixArt")


def _no_narrow(kw: dict, keep: torch.Tensor) -> None:
    return None


def latent_grid(patch_key: str, spatial: int) -> Callable:
    """Token grid of a [B, C, (F,) H, W] latent input split into patches of config[patch_key]."""
    def grid(transformer, kw: dict) -> Tuple[int, ...]:
        patch = transformer.config[patch_key]
        patch = tuple(patch) if isinstance(patch, (tuple, list)) else (patch,) * spatial
        shape = kw["hidden_states"].shape[-spatial:]
        return tuple(size // p for size, p in zip(shape, patch))
    return grid


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


def _no_lead(transformer, kw: dict) -> dict:
    return {}


def no_tail(transformer, kw: dict) -> int:
    return 0


def _auraflow_lead(transformer, kw: dict) -> dict:
    """AuraFlow's single-stream blocks get [register tokens, text, image] in one tensor."""
    return {"single_transformer_blocks": transformer.register_tokens.shape[1] + kw["encoder_hidden_states"].shape[1]}


def _text_lead(transformer, kw: dict) -> dict:
    """FLUX.2's and Chroma's single-stream blocks get [text, image] in one tensor."""
    return {"single_transformer_blocks": kw["encoder_hidden_states"].shape[1]}


@dataclass(frozen=True)
class Family:
    block_lists: Tuple[str, ...]   # the transformer's block lists, in route-index order
    out_index: Optional[int]       # where a block's output tuple holds the image tokens (None: it is them)
    narrow: Callable               # (block kwargs, keep [B, K]) -> None: other per-token inputs, cut in place
    grid: Callable                 # (transformer, forward kwargs) -> the image's token grid
    refused: Tuple[str, ...] = ()  # forward arguments that add per-block residuals of the full length
    lead: Callable = _no_lead      # (transformer, forward kwargs) -> {block list: text tokens before the image}
    tensor_lists: Tuple[str, ...] = ()  # block lists whose output is the tensor itself, whatever out_index says
    tail: Callable = no_tail      # (transformer, forward kwargs) -> conditioning tokens after the image
    tokens: str = "hidden_states"  # the block argument that holds the routed tokens
    sequence_first: bool = False   # the blocks' tokens (and output) are [S, B, D], not [B, S, D]
    tail_ids: Optional[str] = None  # the forward argument the tail is read from (compiled: checked as it runs)
    # What routing reads from the family's code, checked when apply_tread attaches: the transformer forward's
    # parameters (the grid, the text length, the refused inputs) and each block list's forward parameters (the
    # routed tokens and the per-token inputs `narrow` cuts). A diffusers version whose code differs is refused.
    relies_on: Mapping[str, Tuple[str, ...]] = field(default_factory=dict)  # "forward" or a block list -> names
    name: str = ""                 # the family as the docs name it (docs/diffusers.md lists every one)

    def image(self, output, kind: str):
        return output if self.out_index is None or kind in self.tensor_lists else output[self.out_index]

    def with_image(self, output, kind: str, image: torch.Tensor):
        if self.out_index is None or kind in self.tensor_lists:
            return image
        return tuple(image if i == self.out_index else part for i, part in enumerate(output))


FLUX_BLOCKS = ("transformer_blocks", "single_transformer_blocks")  # dual-stream, then single-stream
FLUX_CONTROLNET = ("controlnet_block_samples", "controlnet_single_block_samples")
_FLUX_BLOCK = ("hidden_states", "encoder_hidden_states", "temb", "image_rotary_emb", "joint_attention_kwargs")
FAMILIES = {
    "PixArtTransformer2DModel": Family(("transformer_blocks",), None, _pixart_narrow,
                                       latent_grid("patch_size", 2),
                                       name="PixArt",
                                       relies_on={"forward": ("hidden_states", "attention_mask",
                                                              "encoder_hidden_states"),
                                                  "transformer_blocks": ("hidden_states",
                                                                         "attention_mask")}),
    "SD3Transformer2DModel": Family(("transformer_blocks",), 1, _no_narrow, latent_grid("patch_size", 2),
                                    ("block_controlnet_hidden_states", "skip_layers"),
                                    name="SD3",
                                    relies_on={"forward": ("hidden_states", "encoder_hidden_states",
                                                           "block_controlnet_hidden_states", "skip_layers"),
                                               "transformer_blocks": ("hidden_states", "encoder_hidden_states",
                                                                      "temb")}),
    "FluxTransformer2DModel": Family(FLUX_BLOCKS, 1, _joint_narrow, _flux_grid, FLUX_CONTROLNET, tail=_flux_tail,
                                     tail_ids="img_ids",
                                     name="FLUX",
                                     relies_on={"forward": ("hidden_states", "encoder_hidden_states", "img_ids",
                                                            "controlnet_block_samples",
                                                            "controlnet_single_block_samples"),
                                                "transformer_blocks": _FLUX_BLOCK,
                                                "single_transformer_blocks": _FLUX_BLOCK}),
    "Flux2Transformer2DModel": Family(FLUX_BLOCKS, 1, _joint_narrow, _flux_grid, ("kv_cache", "kv_cache_mode"),
                                      lead=_text_lead, tensor_lists=("single_transformer_blocks",),
                                      name="FLUX.2",
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
                                       relies_on={"forward": ("hidden_states", "encoder_hidden_states", "img_ids",
                                                              "attention_mask", "controlnet_block_samples",
                                                              "controlnet_single_block_samples"),
                                                  "transformer_blocks": ("hidden_states", "encoder_hidden_states",
                                                                         "image_rotary_emb", "attention_mask"),
                                                  "single_transformer_blocks": ("hidden_states", "image_rotary_emb",
                                                                                "attention_mask")}),
    "QwenImageTransformer2DModel": Family(("transformer_blocks",), 1, _qwen_narrow, _qwen_grid,
                                          ("controlnet_block_samples",), tail=_qwen_tail,
                                          name="Qwen-Image",
                                          relies_on={"forward": ("hidden_states", "encoder_hidden_states",
                                                                 "img_shapes", "controlnet_block_samples"),
                                                     "transformer_blocks": ("hidden_states", "encoder_hidden_states",
                                                                            "image_rotary_emb",
                                                                            "modulate_index")}),
    "LTXVideoTransformer3DModel": Family(("transformer_blocks",), None, _ltx_narrow, _ltx_grid,
                                         name="LTX-Video",
                                         relies_on={"forward": ("hidden_states", "num_frames", "height", "width",
                                                                "video_coords"),
                                                    "transformer_blocks": ("hidden_states", "temb",
                                                                           "image_rotary_emb")}),
    "HunyuanVideoTransformer3DModel": Family(FLUX_BLOCKS, 0, _hunyuan_narrow, _hunyuan_grid,
                                             name="HunyuanVideo",
                                             relies_on={"forward": ("hidden_states", "encoder_hidden_states"),
                                                        "transformer_blocks": ("hidden_states",
                                                                               "encoder_hidden_states",
                                                                               "attention_mask", "freqs_cis"),
                                                        "single_transformer_blocks": ("hidden_states",
                                                                                      "encoder_hidden_states",
                                                                                      "attention_mask",
                                                                                      "image_rotary_emb")}),
    "WanTransformer3DModel": Family(("blocks",), None, _wan_narrow, latent_grid("patch_size", 3),
                                    name="Wan",
                                    relies_on={"forward": ("hidden_states", "encoder_hidden_states", "timestep"),
                                               "blocks": ("hidden_states", "encoder_hidden_states", "temb",
                                                          "rotary_emb")}),
    "AuraFlowTransformer2DModel": Family(("joint_transformer_blocks", "single_transformer_blocks"), 1,
                                         _no_narrow, latent_grid("patch_size", 2), lead=_auraflow_lead,
                                         tensor_lists=("single_transformer_blocks",),
                                         name="AuraFlow",
                                         relies_on={"forward": ("hidden_states", "encoder_hidden_states"),
                                                    "joint_transformer_blocks": ("hidden_states",
                                                                                 "encoder_hidden_states", "temb"),
                                                    "single_transformer_blocks": ("hidden_states", "temb")}),
}


def family_of(transformer) -> Family:
    """The family of a diffusers transformer; an unsupported class is refused in one line."""
    for cls in type(transformer).__mro__:  # by class name: a family registered from outside diffusers works too
        if cls.__name__ in FAMILIES:
            return FAMILIES[cls.__name__]
    raise UserError(f"apply_tread does not support {type(transformer).__name__}; supported diffusers "
                    f"transformers: {', '.join(FAMILIES)}")


def family_blocks(transformer) -> list:
    """The transformer's blocks in route-index order: its family's block lists, one after the other."""
    return [block for name in family_of(transformer).block_lists for block in getattr(transformer, name)]
