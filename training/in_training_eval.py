"""FID during training: every `train.eval.eval_interval` steps, sample `train.eval.fid_num_samples`
images with the EMA model (the seeds are spread over the processes, one generator per seed, so the
images do not depend on the process count), score them against the dataset's reference on the main
process, log the numbers and save a sample grid (one row per class, the metrics in its caption).

As in the authors' code, the seeds start at 100000 (`train.eval.seed`), `train.eval.cfg_scales` is a list
with one FID per scale (null or 1 = unguided, logged as `fid`; a guided scale s as `fid_cfg<s>`, e.g.
`fid_cfg1.5`, and likewise for the other metrics), and sampling runs under the run's mixed precision
(`train.eval.fp32=true` samples in float32 instead). A model with SPRINT routes is also scored with
path-drop guidance at each of `train.eval.path_drop_scales` (`fid_pdg<w>`); `train.eval.guidance_interval`
limits both kinds of guidance to a range of noise levels.

The embedded digits use the same pipeline at toy scale: a small CNN classifier shipped in
`evaluations/` stands in for Inception and the held-out split is the reference. ImageNet latents are
decoded with the SD-VAE and scored with the Inception port against `train.eval.ref_batch`
(ADM's `VIRTUAL_imagenet256_labeled.npz`).
"""
import contextlib
import time
from pathlib import Path

import numpy as np
import torch

from data.decoders import decoder_for
from data.latent_vae import decoding_vae
from data.digits import load_digits_split
from evaluations.digits_classifier import class_accuracy, digits_reference_statistics, load_digits_classifier
from evaluations.evaluator import metrics_from_features, reference_from_npz
from evaluations.distributed_features import compute_features_distributed
from evaluations.inception_weights import load_inception
from evaluations.metrics import feature_statistics, frechet_distance
from evaluations.reference_check import few_samples_warning
from generation import build_guided_net, generate, save_image_grid
from training.checkpoint import rng_untouched
from training.eval_inputs import SMOKE_WARNING
from training.run_log import format_metrics
from tread_utils.distributed import gather_rows
from tread_utils.errors import UserError


def inception_reference(cfg, extractor):
    """The ADM reference batch `train.eval.ref_batch`, through the Inception port."""
    e = cfg.train.eval
    if not e.ref_batch:
        raise UserError("in-training FID on latents needs a reference batch: set train.eval.ref_batch="
                        "VIRTUAL_imagenet256_labeled.npz (ADM's), or train.eval.eval_interval=0 to turn it off")
    return reference_from_npz(e.ref_batch, extractor, progress=False)


# dataset.kind -> (feature network on every process's device, reference statistics on the main process):
# the shipped digits classifier against the held-out digits; the Inception port against ADM's batch.
SCORERS = {
    "digits": (lambda cfg, device: load_digits_classifier(device=device),
               lambda cfg, extractor: digits_reference_statistics(extractor)),
    "shards": (lambda cfg, device: load_inception(weights=cfg.train.eval.inception_weights, device=device,
                                                  random_init=bool(cfg.train.eval.get("smoke", False)),
                                                  weights_option="train.eval.inception_weights=PATH"),
               inception_reference),
}


class TrainingEvaluator:
    @rng_untouched()  # set-up and evaluation leave the training streams where they were
    def __init__(self, cfg, accelerator, run_dir):
        e = cfg.train.eval
        self.accelerator = accelerator
        self.num_samples = int(e.fid_num_samples)  # at least the scorer's feature dimension unless smoke (config_check)
        self.batch_size = int(e.batch_size)
        self.seeds = range(int(e.seed), int(e.seed) + self.num_samples)
        # typed and checked by training.config_check, guidance without class dropout included
        cfg_scales = [1.0 if scale is None else float(scale) for scale in e.get("cfg_scales", [None])]
        interval = e.get("guidance_interval")
        interval = None if interval is None else list(interval)
        # (metric suffix, guidance options): the first one's grid is the run's closing grid
        self.guidance = [("" if s == 1.0 else f"_cfg{s:g}", {"cfg_scale": s, "guidance_interval": interval})
                         for s in cfg_scales]
        self.guidance += [(f"_pdg{float(w):g}", {"path_drop_guidance": {"scale": float(w)},
                                                  "guidance_interval": interval})
                          for w in e.get("path_drop_scales", [])]
        self.class_drop_prob = float(cfg.train.general.class_drop_prob)
        self.fp32 = bool(e.get("fp32", False))
        self.sampler_kwargs = dict(e.sampler)
        self.all_metrics = bool(e.all_metrics)
        self.samples_dir = Path(run_dir) / "samples"
        self.last_grid, self.last_scores = None, {}  # the newest grid's path and scores, for the closing summary
        device = accelerator.device
        vae, vae_note = decoding_vae(cfg.dataset)  # the latents' own VAE (manifest.json) unless dataset.vae
        self.decoder = decoder_for(cfg.dataset, vae=vae, device=device, vae_option="dataset.vae=DIR")
        load_extractor, load_reference = SCORERS[cfg.dataset.kind]
        self.extractor = load_extractor(cfg, device)  # every process extracts the features of its own samples
        self.reference, self.memorisation = None, None
        if accelerator.is_main_process:  # only the main process scores
            if vae_note:
                print(vae_note, flush=True)
            few = few_samples_warning(self.num_samples, self.extractor.feature_dims["pool"])
            smoke = SMOKE_WARNING if e.get("smoke") and cfg.dataset.kind == "shards" else None  # digits: its own net
            for warning in (smoke, few):
                if warning:
                    print(f"warning: {warning}", flush=True)
            self.reference = load_reference(cfg, self.extractor)
            if cfg.dataset.kind == "digits":
                self.memorisation = [self.decoder.decode(load_digits_split(split, cfg.dataset.input_size)[0]).numpy()
                                     for split in ("train", "test")]

    @rng_untouched()
    @torch.no_grad()
    def __call__(self, net, step: int) -> dict:
        """Runs on every process; returns the metrics on the main process and {} elsewhere."""
        t0 = time.time()
        metrics = {}
        for suffix, options in self.guidance:
            guided = build_guided_net(net, options, class_drop_prob=self.class_drop_prob)
            precision = contextlib.nullcontext() if self.fp32 else self.accelerator.autocast()
            with precision:
                share = generate(guided, self.seeds, sampler_kwargs=self.sampler_kwargs, decoder=self.decoder,
                                 batch_size=self.batch_size, accelerator=self.accelerator, progress=False, gather=False)
            keys = ("pool", "spatial", "logits") if self.all_metrics else ("pool",)
            feats = compute_features_distributed(self.extractor, share.images, self.accelerator, indices=share.indices,
                                                 batch_size=256, keys=keys, stats_keys=("spatial",))
            world, rank = self.accelerator.num_processes, self.accelerator.process_index
            whole, _ = gather_rows({"images": share.images, "labels": share.labels}, share.indices, world, rank)
            if self.accelerator.is_main_process:
                images, labels = whole["images"], whole["labels"]
                scores = self.score(feats, images, labels)
                metrics.update({f"{k}{suffix}": v for k, v in scores.items()})
                self.samples_dir.mkdir(parents=True, exist_ok=True)
                grid = save_image_grid(self.samples_dir / f"step_{step:08d}{suffix}.png", images, labels,
                                       num_classes=getattr(net, "num_classes", None),
                                       caption=f"step {step}{suffix.replace('_', ' ')}: {format_metrics(scores)}")
                if suffix == self.guidance[0][0]:
                    self.last_grid = grid
        if self.accelerator.is_main_process:
            metrics["eval_seconds"] = time.time() - t0
            self.last_scores = metrics
        self.accelerator.wait_for_everyone()
        return metrics

    def score(self, feats, images, labels) -> dict:
        """FID (with all_metrics also sFID, IS, precision, recall; on the digits class_acc and nn_ratio) of one
        sample set, from its features."""
        if self.all_metrics:
            scores = metrics_from_features(feats, self.reference)
            metrics = {"fid": scores["fid"], "sfid": scores["sfid"], "is": scores["inception_score"],
                       "precision": scores["precision"], "recall": scores["recall"]}
        else:
            mu, sigma = feature_statistics(feats["pool"])
            metrics = {"fid": frechet_distance(mu, sigma, self.reference["mu"], self.reference["sigma"])}
        if self.memorisation is not None:  # digits
            metrics["class_acc"] = class_accuracy(images, labels, self.extractor)
            metrics["nn_ratio"] = nearest_neighbour_ratio(images, *self.memorisation)
        return metrics


def nearest_neighbour_ratio(images: np.ndarray, train_images: np.ndarray, held_out: np.ndarray) -> float:
    """Memorisation check for toy runs: the mean distance of samples to their nearest training image,
    divided by the same for held-out images (about 1: samples as novel as unseen data; near 0: copies)."""
    def nn_dist(a, b):
        a, b = torch.from_numpy(a.reshape(len(a), -1)).float(), torch.from_numpy(b.reshape(len(b), -1)).float()
        return torch.cdist(a, b).min(dim=1).values.mean().item()

    return nn_dist(images, train_images) / nn_dist(held_out, train_images)
