"""One feature-extraction pass spread over the processes of a run.

Every rank runs the extractor (Inception, the digits classifier) on its own share of the images on its own
device; the main process gathers the features and puts them back in seed order. Statistics that are
accumulated instead of kept (`stats_keys`, e.g. sFID's spatial features) are merged exactly
(`RunningStatistics.merge`), so the result is `compute_features` of all the images, up to the order of
floating-point sums.

    feats = compute_features_distributed(extractor, my_images, accelerator, indices=my_indices, keys=("pool",))
    # main process: {"pool": float32 [N, 2048]} in seed order; other ranks: None
"""
import numpy as np

from evaluations.features import FEATURE_KEYS, feature_pass
from tread_utils.distributed import gather_rows


def rank_share(num: int, world: int, rank: int) -> np.ndarray:
    """The rows rank `rank` of `world` takes from a full array of `num` rows: a contiguous slice."""
    return np.arange(num * rank // world, num * (rank + 1) // world, dtype=np.int64)


def compute_features_distributed(extractor, images, accelerator=None, *, indices=None, batch_size: int = 64,
                                 keys=FEATURE_KEYS, stats_keys=()):
    """`compute_features` over the images of all ranks; the result on the main process, None on the others.

    images:      this rank's share (uint8 [n, H, W, 3], numpy or torch), whose rows sit at `indices` in seed
                 order (`generation.generate(..., gather=False)`); or, with indices=None, the full array, the same on
                 every rank, of which each rank takes `rank_share` of the rows.
    accelerator: the run's `accelerate.Accelerator` (None: one process). Every rank must call this.
    """
    world = accelerator.num_processes if accelerator is not None else 1
    rank = accelerator.process_index if accelerator is not None else 0
    if indices is None:
        indices = rank_share(len(images), world, rank)
        images = images[int(indices[0]):int(indices[-1]) + 1] if len(indices) else images[:0]
    indices = np.asarray(indices, dtype=np.int64).reshape(-1)
    if len(indices) != len(images):
        raise ValueError(f"{len(indices)} indices for {len(images)} images on rank {rank}")
    out, running = feature_pass(extractor, images, batch_size, keys=keys, stats_keys=stats_keys)
    feats, partial_stats = gather_rows(out, indices, world, rank, extra=running)
    if feats is None:
        return None
    for key in stats_keys:
        merged = partial_stats[0][key]
        for part in partial_stats[1:]:
            merged.merge(part[key])
        if merged.n:
            feats[key + "_stats"] = merged.result()
    return feats
