"""diffuser=rf: the rectified-flow objective, its ODE samplers, and its EDM-denoiser view."""
import json

import numpy as np
import pytest
import torch

from conftest import run_script, tiny_overrides
from training.checkpoint import load_sampling_net
from edm import edm_sampler
from rectified_flow import FlowPrecond, RFLoss, flow_sampler


class GaussianFlow:
    """Exact velocity of x_t = (1 - t) x0 + t eps for x0 ~ N(mu, s^2): v = E[eps - x0 | x_t]."""

    def __init__(self, mu, s):
        self.mu, self.s = mu, s

    def velocity(self, x, t, labels=None):
        t = torch.as_tensor(t, dtype=torch.float64)
        x = x.to(torch.float64)
        var = (1 - t) ** 2 * self.s ** 2 + t ** 2
        centred = x - (1 - t) * self.mu
        return t / var * centred - (self.mu + (1 - t) * self.s ** 2 / var * centred)


@pytest.mark.parametrize("solver, steps, tol, order", [("heun", 160, 1e-4, 2), ("euler", 320, 1e-2, 1)])
def test_sampler_integrates_the_known_ode(solver, steps, tol, order):
    """The ODE maps noise z to mu + s z exactly (x_t = (1 - t) mu + sqrt((1-t)^2 s^2 + t^2) z); the error
    falls with the solver's order as the steps double."""
    z = torch.randn(64, 1, 4, 4, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    net = GaussianFlow(mu=0.7, s=0.3)
    errors = [(flow_sampler(net, z, num_steps=n, solver=solver) - (0.7 + 0.3 * z)).abs().max().item()
              for n in (steps // 2, steps)]
    assert errors[1] < tol, errors
    assert errors[0] / errors[1] == pytest.approx(2 ** order, rel=0.15), errors


def test_denoiser_view_and_edm_sampler_agree():
    class Velocity(torch.nn.Module):  # a backbone whose output is the exact Gaussian velocity
        num_classes = 0

        def forward(self, x, t, y=None):
            return GaussianFlow(0.7, 0.3).velocity(x, t.view(-1, 1, 1, 1)).float()

    net = FlowPrecond(Velocity())
    x, sigma = torch.randn(8, 1, 4, 4), torch.full((8,), 1.5)
    t = sigma / (1 + sigma)
    x_t = x / (1 + sigma.view(-1, 1, 1, 1))
    expected = x_t - t.view(-1, 1, 1, 1) * net.velocity(x_t, t)
    assert torch.allclose(net(x, sigma), expected)
    z = torch.randn(256, 1, 2, 2, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    out = edm_sampler(net, z, num_steps=64, sigma_max=1e4)
    assert abs(out.mean().item() - 0.7) < 0.05 and abs(out.std().item() - 0.3) < 0.03


def test_rf_loss_target_is_eps_minus_x0():
    class Oracle(torch.nn.Module):
        def forward(self, x, sigma=None, labels=None, t=None):
            Oracle.seen = (x, t)
            return torch.zeros_like(x)

    torch.manual_seed(0)
    images = torch.randn(5, 1, 4, 4)
    loss = RFLoss()(Oracle(), images)
    torch.manual_seed(0)
    torch.randn(5, 1, 4, 4)
    t = torch.sigmoid(torch.randn(5))
    noise = torch.randn_like(images)
    assert torch.allclose(loss, (noise - images) ** 2)
    seen_x, seen_t = Oracle.seen
    assert torch.allclose(seen_t, t)
    assert torch.allclose(seen_x, (1 - t.view(-1, 1, 1, 1)) * images + t.view(-1, 1, 1, 1) * noise)


def test_rf_training_lowers_the_loss(tmp_path):
    run_script("train.py", f"results_dir={tmp_path}", "run_name=rf", "diffuser=rf", *tiny_overrides("tread"),
               "+model.params.mlp_ratio=2", "train.max_steps=150", "train.logging.log_interval=30",
               "train.ckpt_every=150", "train.general.batch_size=32", check=True)
    losses = [json.loads(line)["loss"] for line in (tmp_path / "rf" / "metrics.jsonl").read_text().splitlines()]
    assert losses[-1] < 0.8 * losses[0], losses


def test_flow_sampler_through_the_denoiser_view_matches_the_velocity():
    """A guidance wrapper exposes only the denoiser: the flow sampler converts it back to the velocity."""
    from edm.guidance import NFECounter

    class Velocity(torch.nn.Module):
        num_classes = 0

        def forward(self, x, t, y=None):
            return GaussianFlow(0.7, 0.3).velocity(x, t.view(-1, 1, 1, 1)).float()

    net = FlowPrecond(Velocity())
    z = torch.randn(16, 1, 2, 2, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    direct = flow_sampler(net, z, num_steps=160, t_max=1 - 1e-3)
    via_denoiser = flow_sampler(NFECounter(net), z, num_steps=160)
    assert torch.allclose(direct, via_denoiser, atol=2e-3)  # differ only in the last step (Euler)
    assert torch.allclose(via_denoiser, 0.7 + 0.3 * z, atol=2e-3)


def flow_cfg_samples(model, seeds, num_steps, scale):
    """The reference for sample.py's `sampler.name=flow cfg_scale=...` on a digits rf run, written out: per-seed
    noise then label, Heun on dx/dt = v_u + scale (v_c - v_u) from t = 1 - 1e-3 (the denoiser view's largest
    t) to 0 with an Euler last step, in float64; pixels round((x + 1) * 127.5)."""
    noise, labels = [], []
    for seed in seeds:
        g = torch.Generator().manual_seed(seed)
        noise.append(torch.randn(1, 16, 16, generator=g, dtype=torch.float32))
        labels.append(int(torch.randint(10, size=(), generator=g)))
    x, y = torch.stack(noise).double(), torch.tensor(labels)

    def velocity(x, t):
        t = torch.full((len(x),), t)
        v_c, v_u = (model(x.float(), t, c).double() for c in (y, torch.full_like(y, 10)))
        return v_u + scale * (v_c - v_u)

    times = torch.linspace(1 - 1e-3, 0, num_steps + 1, dtype=torch.float64).tolist()
    for t, t_next in zip(times[:-1], times[1:]):
        v = velocity(x, t)
        x_next = x + (t_next - t) * v
        x = x + (t_next - t) * 0.5 * (v + velocity(x_next, t_next)) if t_next > 0 else x_next
    return ((x + 1) * 127.5).round().clamp(0, 255).squeeze(1).numpy(), labels


def test_rf_checkpoint_samples_with_the_flow_sampler(tmp_path):
    """sample.py on an rf run with CFG gives the written-out flow sampler's images (to one grey level: float32
    rounding in the denoiser view) and the seeds' labels."""
    run_script("train.py", f"results_dir={tmp_path}", "run_name=rf", "diffuser=rf", *tiny_overrides("tread"),
               "train.max_steps=2", "train.ckpt_every=2", "train.optimizer.lr=1e-2", check=True)
    out = tmp_path / "s.npz"
    run_script("sample.py", f"ckpt={tmp_path / 'rf'}", "num_samples=4", f"out={out}", "sampler.name=flow",
               "sampler.num_steps=4", "cfg_scale=1.5", check=True)
    with np.load(out) as f:
        images, labels = f["arr_0"], f["arr_1"]
    assert images.shape == (4, 16, 16, 3) and images.dtype == np.uint8
    net, _ = load_sampling_net(tmp_path / "rf")
    with torch.no_grad():
        expected, expected_labels = flow_cfg_samples(net.model, range(4), num_steps=4, scale=1.5)
    assert labels.tolist() == expected_labels
    difference = np.abs(images[..., 0].astype(int) - expected)
    assert difference.max() <= 1 and (difference == 0).mean() > 0.95, difference.max()
    assert images.std() > 0
