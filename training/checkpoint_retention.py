"""Which checkpoints a run keeps (`train.keep_checkpoints`): the newest `newest` plus those at steps that
are multiples of `every`; by default (newest=null) all of them, as the authors' code does. A checkpoint of
DiT-XL/2 with its optimizer state is about 8 GB, so long runs choose. The newest checkpoint, the one a
resume reads, is never deleted: pruning runs after a checkpoint is complete and `newest` is at least 1.
"""
import os

from training.checkpoint import list_checkpoints


def steps_to_delete(steps, newest=None, every=None) -> list:
    """The steps of `steps` that `newest` / `every` do not keep, oldest first (none when newest is None)."""
    if newest is None or not steps:
        return []
    steps = sorted(steps)
    kept = set(steps[-max(1, int(newest)):])
    if every:
        kept |= {s for s in steps if s % int(every) == 0}
    return [s for s in steps if s not in kept]


def prune_checkpoints(ckpt_dir, policy) -> list:
    """Delete the checkpoints of `ckpt_dir` that `policy` (train.keep_checkpoints) does not keep; their paths."""
    if policy is None or policy.get("newest") is None:
        return []
    found = dict(list_checkpoints(ckpt_dir))
    removed = []
    for step in steps_to_delete(list(found), policy.get("newest"), policy.get("every")):
        os.remove(found[step])
        removed.append(found[step])
    return removed
