"""Tiny random diffusers transformers of the routed families, with inputs, and the routed forward built by hand
that the hooks are compared with. `build(name)` makes one from its `TINY` entry (tests/diffusers_tiny_entry.py says
what an entry holds; tests/diffusers_tiny_image.py, _video.py and _sequence.py register them); what the reference
needs of the family's layout (its block lists, routed argument, output order, leading text) is read from its
`Family` (tread_diffusers/families.py)."""
import inspect

import torch

import diffusers_tiny_image  # noqa: F401  (importing registers the entries)
import diffusers_tiny_sequence  # noqa: F401
import diffusers_tiny_video  # noqa: F401
from diffusers_tiny_entry import TINY, B  # noqa: F401  (B: the batch of every model's inputs, for the callers)
from tread_diffusers.families import family_blocks, family_of
from tread_diffusers.tread import apply_tread  # noqa: F401  (importing registers every family)


def build(name, seed=0, **kw):
    torch.manual_seed(seed)
    return TINY[name].build(**kw)


def shared_checks() -> list:
    """The entries tests/test_diffusers_tread.py's checks run on as they are."""
    return [name for name, tiny in TINY.items() if not tiny.checked_by]


def one_per_family(names) -> list:
    """The first of `names` of each family (variants such as Qwen-Image-Edit left out)."""
    first = {}
    for name in names:
        first.setdefault(TINY[name].family, name)
    return list(first.values())


def blocks_of(model):
    return family_blocks(model)


def token_key(inputs: dict) -> str:
    """The forward argument that holds the latents (Z-Image's is `x`)."""
    return "x" if "x" in inputs else "hidden_states"


def packed(inputs: dict) -> bool:
    """Latents given as tokens [B, N, C] (FLUX packs 2 x 2), not as a latent image."""
    return inputs[token_key(inputs)].ndim == 3


def bound(module, args, kwargs) -> dict:
    return dict(inspect.signature(module.forward).bind(*args, **kwargs).arguments)


def capture_inputs(module):
    """A hook that keeps the (bound) keyword inputs of `module`'s latest call."""
    seen = {}
    handle = module.register_forward_pre_hook(lambda m, a, k: seen.update(bound(m, a, k)), with_kwargs=True)
    return seen, handle


def reference_forward(name, model, inputs, keep, start, end, n):
    """Run the blocks from `start` by hand: gather the kept image tokens (of `n`) and their per-token inputs
    before `start`, scatter them back after `end`; returns the last block's output tokens (text first where the
    single-stream blocks carry it; reference-image tokens after the target). The other inputs of each block
    come from an unrouted pass."""
    tiny, family = TINY[name], family_of(model)
    blocks = blocks_of(model)
    captured = [capture_inputs(block) for block in blocks]
    with torch.no_grad():
        model(**inputs)
    for _, handle in captured:
        handle.remove()
    seen = [dict(s) for s, _ in captured]
    key = family.tokens  # the blocks' argument that holds the image tokens
    text_first = family.lead(model, inputs).get(family.block_lists[0], 0)  # Krea2: the text leads in every block
    tail = seen[0][key].shape[1] - n - text_first
    rows = torch.arange(keep.shape[0])[:, None]
    lead = seen[start][key].shape[1] - n - tail
    x = seen[start][key]
    x_full = x[:, lead:lead + n]
    x = torch.cat([x[:, :lead], x_full[rows, keep], x[:, lead + n:]], 1)
    stream = tiny.other_stream  # the other stream a block updates and returns
    text = seen[start].get(stream)
    for i in range(start, len(blocks)):
        kw = dict(seen[i])
        if kw[key].shape[1] > n + tail and not lead:  # text and image joined for single-stream blocks
            x, lead = torch.cat([text, x], 1), kw[key].shape[1] - n - tail
        kw[key] = x
        if kw.get(stream) is not None:
            kw[stream] = text
        if start <= i <= end:
            tiny.by_hand(kw, keep, lead, tail)
        out = blocks[i](**kw)
        if isinstance(out, tuple):  # (text, image); image first where the family's out_index is 0 (HunyuanVideo)
            out, other = (out[0], out[1]) if family.out_index == 0 else (out[1], out[0])
            text = text if other is None else other
        x = out
        if i == end:
            full = x_full.clone()
            full[rows, keep] = x[:, lead:lead + keep.shape[1]]
            x = torch.cat([x[:, :lead], full, x[:, lead + keep.shape[1]:]], 1)
    return x
