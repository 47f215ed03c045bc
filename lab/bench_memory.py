"""Host-memory measures of the evaluation suite, importing no more than the evaluator itself does (torch and
evaluations/), so that a measured process carries none of the benchmarks' own imports (diffusers, the
backbones: about 170 MB).

- `peak_rss_mb`: this process's peak resident memory.
- `metric_stage`: the ADM suite after its network, on random features of N samples and M references (the
  shapes of the Inception port's), run the way `evaluations.evaluator.evaluate` runs: features kept on the
  extractor's device, sFID's reduced to statistics and the logits to the Inception Score as they come, then
  the five metrics. Prints one JSON line with the seconds and the peak.
"""
import json
import time

import numpy as np
import torch

from evaluations.evaluator import reference_from_images, score_features
from evaluations.features import compute_features
from evaluations.inception import InceptionV3FID


def peak_rss_mb() -> float:
    """This process's peak resident memory. VmHWM belongs to the process's own address space; ru_maxrss
    would carry over the parent's peak into a freshly started child on Linux."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024
    except (OSError, StopIteration):
        import resource  # not on every platform; only needed where /proc is missing

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


class RandomFeatures(torch.nn.Module):
    """Stands in for the Inception port: seeded random features of its shapes (or of ``dims``), made on its
    device whatever the images (pool and spatial uniform in [0, 1), logits standard normal)."""

    def __init__(self, device="cpu", seed: int = 0, dims: dict | None = None):
        super().__init__()
        self.feature_dims = dict(dims or InceptionV3FID.feature_dims)
        self.anchor = torch.nn.Parameter(torch.zeros(1, device=device), requires_grad=False)  # names the device
        self.generator = torch.Generator(device=device).manual_seed(seed)

    def forward(self, images):
        shape = dict(generator=self.generator, device=self.anchor.device)
        dims = self.feature_dims
        return {"pool": torch.rand(len(images), dims["pool"], **shape),
                "spatial": torch.rand(len(images), dims["spatial"], **shape),
                "logits": torch.randn(len(images), dims["logits"], **shape)}


def metric_stage(num_samples: int, num_ref: int, device="cpu", seed: int = 0, batch_size: int = 64):
    """The evaluator's steps after `reference_from_npz`/`inspect_samples` on 1x1 placeholder images and
    `RandomFeatures`: `seconds` times the metrics (as the record always has), `features_s` the feature passes."""
    device = torch.device(device)
    extractor = RandomFeatures(device, seed)
    t0 = time.perf_counter()
    ref = reference_from_images(extractor, np.zeros((num_ref, 1, 1, 3), np.uint8), batch_size, on_device=True)
    feats = compute_features(extractor, np.zeros((num_samples, 1, 1, 3), np.uint8), batch_size,
                             stats_keys=("spatial",), inception_split=5000, on_device=True)
    t1 = time.perf_counter()
    score_features(feats, ref, device=device)
    print(json.dumps(dict(seconds=time.perf_counter() - t1, features_s=t1 - t0, peak_host_mb=peak_rss_mb())))
