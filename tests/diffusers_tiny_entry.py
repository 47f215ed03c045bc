"""What the family checks need of a diffusers family beyond its `Family` (tread_diffusers/families.py): one `Tiny`
entry, registered in `TINY` by the fixture file of its kind (tests/diffusers_tiny_image.py, _video.py,
_sequence.py) or by a test file of its own; tests/diffusers_tiny.py builds the entries and runs the routed forward
by hand from them (docs/extensions.md, "A diffusers family")."""
from dataclasses import dataclass
from typing import Callable, Optional, Tuple

import torch

from lab.diffusers_tiny_models import B  # noqa: F401  (the batch of every tiny model's inputs, for the callers)


def per_sample(keep: torch.Tensor, row: Callable) -> torch.Tensor:
    """row(b) for every sample b of `keep`, stacked: the hand-written gathers go sample by sample."""
    return torch.stack([row(b) for b in range(keep.shape[0])])


def nothing_to_cut(kw: dict, keep: torch.Tensor, lead: int, tail: int) -> None:
    """A family whose blocks take no other per-token input (no RoPE, no per-token modulation or mask)."""


@dataclass(frozen=True)
class Tiny:
    family: str                   # the transformer's class: its key in tread_diffusers.families.FAMILIES
    build: Callable[..., tuple]   # (**variant) -> (model, inputs, token grid): a tiny random model and its inputs
    # (block kwargs, keep [B, K], text tokens before the image, tokens after it) -> None: a routed block's other
    # per-token inputs (RoPE rows, per-token modulation, masks) cut sample by sample, in place; the hooks' Family.narrow
    # must give the same
    by_hand: Callable = nothing_to_cut
    # (table a routed block's attention gets, the unrouted table, keep, text tokens) -> whether each kept token has
    # its own rotary rows; None: the RoPE check of tests/test_diffusers_tread.py does not apply
    angles: Optional[Callable] = None
    rope_attention: Tuple[Optional[str], str] = (None, "image_rotary_emb")  # (a block's attention, its RoPE keyword)
    other_stream: str = "encoder_hidden_states"  # what a block updates and returns beside the image
    channels_last: bool = False   # latents [B, *grid, C]
    lora_targets: Tuple[str, ...] = ("to_q", "to_k", "to_v")
    # the test file that runs the shared checks on it, where its layout needs a reference of its own ("": the
    # shared checks of tests/test_diffusers_tread.py run on it as they are)
    checked_by: str = ""


TINY = {}  # name -> Tiny; several names may share a family (variants: Qwen-Image-Edit, LTX-2's split RoPE)


class HandRope:
    """A per-sample table [B, S, head_dim] seen by diffusers' `cos[None, :, None, :]` as [B, S, 1, head_dim]."""

    def __init__(self, table):
        self.table = table

    def __getitem__(self, index):
        assert index == (None, slice(None), None, slice(None)), index
        return self.table.unsqueeze(2)

    def unsqueeze(self, dim):  # Qwen-Image's complex table, [B, S, head_dim / 2] as [B, S, 1, head_dim / 2]
        assert dim == 1
        return self.table.unsqueeze(2)
