"""EDM samplers: Algorithm 2 against a plain-loop reference, ablation sampler, analytic Gaussian,
per-seed generators."""
import math

import pytest
import torch

from edm.sampler import (SAMPLERS, StackedRandomGenerator, ablation_sampler, bind_sampler, edm_sampler,
                         edm_time_steps, euler_sampler)
from generation.generate import SAMPLERS as ALL_SAMPLERS, make_sampler
from tread_utils.errors import UserError


class TinyDenoiser(torch.nn.Module):
    """A seeded float32 MLP with EDM preconditioning; round_sigma rounds to float32."""

    sigma_min = 0.0
    sigma_max = float("inf")

    def __init__(self, dim=8, seed=0, sigma_data=0.5):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.w1 = torch.nn.Parameter(torch.randn(dim + 1, 32, generator=g) * 0.3)
        self.w2 = torch.nn.Parameter(torch.randn(32, dim, generator=g) * 0.3)
        self.emb = torch.nn.Parameter(torch.randn(5, dim, generator=g) * 0.1)
        self.sd = sigma_data
        self.calls = []

    def round_sigma(self, sigma):
        return torch.as_tensor(sigma).to(torch.float32).to(torch.float64)

    def forward(self, x, sigma, class_labels=None, bias=0.0):
        self.calls.append((x.dtype, torch.as_tensor(sigma).dim(), bias))
        b = x.shape[0]
        sigma = torch.as_tensor(sigma, dtype=torch.float32).reshape(-1, 1).expand(b, 1)
        flat = x.reshape(b, -1).float()
        c_skip = self.sd ** 2 / (sigma ** 2 + self.sd ** 2)
        c_out = sigma * self.sd / (sigma ** 2 + self.sd ** 2).sqrt()
        c_in = 1 / (sigma ** 2 + self.sd ** 2).sqrt()
        h = torch.cat([c_in * flat, sigma.log() / 4], dim=1)
        f = torch.tanh(h @ self.w1) @ self.w2
        if class_labels is not None:
            f = f + self.emb[class_labels]
        return (c_skip * flat + c_out * f + bias).reshape(x.shape)


def reference_algorithm2(net, latents, labels, num_steps, sigma_min, sigma_max, rho, S_churn, S_min, S_max,
                         S_noise, randn_like, heun=True, **kw):
    """Karras et al. 2022, Algorithm 2, written out step by step in float64 with Python scalars."""
    N = num_steps
    ts = []
    for i in range(N):
        v = (sigma_max ** (1 / rho) + i / (N - 1) * (sigma_min ** (1 / rho) - sigma_max ** (1 / rho))) ** rho
        ts.append(float(net.round_sigma(torch.tensor(v, dtype=torch.float64))))
    ts.append(0.0)

    def D(x, t):
        return net(x.float(), torch.tensor(t, dtype=torch.float64), labels, **kw).double()

    x = latents.double() * ts[0]
    for i in range(N):
        t_i, t_next = ts[i], ts[i + 1]
        gamma = min(S_churn / N, math.sqrt(2) - 1) if S_min <= t_i <= S_max else 0.0
        eps = randn_like(x) * S_noise
        t_hat = float(net.round_sigma(torch.tensor(t_i + gamma * t_i, dtype=torch.float64)))
        x_hat = x + math.sqrt(max(t_hat ** 2 - t_i ** 2, 0.0)) * eps
        d = (x_hat - D(x_hat, t_hat)) / t_hat
        x_next = x_hat + (t_next - t_hat) * d
        if heun and i != N - 1:
            d_prime = (x_next - D(x_next, t_next)) / t_next
            x_next = x_hat + (t_next - t_hat) * (d / 2 + d_prime / 2)
        x = x_next
    return x


SEEDS = [3, 14, 15, 92]


def _latents(shape=(8,)):
    return StackedRandomGenerator("cpu", SEEDS).randn([len(SEEDS), *shape])


@pytest.mark.parametrize("S_churn", [0.0, 40.0])
@pytest.mark.parametrize("heun", [True, False])
def test_matches_algorithm2_reference(S_churn, heun):
    net = TinyDenoiser()
    labels = torch.tensor([0, 1, 2, 4])
    settings = dict(num_steps=7, sigma_min=0.002, sigma_max=80.0, rho=7.0, S_churn=S_churn, S_min=0.05,
                    S_max=50.0, S_noise=1.003)
    with torch.no_grad():
        ref = reference_algorithm2(net, _latents(), labels, heun=heun, bias=0.01,
                                   randn_like=StackedRandomGenerator("cpu", SEEDS).randn_like, **settings)
        fn = edm_sampler if heun else euler_sampler
        out = fn(net, _latents(), labels, randn_like=StackedRandomGenerator("cpu", SEEDS).randn_like,
                 bias=0.01, **settings)
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    # NFE and the network contract: float32 x, 0-d sigma, net kwargs on every call.
    assert len(net.calls) == 2 * (2 * 7 - 1 if heun else 7)
    assert all(c == (torch.float32, 0, 0.01) for c in net.calls)


def test_churn_changes_result_and_is_seeded():
    net = TinyDenoiser()
    kw = dict(num_steps=6, S_churn=30.0, S_min=0.01, S_max=10.0)
    with torch.no_grad():
        a = edm_sampler(net, _latents(), randn_like=StackedRandomGenerator("cpu", SEEDS).randn_like, **kw)
        b = edm_sampler(net, _latents(), randn_like=StackedRandomGenerator("cpu", SEEDS).randn_like, **kw)
        c = edm_sampler(net, _latents(), num_steps=6)
    assert torch.equal(a, b)
    assert not torch.allclose(a, c)


def test_time_steps():
    class Net:
        sigma_min, sigma_max = 0.01, 50.0

        @staticmethod
        def round_sigma(s):
            return torch.as_tensor(s)

    t = edm_time_steps(Net, num_steps=5, sigma_min=0.002, sigma_max=80.0, rho=7)
    assert t.dtype == torch.float64 and t.shape == (6,)
    assert t[0].item() == pytest.approx(50.0) and t[4].item() == pytest.approx(0.01) and t[5] == 0
    assert torch.all(t[1:] < t[:-1])


@pytest.mark.parametrize("S_churn", [0.0, 20.0])
def test_ablation_edm_heun_matches_edm_sampler(S_churn):
    net = TinyDenoiser(seed=1)
    labels = torch.tensor([1, 1, 3, 0])
    kw = dict(num_steps=9, S_churn=S_churn, S_min=0.02, S_max=30.0)
    with torch.no_grad():
        a = edm_sampler(net, _latents(), labels, randn_like=StackedRandomGenerator("cpu", SEEDS).randn_like,
                        **kw)
        b = ablation_sampler(net, _latents(), labels, solver="heun", discretization="edm", schedule="linear",
                             scaling="none", randn_like=StackedRandomGenerator("cpu", SEEDS).randn_like, **kw)
        c = euler_sampler(net, _latents(), labels, num_steps=9)
        d = ablation_sampler(net, _latents(), labels, num_steps=9, solver="euler")
    torch.testing.assert_close(b, a, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(d, c, rtol=1e-10, atol=1e-10)


class GaussianDenoiser:
    """Exact denoiser of data ~ N(mu, s0^2) per coordinate: D(x; s) = mu + s0^2 / (s0^2 + s^2) (x - mu)."""

    sigma_min = 0.0
    sigma_max = float("inf")

    def __init__(self, mu, s0):
        self.mu, self.s0 = mu, s0
        self.num_calls = 0

    @staticmethod
    def round_sigma(s):
        return torch.as_tensor(s)

    def __call__(self, x, sigma, class_labels=None):
        self.num_calls += 1
        s2 = torch.as_tensor(sigma, dtype=torch.float64) ** 2
        return self.mu + self.s0 ** 2 / (self.s0 ** 2 + s2) * (x.double() - self.mu)


# Step counts where each configuration's discretization error is well below the tolerance (first-order
# Euler and the VE schedule converge slowly; churn adds noise that needs more steps to be removed).
@pytest.mark.parametrize("name,extra", [
    ("edm", {}),
    ("euler", {"num_steps": 256}),
    ("edm", {"num_steps": 128, "S_churn": 10.0, "S_min": 0.05, "S_max": 20.0}),
    ("ablation", {"discretization": "vp", "schedule": "vp", "scaling": "vp"}),
    ("ablation", {"discretization": "ve", "schedule": "ve", "num_steps": 256}),
    ("ablation", {"discretization": "ve", "schedule": "linear"}),
    ("ablation", {"discretization": "iddpm"}),
])
def test_gaussian_data_distribution(name, extra):
    """The samplers turn N(0, I) latents into samples of the data distribution N(mu, s0^2)."""
    mu, s0 = 0.7, 0.3
    net = GaussianDenoiser(mu, s0)
    seeds = list(range(200))
    gen = StackedRandomGenerator("cpu", seeds)
    latents = gen.randn([len(seeds), 100])
    kw = {"num_steps": 32, **extra}
    out = bind_sampler(name, SAMPLERS[name], **kw)(net, latents, randn_like=gen.randn_like)
    assert out.shape == latents.shape and torch.isfinite(out).all()
    assert out.mean().item() == pytest.approx(mu, abs=0.01)
    assert out.std().item() == pytest.approx(s0, rel=0.03)


def test_nfe_counts():
    for name, kw, expected in [("edm", {}, 2 * 10 - 1), ("euler", {}, 10),
                               ("ablation", {"solver": "heun"}, 19), ("ablation", {"solver": "euler"}, 10)]:
        net = GaussianDenoiser(0.0, 0.5)
        bind_sampler(name, SAMPLERS[name], num_steps=10, **kw)(net, torch.randn(2, 3))
        assert net.num_calls == expected, name


def test_ablation_default_ranges():
    """VP defaults come from beta_d 19.9 / beta_min 0.1 (EDM), not the 19.1 of the TREAD copy."""
    seen = []

    class Net(GaussianDenoiser):
        def __call__(self, x, sigma, class_labels=None):
            seen.append(float(sigma))
            return super().__call__(x, sigma, class_labels)

    expect = {
        "vp": (math.sqrt(math.expm1(0.5 * 19.9 * 1e-6 + 0.1 * 1e-3)), math.sqrt(math.expm1(0.5 * 19.9 + 0.1))),
        "ve": (0.02, 100.0),
        "iddpm": (None, None),
        "edm": (0.002, 80.0),
    }
    for disc, (lo, hi) in expect.items():
        seen.clear()
        ablation_sampler(Net(0.0, 0.5), torch.randn(1, 2), num_steps=12, discretization=disc, solver="euler")
        if lo is None:  # iDDPM: levels of the cosine schedule inside [0.002, 81]
            assert 0.002 <= min(seen) < 0.01 and 75.0 < max(seen) <= 81.0
        else:
            assert seen[0] == pytest.approx(hi, rel=1e-9) and seen[-1] == pytest.approx(lo, rel=1e-9)
    assert expect["vp"][1] == pytest.approx(152.0, rel=0.01)


def test_ablation_clamps_to_net_range():
    seen = []

    class Net(GaussianDenoiser):
        sigma_min, sigma_max = 0.01, 10.0

        def __call__(self, x, sigma, class_labels=None):
            seen.append(float(sigma))
            return super().__call__(x, sigma, class_labels)

    ablation_sampler(Net(0.0, 0.5), torch.randn(1, 2), num_steps=5, solver="euler")
    assert seen[0] == pytest.approx(10.0) and seen[-1] == pytest.approx(0.01)


def test_stacked_random_generator_independent_of_batching():
    seeds = [5, 6, 7, 8, 9]
    full = StackedRandomGenerator("cpu", seeds)
    parts = [StackedRandomGenerator("cpu", seeds[:2]), StackedRandomGenerator("cpu", seeds[2:])]
    for _ in range(3):  # successive draws stay aligned
        a = full.randn([5, 4, 3, 3])
        b = torch.cat([p.randn([len(p), 4, 3, 3]) for p in parts])
        assert torch.equal(a, b)
    x = torch.zeros(5, 2, dtype=torch.float64)
    a = full.randn_like(x)
    assert a.dtype == torch.float64
    assert torch.equal(a, torch.cat([p.randn_like(x[:len(p)]) for p in parts]))
    a = full.randint(10, size=[5, 6])
    assert torch.equal(a, torch.cat([p.randint(10, size=[len(p), 6]) for p in parts]))
    assert not torch.equal(full.randn([5, 8])[0], full.randn([5, 8])[1])
    with pytest.raises(ValueError):
        full.randn([4, 2])


def test_sampler_output_depends_only_on_seed():
    """Samples (with churn) are identical whichever other seeds share their batch."""
    net = TinyDenoiser(seed=2)
    seeds = [11, 12, 13, 14]
    labels = torch.tensor([0, 1, 2, 3])

    def run(idx):
        gen = StackedRandomGenerator("cpu", [seeds[i] for i in idx])
        with torch.no_grad():
            return edm_sampler(net, gen.randn([len(idx), 8]), labels[idx], num_steps=6, S_churn=10.0,
                               randn_like=gen.randn_like)

    full = run([0, 1, 2, 3])
    torch.testing.assert_close(torch.cat([run([0]), run([1, 2]), run([3])]), full, rtol=1e-6, atol=1e-6)


def test_samplers_and_their_settings_are_checked_where_they_are_built():
    """make_sampler (generation) is where a sampler is built from a config, and the one place that refuses an
    unknown name; bind_sampler refuses a setting the sampler does not have."""
    assert SAMPLERS["edm"] is edm_sampler and SAMPLERS["euler"] is euler_sampler
    assert SAMPLERS["ablation"] is ablation_sampler
    with pytest.raises(UserError, match="unknown sampler 'dpm'"):
        make_sampler({"name": "dpm"})
    with pytest.raises(UserError, match="num_step"):
        bind_sampler("edm", edm_sampler, num_step=3)
    with pytest.raises(ValueError):
        ablation_sampler(GaussianDenoiser(0, 1), torch.randn(1, 2), solver="rk4")


def test_make_sampler_checks_its_settings_without_drawing_from_the_global_stream():
    for name in ALL_SAMPLERS:  # EDM's and the flow sampler; EDM's draw churn noise at every step
        before = torch.get_rng_state()
        make_sampler({"name": name, "num_steps": 4})
        assert torch.equal(before, torch.get_rng_state()), name
