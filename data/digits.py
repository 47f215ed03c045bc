"""The embedded dataset: scikit-learn's 8x8 handwritten digits, used directly as 1-channel latents.

It ships inside the scikit-learn wheel, so the whole pipeline runs offline in minutes. Images are
scaled from [0, 16] to [-1, 1] and upsampled (bilinear) so that a patch-2 model sees at least 64
tokens. The split is fixed: a seeded permutation, the last `HELD_OUT` images are never trained on
and serve as the FID reference.
"""
import gzip
import importlib.util
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

NUM_CLASSES = 10
HELD_OUT = 297  # 1797 images in all: 1500 train, 297 held out
SPLIT_SEED = 0


def load_digits_split(split: str, resolution: int = 16):
    """Return (images float32 [N, 1, R, R] in [-1, 1], labels int64 [N]) for split 'train' or 'test'."""
    if split not in ("train", "test"):
        raise ValueError(f"digits split must be 'train' or 'test', got {split!r}")
    pixels, targets = read_digits()
    images = torch.from_numpy(pixels.astype(np.float32) / 8.0 - 1.0).unsqueeze(1)
    labels = torch.from_numpy(targets.astype(np.int64))
    order = torch.from_numpy(np.random.RandomState(SPLIT_SEED).permutation(len(labels)))
    chosen = order[:-HELD_OUT] if split == "train" else order[-HELD_OUT:]
    images, labels = images[chosen], labels[chosen]
    if resolution != 8:
        images = F.interpolate(images, size=(resolution, resolution), mode="bilinear", align_corners=False)
    return images.clamp(-1, 1).contiguous(), labels


def read_digits():
    """(images [1797, 8, 8] in 0..16, labels [1797]): what `sklearn.datasets.load_digits()` returns, read from the
    file the scikit-learn wheel ships (each row 64 pixels and the label) without importing scikit-learn, whose
    datasets module costs every training command over a second."""
    spec = importlib.util.find_spec("sklearn")
    path = Path(spec.submodule_search_locations[0]) / "datasets" / "data" / "digits.csv.gz"
    with gzip.open(path, "rt") as f:
        rows = np.loadtxt(f, delimiter=",")
    return rows[:, :-1].reshape(-1, 8, 8), rows[:, -1].astype(np.int64)


class DigitsDataset(torch.utils.data.Dataset):
    """Map-style dataset of (latent [1, R, R], label) held in memory (1,500 tiny images)."""

    def __init__(self, split: str = "train", resolution: int = 16):
        self.images, self.labels = load_digits_split(split, resolution)

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, index):
        index = index % len(self.labels)  # the resumable sampler addresses epoch * N + i
        return self.images[index], int(self.labels[index])
