"""Digits feature network: the toy-scale stand-in for Inception on the embedded digits dataset.

A small CNN with the same interface as the Inception port: ``forward(uint8 NHWC [N, 16, 16, 3])``
returns a dict of float32 tensors

* ``pool``    [N, 128]  penultimate features (FID, precision/recall)
* ``spatial`` [N, 256]  first 4 channels of the 8x8x64 third conv map, flattened in (h, w, c) order (sFID)
* ``logits``  [N, 10]   class logits (Inception Score, accuracy)

Only channel 0 is used (digits are grey); pixel p becomes p / 127.5 - 1, so it matches digits latents
in [-1, 1] after :func:`data.images.latents_to_uint8`. Other square resolutions are resized
(bilinear) to 16x16.

Train-time FID for digits::

    from evaluations.digits_classifier import digits_fid, evaluate_digits
    fid = digits_fid(latents)              # latents: [N, 1, 16, 16] in [-1, 1]
    metrics = evaluate_digits(latents)     # fid, sfid, inception_score, precision, recall
    acc = class_accuracy(images, labels)   # generated uint8 images and the labels they were drawn for
    # in a training loop, load once and pass them in:
    #   clf = load_digits_classifier(); ref = digits_reference_statistics(clf)
    #   digits_fid(latents, clf, ref)

The shipped weights ``evaluations/digits_classifier.pt`` come from
``python -m lab.train_digits_classifier``.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from data.digits import load_digits_split
from data.images import latents_to_uint8
from evaluations.evaluator import metrics_from_features
from evaluations.features import compute_features
from evaluations.metrics import feature_statistics, frechet_distance
from tread_utils.errors import UserError

WEIGHTS_PATH = Path(__file__).resolve().parent / "digits_classifier.pt"
RESOLUTION = 16
NUM_CLASSES = 10
POOL_DIM = 128
SPATIAL_CHANNELS = 4


class DigitsClassifier(nn.Module):
    feature_dims = {"pool": POOL_DIM, "spatial": 8 * 8 * SPATIAL_CHANNELS, "logits": NUM_CLASSES}

    def __init__(self, dropout: float = 0.3):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, padding=1)
        self.conv2 = nn.Conv2d(32, 32, 3, padding=1)
        self.conv3 = nn.Conv2d(32, 64, 3, padding=1)
        self.conv4 = nn.Conv2d(64, 64, 3, padding=1)
        self.fc1 = nn.Linear(64 * 4 * 4, POOL_DIM)
        self.fc2 = nn.Linear(POOL_DIM, NUM_CLASSES)
        self.dropout = nn.Dropout(dropout)

    def feature_maps(self, x: torch.Tensor):
        """The 8x8 maps of conv3 and conv4 [N, 64, 8, 8], after ReLU and before the last pooling; conv4's is
        REPA's teacher on the digits (training/repa_teachers.py)."""
        h = F.relu(self.conv1(x))
        h = F.max_pool2d(F.relu(self.conv2(h)), 2)  # 8x8
        h3 = F.relu(self.conv3(h))
        return h3, F.relu(self.conv4(h3))

    def forward_latents(self, x: torch.Tensor) -> dict:
        """x: float [N, 1, 16, 16] in [-1, 1] (the training path; gradients flow)."""
        h3, h4 = self.feature_maps(x)
        spatial = h3[:, :SPATIAL_CHANNELS].permute(0, 2, 3, 1).reshape(len(x), -1)  # (h, w, c)
        h = F.max_pool2d(h4, 2)  # 4x4
        pool = F.relu(self.fc1(h.flatten(1)))
        logits = self.fc2(self.dropout(pool))
        return {"pool": pool, "spatial": spatial, "logits": logits}

    @staticmethod
    def uint8_to_input(images: torch.Tensor) -> torch.Tensor:
        """uint8 NHWC [N, H, W, C] -> float [N, 1, 16, 16] in [-1, 1] (channel 0, p / 127.5 - 1)."""
        if images.dim() != 4 or images.shape[-1] not in (1, 3):
            raise ValueError(f"expected uint8 images [N, H, W, 3], got shape {tuple(images.shape)}")
        x = images[..., 0].to(torch.float32).unsqueeze(1) / 127.5 - 1.0
        if x.shape[-2:] != (RESOLUTION, RESOLUTION):
            x = F.interpolate(x, size=(RESOLUTION, RESOLUTION), mode="bilinear", align_corners=False,
                              antialias=x.shape[-1] > RESOLUTION)
        return x

    def forward(self, images) -> dict:
        """images: uint8 NHWC [N, 16, 16, 3] (grey; channel 0 is used)."""
        if not torch.is_tensor(images):
            images = torch.as_tensor(np.asarray(images))
        images = images.to(self.fc1.weight.device)
        return self.forward_latents(self.uint8_to_input(images))


def load_digits_classifier(path=None, device=None) -> DigitsClassifier:
    """The trained classifier (shipped weights by default) in eval mode, gradients off."""
    path = Path(path) if path is not None else WEIGHTS_PATH
    if not path.is_file():
        raise UserError(f"digits classifier weights {path} not found; train them with "
                        f"`python -m lab.train_digits_classifier`")
    model = DigitsClassifier()
    model.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
    for p in model.parameters():
        p.requires_grad_(False)
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return model.eval().to(device)


def _as_uint8_images(samples):
    """[-1, 1] latents [N, 1|3, H, W] (float) or uint8 images [N, H, W, 3] -> uint8 NHWC."""
    if torch.is_tensor(samples) and samples.dtype == torch.uint8:
        return samples
    if isinstance(samples, np.ndarray) and samples.dtype == np.uint8:
        return samples
    return latents_to_uint8(samples)


def digits_reference_statistics(classifier=None, split: str = "test", batch_size: int = 512) -> dict:
    """Features and statistics of a digits split (default: the 297 held-out images), computed now.

    Returns {'mu', 'sigma', 'mu_s', 'sigma_s', 'pool', 'spatial', 'logits', 'labels'} (numpy).
    """
    classifier = classifier if classifier is not None else load_digits_classifier()
    images, labels = load_digits_split(split, resolution=RESOLUTION)
    feats = compute_features(classifier, latents_to_uint8(images), batch_size)
    mu, sigma = feature_statistics(feats["pool"])
    mu_s, sigma_s = feature_statistics(feats["spatial"])
    return {"mu": mu, "sigma": sigma, "mu_s": mu_s, "sigma_s": sigma_s, **feats, "labels": labels.numpy()}


def evaluate_digits(samples, classifier=None, reference=None, batch_size: int = 512, split_size: int = 5000) -> dict:
    """ADM-style metrics of digits samples against the held-out split, with the digits classifier.

    ``samples``: [-1, 1] latents [N, 1, H, W] (torch or numpy) or uint8 images [N, H, W, 3].
    ``reference``: the dict of :func:`digits_reference_statistics` (computed when None; pass it in to
    reuse it across evaluations). Returns {'fid', 'sfid', 'inception_score', 'precision', 'recall',
    'notes'}; precision/recall need at least 4 samples.
    """
    classifier = classifier if classifier is not None else load_digits_classifier()
    reference = reference if reference is not None else digits_reference_statistics(classifier)
    feats = compute_features(classifier, _as_uint8_images(samples), batch_size)
    if len(feats["pool"]) < 4:
        raise ValueError(f"need at least 4 samples for digits metrics, got {len(feats['pool'])}")
    return metrics_from_features(feats, reference, split_size=split_size)


def digits_fid(samples, classifier=None, reference=None, batch_size: int = 512) -> float:
    """FID of digits samples ([-1, 1] latents [N, 1, H, W] or uint8 NHWC) against the held-out split."""
    classifier = classifier if classifier is not None else load_digits_classifier()
    reference = reference if reference is not None else digits_reference_statistics(classifier)
    feats = compute_features(classifier, _as_uint8_images(samples), batch_size, keys=("pool",))
    mu, sigma = feature_statistics(feats["pool"])
    return frechet_distance(mu, sigma, reference["mu"], reference["sigma"])


def accuracy(classifier, images, labels, batch_size: int = 512) -> float:
    """Top-1 accuracy on uint8 NHWC images (or [-1, 1] latents) and int labels."""
    feats = compute_features(classifier, _as_uint8_images(images), batch_size, keys=("logits",))
    labels = labels.cpu().numpy() if torch.is_tensor(labels) else np.asarray(labels)
    return float((feats["logits"].argmax(1) == labels).mean())


def class_accuracy(samples, labels, classifier=None, batch_size: int = 512) -> float:
    """`class_acc` of class-conditional digits samples: the fraction the classifier assigns to the class
    they were conditioned on. Real held-out digits score its accuracy (295/297); samples that ignore their
    label score about 0.1 (chance over ten classes)."""
    classifier = classifier if classifier is not None else load_digits_classifier()
    return accuracy(classifier, samples, labels, batch_size)
