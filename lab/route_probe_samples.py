"""Sample quality for the route probe's fine-tuning check: digits drawn from a FLUX-architecture toy model with the
project's flow-matching ODE sampler (rectified_flow.flow_sampler) and scored by the digits classifier.

The toy models (tools/diffusers_toy.py) denoise the digits themselves: 16 x 16 in [-1, 1], packed 2 x 2 into 64
tokens, the resolution the digits classifier reads, so a sample goes to the classifier as it is (unpacked, then
`latents_to_uint8`, as every digits sample in the project)."""
import torch

from data.digits import load_digits_split
from data.images import latents_to_uint8
from evaluations.digits_classifier import class_accuracy, digits_fid, digits_reference_statistics
from evaluations.metrics import feature_statistics
from rectified_flow import flow_sampler
from tools.diffusers_toy import model_inputs


class TextConditionedVelocity:
    """A diffusers flow-matching transformer as the `velocity(x_t, t, labels)` that flow_sampler integrates from
    t = 1 (noise) to t = 0: the labels become the class names' text embeddings."""

    def __init__(self, model, text_encoder):
        self.model, self.text_encoder = model, text_encoder

    def velocity(self, x_t: torch.Tensor, t: float, labels: torch.Tensor) -> torch.Tensor:
        text, pooled = self.text_encoder(labels)
        times = torch.full((len(x_t),), float(t), device=x_t.device)
        return self.model(**model_inputs(self.model, x_t, text, pooled, times), return_dict=False)[0]


def unpack(tokens: torch.Tensor, channels: int = 1) -> torch.Tensor:
    """The inverse of diffusers_toy.pack: [B, (H/2)(W/2), 4C] tokens of a square grid -> [B, C, H, W]."""
    b, n, _ = tokens.shape
    side = int(round(n ** 0.5))
    grid = tokens.reshape(b, side, side, channels, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return grid.reshape(b, channels, 2 * side, 2 * side)


def sample_labels(classes, per_class: int) -> torch.Tensor:
    return torch.tensor(classes).repeat_interleave(per_class)


@torch.no_grad()
def sample_digits(model, text_encoder, labels: torch.Tensor, tokens: int, seed: int, steps: int,
                  batch_size: int = 256) -> torch.Tensor:
    """Digits [N, 1, 16, 16] in [-1, 1] for class `labels` [N], Euler on the velocity ODE in `steps` steps, from
    noise fixed by `seed` (one generator of its own: the same noise for every model, the global RNG untouched)."""
    channels = model.config.in_channels
    noise = torch.randn(len(labels), tokens, channels, generator=torch.Generator().manual_seed(seed))
    net = TextConditionedVelocity(model.eval(), text_encoder)
    out = [flow_sampler(net, z, y, num_steps=steps, solver="euler").float()
           for z, y in zip(noise.split(batch_size), labels.split(batch_size))]
    return unpack(torch.cat(out), channels // 4).clamp(-1, 1)


def class_reference(classifier, classes) -> dict:
    """FID statistics of the held-out digits of `classes` only (the reference the samples of those classes are
    compared with), in the form digits_fid takes."""
    full = digits_reference_statistics(classifier)
    keep = torch.isin(torch.from_numpy(full["labels"]), torch.tensor(classes)).numpy()
    mu, sigma = feature_statistics(full["pool"][keep])
    return {"mu": mu, "sigma": sigma, "count": int(keep.sum())}


def score(images: torch.Tensor, labels: torch.Tensor, classifier, reference: dict) -> dict:
    """Class accuracy (the fraction the classifier reads as the digit the sample was drawn for) and FID against
    `reference` of digits `images` [N, 1, 16, 16] in [-1, 1]."""
    uint8 = latents_to_uint8(images)
    return {"class_accuracy": class_accuracy(uint8, labels, classifier),
            "fid": float(digits_fid(uint8, classifier, reference))}


def real_digits(classes, per_class: int) -> tuple:
    """The first `per_class` training digits of each of `classes`: the yardstick a perfect model would score."""
    images, labels = load_digits_split("train", 16)
    picks = [torch.nonzero(labels == c).flatten()[:per_class] for c in classes]
    assert min(map(len, picks)) == per_class, f"fewer than {per_class} training digits of some class in {classes}"
    index = torch.cat(picks)
    return images[index], labels[index]
