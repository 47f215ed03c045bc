"""Regional compilation of a diffusers transformer routed by TREAD: `compile_blocks(transformer)`.

Each block's `forward` is compiled on its own; the module hooks that route tokens (tread_diffusers/tread.py)
stay eager around it. Blocks of one class share their graphs (torch.compile takes their parameters as inputs),
so a FLUX compiles a few graphs whatever its depth: per block class, one for the full sequence and one for the
kept tokens (the ratio is fixed, so the shapes are). The model-level forward (embedders, the loop) stays eager.

    handle = apply_tread(transformer, routes)
    compile_blocks(transformer)          # after apply_tread and any LoRA adapters; options go to torch.compile

diffusers' `transformer.compile_repeated_blocks()` works with the routes too (tested): it compiles each block
with its hooks, so the routing is traced into the graphs, which then come in more variants (the route's first
block, its inner blocks, its last one) and take longer to compile.
"""
import torch

from tread_diffusers.families import family_of


def compile_blocks(transformer, **options) -> int:
    """torch.compile every block's forward (keywords go to torch.compile); returns the number of blocks. A block
    compiled already is left as it is, so a second call changes nothing."""
    blocks = [block for name in family_of(transformer).block_lists for block in getattr(transformer, name)]
    for block in blocks:
        if not hasattr(block.forward, "_torchdynamo_orig_callable"):
            block.forward = torch.compile(block.forward, **options)
    return len(blocks)
