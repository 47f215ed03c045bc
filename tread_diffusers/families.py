"""What TREAD needs to know about each diffusers transformer family (tread_diffusers/tread.py routes them): a
`Family` per transformer class in `FAMILIES`, registered by the family files, which describe their families
(flux_families.py, image_families.py, video_families.py, sequence_families.py; tread.py imports every one).

For every family: the block lists in route order, where a block's output holds the image tokens, how a
block's other per-token inputs (RoPE tables, per-token timestep embeddings) are cut to the kept tokens, and the
token grid of the image (for masks). Every family selects its kept tokens per sample.

Text tokens are never routed: the routed tensor is the image (or video) part of a block's `hidden_states`;
text travels in `encoder_hidden_states`, or before the image in the single-stream blocks' `hidden_states`.
"""
import difflib
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
        # The broadcasting views, made once: a routed forward shares one table between its blocks and their
        # recomputations, and each attention indexes it twice (query, key); a view made per index was the
        # largest part of TREAD's host time in an eager FLUX step (docs/perf/flux_host_profile_cpu*.md).
        self.table, self._tokens_first, self._heads_first = table, table[:, :, None], table[:, None]

    def unsqueeze(self, dim: int) -> torch.Tensor:
        if dim != 1:
            raise TypeError(f"a per-sample RoPE table of a routed block was unsqueezed at {dim}, which TREAD does "
                            f"not know how to serve; call handle.remove() and report the diffusers version")
        return self._tokens_first

    def __getitem__(self, index):
        if index == (None, slice(None), None, slice(None)):  # sequence_dim=1: [B, S, 1, head_dim]
            return self._tokens_first
        if index == (None, None, slice(None), slice(None)):  # sequence_dim=2: [B, 1, S, head_dim]
            return self._heads_first
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


def _no_lead(transformer, kw: dict) -> dict:
    return {}


def no_tail(transformer, kw: dict) -> int:
    return 0


class Example(NamedTuple):
    """A family's transformer at a bench's size, trained on random latents (lab/bench_diffusers.py) or on a
    pretrained model's (tools/diffusers_toy.py builds the forward's keywords from `inputs`)."""
    arch: str          # its name on the bench's command line (--archs)
    model: Callable    # (channels, width, depth, text_dim, tokens_side) -> a random model: `depth` routed blocks of
    #                    `width`, head_dim 64, over frames (video) of tokens_side x tokens_side tokens
    latents: Callable  # (batch, channels, tokens_side, frames) -> random latents, in the layout the model takes
    inputs: Callable   # (model, noisy latents, text [B, T, D], pooled [B, D], t [B] in [0, 1]) -> the forward's
    #                    keywords, as the family's pipeline builds them
    video: bool = False  # the latents hold `frames` frames


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
    example: Optional[Example] = None  # a random model and its inputs, for the bench and tools/diffusers_toy.py

    def image(self, output, kind: str):
        return output if self.out_index is None or kind in self.tensor_lists else output[self.out_index]

    def with_image(self, output, kind: str, image: torch.Tensor):
        if self.out_index is None or kind in self.tensor_lists:
            return image
        return tuple(image if i == self.out_index else part for i, part in enumerate(output))


FAMILIES = {}  # transformer class name -> Family; the family files register theirs


def family_of(transformer) -> Family:
    """The family of a diffusers transformer; an unsupported class is refused in one line."""
    for cls in type(transformer).__mro__:  # by class name: a family registered from outside diffusers works too
        if cls.__name__ in FAMILIES:
            return FAMILIES[cls.__name__]
    name = type(transformer).__name__
    close = difflib.get_close_matches(name, FAMILIES, n=1, cutoff=0.5)
    raise UserError(f"apply_tread does not support {name}" + (f" (the closest it routes: {close[0]})" if close else "")
                    + f"; it routes {len(FAMILIES)} diffusers transformer classes (docs/diffusers.md lists them) and "
                      f"a class you register in tread_diffusers.families.FAMILIES")


def family_blocks(transformer) -> list:
    """The transformer's blocks in route-index order: its family's block lists, one after the other."""
    return [block for name in family_of(transformer).block_lists for block in getattr(transformer, name)]
