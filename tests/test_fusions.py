"""A fusion registered from outside the model file, as docs/extensions.md writes one: one entry of `dit.FUSIONS`
(routing_module.Fusion) is accepted by the config with its options checked from its signature, keeps the weights
its builder gave it, trains, samples in eval mode (no token dropped: it gets every index), is counted by the FLOP
report, restores the sequence as it defines, and is refused by path-drop guidance, which it cannot serve."""
import pytest
import torch
import torch.nn as nn
from hydra import compose, initialize_config_dir

import dit
import routing_module
from conftest import REPO
from routing_module import Fusion, RouteError
from training.config_check import check_train_config
from training.flops import analytic_training_flops, training_step_flops


class GatedFusion(nn.Module):
    """The skipped tokens rejoin (end_route), then every token moves by a learned linear gate of its change along
    the route: x_shallow + W (restored - x_shallow), W starting at gate_init * I (1: TREAD's restore exactly)."""

    def __init__(self, hidden_size: int, gate_init: float):
        super().__init__()
        self.gate = nn.Linear(hidden_size, hidden_size, bias=False)
        with torch.no_grad():  # set here, as a user writes it: the model's own initialisation leaves it alone
            self.gate.weight.copy_(gate_init * torch.eye(hidden_size))

    def forward(self, x_deep, x_shallow, keep_idx):
        restored = routing_module.end_route(x_deep, x_shallow, keep_idx)
        return x_shallow + self.gate(restored - x_shallow)


def build_gated(hidden_size, route, *, gate_init: float = 1.0):
    return GatedFusion(hidden_size, gate_init)


GATED = Fusion(build=build_gated, flops=lambda hidden, tokens: 2 * tokens * hidden * hidden)
ROUTE = {"selection_ratio": 0.5, "start_layer_idx": 1, "end_layer_idx": 2}
PARAMS = dict(input_size=8, depth=4, hidden_size=32, num_heads=2, num_classes=10, in_channels=4,
              enable_routing=True)


@pytest.fixture(autouse=True)
def gated(monkeypatch):
    monkeypatch.setitem(dit.FUSIONS, "gated", GATED)


def check(*overrides):
    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base="1.3"):
        return check_train_config(compose("config", overrides=["model=tread", *overrides])).config


def test_the_config_accepts_the_strategy_and_checks_its_options():
    cfg = check("model.params.routes.0.fusion=gated", "+model.params.routes.0.fusion_options.gate_init=0.5")
    assert cfg.model.params.routes[0].fusion == "gated"
    with pytest.raises(RouteError, match="fusion gated has no option 'gate'; its options: gate_init"):
        check("model.params.routes.0.fusion=gated", "+model.params.routes.0.fusion_options.gate=0.5")
    with pytest.raises(RouteError, match="fusion option gate_init must be float"):
        check("model.params.routes.0.fusion=gated", "+model.params.routes.0.fusion_options.gate_init=yes")
    with pytest.raises(RouteError, match="fusion must be one of none, sprint, .*gated.*, got 'gates'"):
        check("model.params.routes.0.fusion=gates")


def test_it_trains_and_restores_as_it_defines():
    torch.manual_seed(0)
    tread = dit.get_model("DiT-S/2", dict(PARAMS, routes=[ROUTE]))
    torch.manual_seed(0)
    gated = dit.get_model("DiT-S/2", dict(PARAMS, routes=[dict(ROUTE, fusion="gated")]))
    assert sorted(gated.state_dict()) == sorted([*tread.state_dict(), "fusions.0.gate.weight"])
    assert torch.equal(gated.fusions["0"].gate.weight, torch.eye(32)), "gate_init 1 survives the model's init"
    gated.load_state_dict({**tread.state_dict(), "fusions.0.gate.weight": torch.eye(32)})
    x, t, y = torch.randn(2, 4, 8, 8), torch.rand(2), torch.randint(0, 10, (2,))
    for model in (tread, gated):
        model.train()
    # gate_init 1: TREAD's restore, the same output for the same kept tokens
    torch.testing.assert_close(gated(x, t, y, routing_seed=3), tread(x, t, y, routing_seed=3), rtol=0, atol=1e-6)
    with torch.no_grad():
        gated.fusions["0"].gate.weight.mul_(0.5)
    optimizer = torch.optim.SGD(gated.parameters(), lr=0.1)
    gated(x, t, y, routing_seed=3).square().mean().backward()
    assert gated.fusions["0"].gate.weight.grad.abs().sum() > 0
    optimizer.step()


def test_the_flop_report_counts_it():
    plain = dict(PARAMS, routes=[ROUTE])
    params = dict(PARAMS, routes=[dict(ROUTE, fusion="gated")])
    analytic = analytic_training_flops("DiT-S/2", params, 2)
    assert analytic - analytic_training_flops("DiT-S/2", plain, 2) == 2 * 3 * (2 * 16 * 32 * 32)  # fwd + bwd
    measured = training_step_flops("DiT-S/2", params, 2)
    assert abs(measured - analytic) / measured < 0.01


def test_its_init_option_survives_and_it_samples_in_eval_mode_and_under_guidance():
    """No token dropped (eval, ratio 0): the module gets every index and x_deep of all N tokens. Routing guidance
    forces a ratio; path-drop guidance is refused in one line, since GATED does not declare drops_deep_path."""
    from edm.precond import EDMPrecond
    from generation import build_guided_net
    from tread_utils.errors import UserError

    torch.manual_seed(0)
    model = dit.get_model("DiT-S/2", dict(PARAMS, routes=[dict(ROUTE, fusion="gated",
                                                                fusion_options={"gate_init": 0.5})]))
    assert torch.equal(model.fusions["0"].gate.weight, 0.5 * torch.eye(32))
    seen = []
    model.fusions["0"].register_forward_hook(lambda m, args, out: seen.append(tuple(args[2].shape)))
    net = EDMPrecond(model).eval()
    x, y = torch.randn(2, 4, 8, 8), torch.randint(0, 10, (2,))
    with torch.no_grad():
        assert torch.isfinite(net(x, torch.tensor(1.0), y)).all()
        assert seen[-1] == (2, 16), "every index when no token was dropped"
        guided = build_guided_net(net, {"routing_guidance": {"scale": 1.5}})
        assert torch.isfinite(guided(x, torch.tensor(1.0), y)).all()
        assert {(2, 5), (2, 12)} <= set(seen), "routing guidance's weak and strong ratios, 0.7 and 0.3 of 16 tokens"
        with pytest.raises(UserError, match="path-drop guidance needs a route whose fusion can drop its deep path"):
            build_guided_net(net, {"path_drop_guidance": {"scale": 1.5}})
        with pytest.raises(RouteError, match="drop_deep_path"):
            model(x, torch.rand(2), y, drop_deep_path=True)
    with pytest.raises(UserError, match="path_drop_scales.*fusion can drop"):
        check("model.params.routes.0.fusion=gated", "train.eval.path_drop_scales=[1.5]")
