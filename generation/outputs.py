"""Sampling outputs: ADM-layout .npz batches, written atomically (PNG grids: `generation.grids`)."""
from pathlib import Path

import numpy as np

from tread_utils.files import atomic_write


def save_samples_npz(path, images: np.ndarray, labels: np.ndarray) -> Path:
    """The ADM batch layout, written atomically: arr_0 uint8 [N, H, W, 3], arr_1 int64 [N]."""
    images = np.asarray(images, dtype=np.uint8)
    labels = np.asarray(labels, dtype=np.int64)
    return atomic_write(Path(path), lambda f: np.savez(f, arr_0=images, arr_1=labels))
