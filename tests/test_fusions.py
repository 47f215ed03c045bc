"""A restore strategy registered from outside the model file: one entry of `dit.RESTORES` (routing_module.Restore)
is accepted by the config with its options checked from its signature, trains, is counted by the FLOP report,
and restores the sequence as it defines."""
import pytest
import torch
import torch.nn as nn
from hydra import compose, initialize_config_dir

import dit
import routing_module
from conftest import REPO
from routing_module import Restore, RouteError
from training.config_check import check_train_config
from training.flops import analytic_training_flops, training_step_flops


class GatedRestore(nn.Module):
    """The skipped tokens rejoin (end_route), then every token moves by a learned linear gate of its change along
    the route: x_shallow + W (restored - x_shallow), W starting at gate_init * I (1: TREAD's restore exactly)."""

    def __init__(self, hidden_size: int, gate_init: float):
        super().__init__()
        self.gate = nn.Linear(hidden_size, hidden_size, bias=False)
        self.gate_init = gate_init

    def reset_parameters(self):
        with torch.no_grad():
            self.gate.weight.copy_(self.gate_init * torch.eye(self.gate.in_features))

    def forward(self, x_deep, x_shallow, keep_idx):
        restored = routing_module.end_route(x_deep, x_shallow, keep_idx)
        return x_shallow + self.gate(restored - x_shallow)


def build_gated(hidden_size, route, *, gate_init: float = 1.0):
    return GatedRestore(hidden_size, gate_init)


GATED = Restore(build=build_gated, flops=lambda hidden, tokens: 2 * tokens * hidden * hidden)
ROUTE = {"selection_ratio": 0.5, "start_layer_idx": 1, "end_layer_idx": 2}
PARAMS = dict(input_size=8, depth=4, hidden_size=32, num_heads=2, num_classes=10, in_channels=4,
              enable_routing=True)


@pytest.fixture(autouse=True)
def gated(monkeypatch):
    monkeypatch.setitem(dit.RESTORES, "gated", GATED)


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
