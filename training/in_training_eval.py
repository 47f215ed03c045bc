"""FID during training: every `train.eval.eval_interval` steps, sample `train.eval.fid_num_samples`
images with the EMA model (the seeds are spread over the processes, one generator per seed, so the
images do not depend on the process count), score them against the dataset's reference on the main
process, log the numbers and save a sample grid.

The embedded digits use the same pipeline at toy scale: a small CNN classifier shipped in
`evaluations/` stands in for Inception and the held-out split is the reference. ImageNet latents are
decoded with the SD-VAE and scored with the Inception port against `train.eval.ref_batch`
(ADM's `VIRTUAL_imagenet256_labeled.npz`).
"""
import time
from pathlib import Path

import numpy as np
import torch

from data.decoders import decoder_for
from data.digits import load_digits_split
from evaluations.digits_classifier import digits_reference_statistics, load_digits_classifier
from evaluations.evaluator import metrics_from_features, reference_from_npz
from evaluations.features import compute_features
from evaluations.inception import load_inception
from evaluations.metrics import feature_statistics, frechet_distance
from generation import generate, save_image_grid
from training.checkpoint import rng_untouched
from tread_utils.errors import UserError


def digits_scorer(cfg, device):
    """The shipped digits classifier, against the held-out digits."""
    extractor = load_digits_classifier(device=device)
    return extractor, digits_reference_statistics(extractor)


def inception_scorer(cfg, device):
    """The Inception port, against the ADM reference batch `train.eval.ref_batch`."""
    e = cfg.train.eval
    if not e.ref_batch:
        raise UserError("in-training FID on latents needs a reference batch: set train.eval.ref_batch="
                        "VIRTUAL_imagenet256_labeled.npz (ADM's), or train.eval.eval_interval=0 to turn it off")
    extractor = load_inception(weights=e.inception_weights, device=device)
    return extractor, reference_from_npz(e.ref_batch, extractor, progress=False)


# dataset.kind -> (feature network, reference statistics)
SCORERS = {"digits": digits_scorer, "shards": inception_scorer}


class TrainingEvaluator:
    @rng_untouched()  # set-up and evaluation leave the training streams where they were
    def __init__(self, cfg, accelerator, run_dir):
        e = cfg.train.eval
        self.accelerator = accelerator
        self.num_samples = int(e.fid_num_samples)  # at least the scorer's feature dimension (config_check)
        self.batch_size = int(e.batch_size)
        self.seeds = range(int(e.seed), int(e.seed) + self.num_samples)
        self.sampler_kwargs = dict(e.sampler)
        self.all_metrics = bool(e.all_metrics)
        self.samples_dir = Path(run_dir) / "samples"
        device = accelerator.device
        self.decoder = decoder_for(cfg.dataset, device=device)
        self.extractor, self.reference, self.memorisation = None, None, None
        if accelerator.is_main_process:  # only the main process scores
            self.extractor, self.reference = SCORERS[cfg.dataset.kind](cfg, device)
            if cfg.dataset.kind == "digits":
                self.memorisation = [self.decoder.decode(load_digits_split(split, cfg.dataset.input_size)[0]).numpy()
                                     for split in ("train", "test")]

    @rng_untouched()
    @torch.no_grad()
    def __call__(self, net, step: int) -> dict:
        """Runs on every process; returns the metrics on the main process and {} elsewhere."""
        t0 = time.time()
        images, labels = generate(net, self.seeds, sampler_kwargs=self.sampler_kwargs, decoder=self.decoder,
                                  batch_size=self.batch_size, accelerator=self.accelerator, progress=False)
        metrics = {}
        if self.accelerator.is_main_process:
            keys = ("pool", "spatial", "logits") if self.all_metrics else ("pool",)
            feats = compute_features(self.extractor, images, batch_size=256, keys=keys, stats_keys=("spatial",))
            if self.all_metrics:
                scores = metrics_from_features(feats, self.reference)
                metrics = {"fid": scores["fid"], "sfid": scores["sfid"], "is": scores["inception_score"],
                           "precision": scores["precision"], "recall": scores["recall"]}
            else:
                mu, sigma = feature_statistics(feats["pool"])
                metrics = {"fid": frechet_distance(mu, sigma, self.reference["mu"], self.reference["sigma"])}
            if self.memorisation is not None:
                metrics["nn_ratio"] = nearest_neighbour_ratio(images, *self.memorisation)
            self.samples_dir.mkdir(parents=True, exist_ok=True)
            save_image_grid(self.samples_dir / f"step_{step:08d}.png", images[:64])
            metrics["eval_seconds"] = time.time() - t0
        self.accelerator.wait_for_everyone()
        return metrics


def nearest_neighbour_ratio(images: np.ndarray, train_images: np.ndarray, held_out: np.ndarray) -> float:
    """Memorisation check for toy runs: the mean distance of samples to their nearest training image,
    divided by the same for held-out images (about 1: samples as novel as unseen data; near 0: copies)."""
    def nn_dist(a, b):
        a, b = torch.from_numpy(a.reshape(len(a), -1)).float(), torch.from_numpy(b.reshape(len(b), -1)).float()
        return torch.cdist(a, b).min(dim=1).values.mean().item()

    return nn_dist(images, train_images) / nn_dist(held_out, train_images)
