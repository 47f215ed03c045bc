"""EDM's training objective against Karras et al. 2022 written out in float64: the preconditioning
coefficients, the sigma distribution and the loss weight; and class dropout in the training step."""
import math
from types import SimpleNamespace

import pytest
import torch
from accelerate import Accelerator

from edm import EDMLoss, EDMPrecond
from training.loop import accumulate_gradients

# Not the defaults (-1.2, 1.2, 0.5), so a hard-coded constant cannot pass.
P_MEAN, P_STD, SIGMA_DATA = -0.4, 0.8, 0.7


class Recorder(torch.nn.Module):
    """A backbone F(x, t, y) that records its inputs and returns a fixed output `out` (or its input)."""

    def __init__(self, out=None):
        super().__init__()
        self.out, self.calls = out, []

    def forward(self, x, t, y=None):
        self.calls.append((x.detach().clone(), t.detach().clone(), y))
        return x if self.out is None else self.out


def test_precond_coefficients_match_the_formulas():
    """D(x; s) = c_skip x + c_out F(c_in x; c_noise) with c_skip = sd^2/(s^2+sd^2), c_out = s sd/sqrt(s^2+sd^2),
    c_in = 1/sqrt(s^2+sd^2), c_noise = ln(s)/4, from 0.002 to 80 (float64 reference, float32 code)."""
    g = torch.Generator().manual_seed(0)
    s = torch.tensor([0.002, 0.05, 0.7, 3.0, 80.0], dtype=torch.float64)
    x = torch.randn(5, 2, 4, 4, generator=g, dtype=torch.float64)
    out = torch.randn(5, 2, 4, 4, generator=g)
    sd, col = SIGMA_DATA, s.view(-1, 1, 1, 1)
    c_skip, c_out = sd ** 2 / (col ** 2 + sd ** 2), col * sd / (col ** 2 + sd ** 2).sqrt()
    c_in, c_noise = 1 / (col ** 2 + sd ** 2).sqrt(), s.log() / 4

    with_out, zero_out = Recorder(out), Recorder(torch.zeros_like(out))
    d_out = EDMPrecond(with_out, sigma_data=sd)(x, s).double()
    d_zero = EDMPrecond(zero_out, sigma_data=sd)(x, s).double()
    (x_in, t_in, _), = with_out.calls
    torch.testing.assert_close(x_in.double(), c_in * x, rtol=1e-6, atol=0)
    torch.testing.assert_close(t_in.double(), c_noise, rtol=1e-6, atol=0)
    torch.testing.assert_close(d_zero, c_skip * x, rtol=1e-6, atol=1e-12)
    torch.testing.assert_close(d_out - d_zero, c_out * out.double(), rtol=1e-5, atol=1e-6)


def test_loss_draws_log_sigma_normal_and_weights_by_the_formula():
    """ln(sigma) ~ N(P_mean, P_std^2) (mean, std and a Kolmogorov-Smirnov distance, each at ~5 standard
    errors, over 20,000 draws); the noise is sigma * N(0, 1); loss = weight * (D - y)^2 elementwise with
    weight = (sigma^2 + sd^2) / (sigma sd)^2."""
    n = 20_000
    torch.manual_seed(0)
    images = torch.randn(n, 1, 2, 2)
    offset = torch.randn(n, 1, 2, 2)
    seen = []

    def net(x, sigma, labels):
        seen.append((x, sigma))
        return images + offset

    loss = EDMLoss(P_mean=P_MEAN, P_std=P_STD, sigma_data=SIGMA_DATA)(net, images, None)
    (noisy, sigma), = seen
    sigma = sigma.double()
    log_sigma = sigma.log()
    assert abs(log_sigma.mean().item() - P_MEAN) < 5 * P_STD / math.sqrt(n)
    assert abs(log_sigma.std().item() - P_STD) < 5 * P_STD / math.sqrt(2 * n)
    z = ((log_sigma - P_MEAN) / P_STD).sort().values
    cdf = torch.special.ndtr(z)
    ks = torch.maximum(torch.arange(1, n + 1) / n - cdf, cdf - torch.arange(n) / n).max().item()
    assert ks < 1.95 / math.sqrt(n), ks  # the 0.1% critical value
    unit_noise = (noisy - images).double() / sigma.view(-1, 1, 1, 1)
    assert abs(unit_noise.std().item() - 1) < 5 / math.sqrt(2 * unit_noise.numel())
    weight = (sigma ** 2 + SIGMA_DATA ** 2) / (sigma * SIGMA_DATA) ** 2
    error = ((images + offset) - images).double()  # D - y, as rounded in float32
    torch.testing.assert_close(loss.double(), weight.view(-1, 1, 1, 1) * error ** 2, rtol=1e-5, atol=0)


def drop_labels(drop_prob, labels, num_classes=10):
    """The labels the loss sees in one training step (training.loop.accumulate_gradients) of `labels`."""
    seen = []
    weight = torch.zeros((), requires_grad=True)

    def loss_fn(net, x, y):
        seen.append(y)
        return x * weight

    run = SimpleNamespace(accelerator=Accelerator(cpu=True), data_iter=iter([(torch.ones(len(labels)), labels)]),
                          net=None, loss_fn=loss_fn, accum=1, projector=None)
    accumulate_gradients(run, num_classes, drop_prob)
    return seen[0]


@pytest.mark.parametrize("drop_prob", [0.0, 0.3])
def test_class_dropout_replaces_that_fraction_by_the_null_class(drop_prob):
    """A fraction drop_prob of the labels (within 5 binomial standard errors) becomes the null class
    `num_classes`, the others pass unchanged; drop_prob=0 drops none."""
    n, num_classes = 20_000, 10
    torch.manual_seed(0)
    labels = torch.randint(0, num_classes, (n,))
    seen = drop_labels(drop_prob, labels, num_classes)
    dropped = seen != labels
    assert torch.all(seen[dropped] == num_classes)
    fraction = dropped.float().mean().item()
    assert abs(fraction - drop_prob) <= 5 * math.sqrt(drop_prob * (1 - drop_prob) / n), fraction
    if drop_prob > 0:  # dropout ignores the class: every class loses the same fraction
        per_class = torch.stack([dropped[labels == c].float().mean() for c in range(num_classes)])
        assert (per_class - drop_prob).abs().max() < 5 * math.sqrt(drop_prob * (1 - drop_prob) / (n / 12))
