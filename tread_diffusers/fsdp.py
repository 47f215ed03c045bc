"""FSDP2 for a diffusers transformer routed by TREAD: `shard_blocks(transformer)` applies torch's `fully_shard`
to each block of the family's block lists, then to the transformer (the root), as accelerate's FSDP2 plugin
wraps a transformer by its block class.

    handle = apply_tread(transformer, routes)   # and LoRA adapters: frozen and trained weights share a unit
    shard_blocks(transformer)                   # in every process of the group, before the optimizer is built

The routing hooks and FSDP2's run side by side on the same blocks. Each rank draws its kept tokens from its own
torch stream, and under gradient checkpointing the recomputed block replays the indices of its first run
(tread_diffusers/tread.py), so a rank routes as it would unsharded and the gradients are the mean over the
ranks' batches (tests/test_fsdp.py checks them against one process).
"""
from tread_diffusers.families import family_blocks
from tread_utils.distributed import fully_shard_blocks


def shard_blocks(transformer, **options):
    """`fully_shard(block, **options)` for every block, then the transformer; returns the number of blocks."""
    return fully_shard_blocks(transformer, family_blocks(transformer), **options)
