"""Sampling outputs: ADM-layout .npz batches and PNG grids, both written atomically."""
import math
from pathlib import Path

import numpy as np
from PIL import Image

from tread_utils.files import atomic_write


def save_samples_npz(path, images: np.ndarray, labels: np.ndarray) -> Path:
    """The ADM batch layout, written atomically: arr_0 uint8 [N, H, W, 3], arr_1 int64 [N]."""
    images = np.asarray(images, dtype=np.uint8)
    labels = np.asarray(labels, dtype=np.int64)
    return atomic_write(Path(path), lambda f: np.savez(f, arr_0=images, arr_1=labels))


def image_grid(images: np.ndarray, max_images: int = 64) -> np.ndarray:
    """The first `max_images` of uint8 [N, H, W, 3] tiled row by row into a near-square uint8 image."""
    images = np.asarray(images)[:max(int(max_images), 1)]
    n, h, w, c = images.shape
    cols = math.ceil(math.sqrt(n))
    rows = math.ceil(n / cols)
    grid = np.zeros((rows * h, cols * w, c), dtype=np.uint8)
    for i, image in enumerate(images):
        r, k = divmod(i, cols)
        grid[r * h:(r + 1) * h, k * w:(k + 1) * w] = image
    return grid


def save_image_grid(path, images: np.ndarray, max_images: int = 64) -> Path:
    grid = Image.fromarray(image_grid(images, max_images))
    return atomic_write(Path(path), lambda f: grid.save(f, format="PNG"))
