"""Guidance wrappers: batched CFG on all channels, guidance interval, routing guidance, NFE counters."""
import pytest
import torch

from edm.guidance import ClassifierFreeGuidance, NFECounter, RoutingGuidance, null_labels
from edm.sampler import StackedRandomGenerator, edm_sampler
from generation import build_guided_net
from tread_utils.errors import UserError

NUM_CLASSES = 10


class LabelNet:
    """Row-wise deterministic denoiser whose every channel depends on the label (null = NUM_CLASSES).

    Records the batch size of each call. If it receives `force_routing_ratio`, a seeded random subset of
    the spatial tokens (fraction = ratio, same subset for every row, chosen by `routing_seed`) is
    scaled down, so the output depends on both arguments.
    """

    sigma_min = 0.002
    sigma_max = 80.0
    num_classes = NUM_CLASSES

    def __init__(self, channels=4, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.label_emb = torch.randn(NUM_CLASSES + 1, channels, 1, 1, generator=g)
        self.batch_sizes = []
        self.routing_calls = []

    @staticmethod
    def round_sigma(sigma):
        return torch.as_tensor(sigma)

    def __call__(self, x, sigma, class_labels=None, force_routing_ratio=None, routing_seed=None):
        self.batch_sizes.append(x.shape[0])
        self.routing_calls.append((force_routing_ratio, routing_seed))
        b = x.shape[0]
        sigma = torch.as_tensor(sigma, dtype=torch.float32).reshape(-1, 1, 1, 1).expand(b, 1, 1, 1)
        out = x.float() / (1 + sigma ** 2) + torch.tanh(x.float()) * 0.1
        if class_labels is not None:
            out = out + self.label_emb[class_labels] * (1 + torch.tanh(x.float().abs()))
        if force_routing_ratio is not None:
            hw = x.shape[-2] * x.shape[-1]
            g = torch.Generator().manual_seed(int(routing_seed))
            perm = torch.randperm(hw, generator=g)
            mask = torch.ones(hw)
            mask[perm[:int(hw * force_routing_ratio)]] = 0.3
            out = out * mask.reshape(1, 1, *x.shape[-2:])
        return out


def _inputs(b=3):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(b, 4, 5, 5, generator=g)
    y = torch.tensor([1, 7, 3, 0, 9, 2][:b])
    return x, y


def test_null_labels():
    assert torch.equal(null_labels(torch.tensor([0, 5]), 10), torch.tensor([10, 10]))
    one_hot = torch.nn.functional.one_hot(torch.tensor([0, 5]), 11).float()
    assert torch.equal(null_labels(one_hot, 10), torch.nn.functional.one_hot(torch.tensor([10, 10]), 11).float())
    assert torch.equal(null_labels(one_hot[:, :10], 10), torch.zeros(2, 10))


@pytest.mark.parametrize("scale", [1.5, 4.0, -0.5])
def test_cfg_batched_equals_two_forwards_all_channels(scale):
    net = LabelNet()
    cfg = ClassifierFreeGuidance(net, scale, NUM_CLASSES)
    x, y = _inputs()
    sigma = torch.tensor(2.5, dtype=torch.float64)
    out = cfg(x, sigma, y)
    assert net.batch_sizes == [6]  # one doubled forward
    d_c = net(x, sigma, y)
    d_u = net(x, sigma, torch.full_like(y, NUM_CLASSES))
    expected = d_u + scale * (d_c - d_u)
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
    # Every channel, including the 4th, is guided (no 3-of-4 channel bug).
    for c in range(4):
        assert not torch.allclose(out[:, c], d_c[:, c], atol=1e-3), c
    assert cfg.nfe == 2 and cfg.num_calls == 1 and cfg.num_rows == 6


def test_cfg_scale_one_and_zero_are_single_forwards():
    net = LabelNet()
    x, y = _inputs()
    out = ClassifierFreeGuidance(net, 1.0, NUM_CLASSES)(x, 1.0, y)
    assert net.batch_sizes == [3]
    torch.testing.assert_close(out, net(x, 1.0, y))
    net.batch_sizes.clear()
    out = ClassifierFreeGuidance(net, 0.0, NUM_CLASSES)(x, 1.0, y)
    assert net.batch_sizes == [3]
    torch.testing.assert_close(out, net(x, 1.0, torch.full_like(y, NUM_CLASSES)))


def test_cfg_interval():
    net = LabelNet()
    cfg = ClassifierFreeGuidance(net, 3.0, NUM_CLASSES, interval=(0.3, 5.0))
    x, y = _inputs()
    for sigma in (0.29, 5.01, 80.0):  # outside: plain conditional, one un-doubled forward
        net.batch_sizes.clear()
        out = cfg(x, torch.tensor(sigma, dtype=torch.float64), y)
        assert net.batch_sizes == [3]
        assert torch.equal(out, net(x, torch.tensor(sigma, dtype=torch.float64), y))
    for sigma in (0.3, 1.0, 5.0):  # inside (bounds included): guided, one doubled forward
        net.batch_sizes.clear()
        out = cfg(x, sigma, y)
        assert net.batch_sizes == [6]
        d_c, d_u = net(x, sigma, y), net(x, sigma, torch.full_like(y, NUM_CLASSES))
        torch.testing.assert_close(out, d_u + 3.0 * (d_c - d_u), rtol=1e-6, atol=1e-6)
    assert cfg.nfe == 3 * 1 + 3 * 2 and cfg.num_calls == 6


def test_cfg_interval_per_row_sigma():
    net = LabelNet()
    cfg = ClassifierFreeGuidance(net, 2.0, NUM_CLASSES, interval=(0.5, 2.0))
    x, y = _inputs(4)
    sigma = torch.tensor([0.1, 1.0, 3.0, 2.0])
    out = cfg(x, sigma, y)
    assert net.batch_sizes == [4 + 2]
    d_c, d_u = net(x, sigma, y), net(x, sigma, torch.full_like(y, NUM_CLASSES))
    expected = d_c.clone()
    expected[[1, 3]] = (d_u + 2.0 * (d_c - d_u))[[1, 3]]
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
    assert cfg.nfe == pytest.approx(1.5)


def test_cfg_exposes_net_contract_and_samples():
    net = LabelNet()
    cfg = ClassifierFreeGuidance(net, 2.0, NUM_CLASSES, interval=(0.5, 10.0))
    assert cfg.sigma_min == 0.002 and cfg.sigma_max == 80.0 and cfg.num_classes == NUM_CLASSES
    assert torch.equal(cfg.round_sigma(torch.tensor([1.0])), torch.tensor([1.0]))
    x, y = _inputs()
    gen = StackedRandomGenerator("cpu", [0, 1, 2])
    out = edm_sampler(cfg, gen.randn(list(x.shape)), y, num_steps=8)
    assert out.shape == x.shape and torch.isfinite(out).all()
    # 2N - 1 = 15 evaluations; the doubled forwards are those with sigma in the interval.
    assert cfg.num_calls == 2 * 8 - 1 and sorted(set(net.batch_sizes)) == [3, 6]
    assert cfg.nfe == sum(b / 3 for b in net.batch_sizes)
    with pytest.raises(ValueError):
        cfg(x, 1.0, None)


def test_routing_guidance_equal_ratios_is_plain_forced_model():
    net = LabelNet()
    rg = RoutingGuidance(net, weak_ratio=0.5, strong_ratio=0.5, scale=3.0, seed=7)
    x, y = _inputs()
    out0 = rg(x, 1.0, y)
    out1 = rg(x, 1.0, y)
    seed0, seed1 = RoutingGuidance.derive_seed(7, 0), RoutingGuidance.derive_seed(7, 1)
    assert seed0 != seed1
    assert torch.equal(out0, net(x, 1.0, y, force_routing_ratio=0.5, routing_seed=seed0))
    assert torch.equal(out1, net(x, 1.0, y, force_routing_ratio=0.5, routing_seed=seed1))
    assert not torch.equal(out0, out1)  # a fresh token selection per evaluation
    assert rg.num_calls == 2 and rg.nfe == 2


def test_routing_guidance_formula_and_seed():
    net = LabelNet()
    rg = RoutingGuidance(net, weak_ratio=0.7, strong_ratio=0.3, scale=2.5, seed=3)
    x, y = _inputs()
    out = rg(x, 1.0, y)
    s = RoutingGuidance.derive_seed(3, 0)
    assert net.routing_calls == [(0.7, s), (0.3, s)]  # same seed for both ratios
    d_weak = net(x, 1.0, y, force_routing_ratio=0.7, routing_seed=s)
    d_strong = net(x, 1.0, y, force_routing_ratio=0.3, routing_seed=s)
    torch.testing.assert_close(out, d_weak + 2.5 * (d_strong - d_weak), rtol=1e-6, atol=1e-6)
    assert rg.nfe == 2
    # An explicit routing_seed wins; reset() replays the same seeds.
    net.routing_calls.clear()
    rg(x, 1.0, y, routing_seed=123)
    assert net.routing_calls == [(0.7, 123), (0.3, 123)]
    rg.reset()
    torch.testing.assert_close(rg(x, 1.0, y), out)
    with pytest.raises(AssertionError):  # sample.py refuses it first (training.config_check.check_sample_config)
        RoutingGuidance(net, 1.0, 0.3, 2.0)


def test_routing_guidance_with_cfg_both_orders():
    x, y = _inputs()
    sigma = torch.tensor(1.7, dtype=torch.float64)
    net_a, net_b = LabelNet(), LabelNet()
    outer_rg = RoutingGuidance(ClassifierFreeGuidance(net_a, 2.0, NUM_CLASSES), 0.75, 0.25, 1.5, seed=5)
    outer_cfg = ClassifierFreeGuidance(RoutingGuidance(net_b, 0.75, 0.25, 1.5, seed=5), 2.0, NUM_CLASSES)
    a, b = outer_rg(x, sigma, y), outer_cfg(x, sigma, y)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    # Explicit formula: W/S = weak/strong ratio, c/u = conditional/unconditional.
    s = RoutingGuidance.derive_seed(5, 0)
    ny = torch.full_like(y, NUM_CLASSES)
    W = {k: LabelNet()(x, sigma, lab, force_routing_ratio=0.75, routing_seed=s) for k, lab in (("c", y), ("u", ny))}
    S = {k: LabelNet()(x, sigma, lab, force_routing_ratio=0.25, routing_seed=s) for k, lab in (("c", y), ("u", ny))}
    cfg_w = W["u"] + 2.0 * (W["c"] - W["u"])
    cfg_s = S["u"] + 2.0 * (S["c"] - S["u"])
    torch.testing.assert_close(a, cfg_w + 1.5 * (cfg_s - cfg_w), rtol=1e-5, atol=1e-5)
    assert net_a.batch_sizes == [6, 6] and net_b.batch_sizes == [6, 6]
    # Routing guidance inside a sampler: both orders give the same samples.
    outer_rg.reset()
    outer_cfg.net.reset()
    gen_a, gen_b = StackedRandomGenerator("cpu", [1, 2, 3]), StackedRandomGenerator("cpu", [1, 2, 3])
    sa = edm_sampler(outer_rg, gen_a.randn(list(x.shape)), y, num_steps=5)
    sb = edm_sampler(outer_cfg, gen_b.randn(list(x.shape)), y, num_steps=5)
    # (this toy net is no real denoiser and the samples grow large: compare relative to their size)
    torch.testing.assert_close(sa, sb, rtol=1e-5, atol=1e-5 * sa.abs().max().item())


def test_nfe_counter_innermost():
    counter = NFECounter(LabelNet())
    guided = RoutingGuidance(ClassifierFreeGuidance(counter, 2.0, NUM_CLASSES), 0.6, 0.2, 2.0)
    x, y = _inputs()
    edm_sampler(guided, torch.randn(x.shape), y, num_steps=4)
    assert counter.num_calls == 2 * (2 * 4 - 1)  # two ratios per evaluation, each one doubled forward
    assert counter.num_rows == 2 * (2 * 4 - 1) * 6
    assert guided.nfe == 2 * (2 * 4 - 1) and guided.net.nfe == 2 * 2 * (2 * 4 - 1)
    counter.reset_counters()
    assert counter.num_calls == 0 and counter.nfe == 0


def _tiny_dit_precond():
    dit = pytest.importorskip("dit")
    from edm.precond import EDMPrecond
    torch.manual_seed(0)
    model = dit.DiT(input_size=8, patch_size=2, in_channels=4, hidden_size=32, depth=4, num_heads=2, num_classes=5,
                    routes=[{"start_layer_idx": 1, "end_layer_idx": 2, "selection_ratio": 0.5}])
    with torch.no_grad():  # leave adaLN-Zero's zero init so labels and routing change the output
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return EDMPrecond(model.eval(), sigma_data=0.5)


def test_with_real_backbone():
    """EDMPrecond(DiT): CFG equals the two-forward formula on all channels, equal-ratio routing guidance
    equals the plain forced-routing forward, and a guided sampler run is finite."""
    net = _tiny_dit_precond()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 4, 8, 8, generator=g)
    y = torch.tensor([0, 3, 4])
    sigma = torch.tensor(1.3, dtype=torch.float64)
    with torch.no_grad():
        out = ClassifierFreeGuidance(net, 2.5, 5)(x, sigma, y)
        d_c, d_u = net(x, sigma, y), net(x, sigma, torch.full_like(y, 5))
        torch.testing.assert_close(out, d_u + 2.5 * (d_c - d_u), rtol=1e-5, atol=1e-5)
        assert all(not torch.allclose(out[:, c], d_c[:, c]) for c in range(4))

        rg = RoutingGuidance(net, 0.5, 0.5, 2.0, seed=1)
        s = RoutingGuidance.derive_seed(1, 0)
        torch.testing.assert_close(rg(x, sigma, y), net(x, sigma, y, force_routing_ratio=0.5, routing_seed=s),
                                   rtol=0, atol=0)
        assert not torch.allclose(net(x, sigma, y, force_routing_ratio=0.5, routing_seed=s), d_c)

        guided = RoutingGuidance(ClassifierFreeGuidance(net, 1.5, 5, interval=(0.2, 5.0)), 0.7, 0.3, 1.5)
        gen = StackedRandomGenerator("cpu", [0, 1, 2])
        sample = edm_sampler(guided, gen.randn([3, 4, 8, 8]), y, num_steps=4, randn_like=gen.randn_like)
        assert sample.shape == (3, 4, 8, 8) and torch.isfinite(sample).all()


def test_unknown_routing_guidance_key_is_refused():
    with pytest.raises(UserError, match=r"unknown routing_guidance key\(s\) \['weak_ration'\]; accepted: scale"):
        build_guided_net(object(), {"routing_guidance": {"scale": 2.0, "weak_ration": 0.5}})
