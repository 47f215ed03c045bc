"""A selection rule is one function in routing_module.SELECTIONS. Registered here, in this file alone, a rule is
accepted by the config and its check, has its options checked against its signature, appears in the
configuration reference, and routes the tokens it scores highest in a training step."""
from typing import Annotated

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

import routing_module
from conftest import REPO
from dit import get_model
from edm import EDMLoss, EDMPrecond
from routing_module import RouteError, resolve_routes
from training.config_check import check_train_config
from training.loop import build_adamw


def by_position(x, generator, *, last: bool = False, weight: Annotated[float, 0.0, 2.0] = 1.0):
    """Tokens by their position in the sequence: the first ones (last=true: the last ones)."""
    position = torch.arange(x.shape[1], device=x.device, dtype=torch.float32).expand(x.shape[0], -1)
    return weight * (position if last else -position)


@pytest.fixture
def rule(monkeypatch):
    monkeypatch.setitem(routing_module.SELECTIONS, "by_position", by_position)


def compose_train(*overrides):
    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base="1.3"):
        return compose("config", overrides=["model=tread", *overrides])


def test_a_rule_registered_here_trains_a_step_routing_the_tokens_it_scores_highest(rule, monkeypatch, tmp_path):
    cfg = compose_train("model.params.routes.0.selection=by_position", "+model.params.routes.0.options.last=true",
                        f"results_dir={tmp_path}")
    merged = check_train_config(cfg).config
    params = OmegaConf.to_container(merged.model.params)
    model = get_model(merged.model.backbone_type, params).train()
    route, = model.router.routes
    assert (route.selection, route.options) == ("by_position", {"last": True})

    routed = []
    start_route = routing_module.start_route
    monkeypatch.setattr(routing_module, "start_route", lambda x, keep: routed.append(keep) or start_route(x, keep))
    torch.manual_seed(0)
    p = merged.dataset
    x, y = torch.randn(4, p.in_channels, p.input_size, p.input_size), torch.randint(0, p.num_classes, (4,))
    optimizer = build_adamw(list(model.parameters()))
    before = [q.detach().clone() for q in model.parameters()]
    loss = EDMLoss()(EDMPrecond(model), x, y).mean()
    loss.backward()
    optimizer.step()
    assert torch.isfinite(loss) and any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))

    keep, = routed
    n = model.x_embedder.num_patches
    k = routing_module.num_kept(n, route.selection_ratio)
    assert torch.equal(keep, torch.arange(n - k, n).expand(4, -1))  # the last tokens: the highest scores


def test_a_rules_options_are_checked_against_its_signature(rule):
    base = dict(start_layer_idx=2, end_layer_idx=8, selection_ratio=0.5, selection="by_position")
    assert resolve_routes([dict(base, options={"weight": 2})], 12)[0].options == {"weight": 2.0}
    for options, message in (({"lats": True}, "selection by_position has no option 'lats'; its options: last, weight"),
                             ({"last": "yes"}, "selection option last must be bool, got 'yes'"),
                             ({"weight": 2.5}, r"weight must be in \[0.0, 2.0\], got 2.5"),
                             ({"weight": True}, "selection option weight must be float, got True")):
        with pytest.raises(RouteError, match=message):
            resolve_routes([dict(base, options=options)], 12)
    with pytest.raises(RouteError, match="selection must be one of random, importance, .*by_position.*, got 'by_pos'"):
        resolve_routes([dict(base, selection="by_pos")], 12)
    with pytest.raises(RouteError, match="selection random has no option 'importance_mix'"):
        resolve_routes([dict(base, selection="random", importance_mix=0.5)], 12)  # not silently ignored


def test_the_configuration_reference_lists_the_registered_rules(rule):
    from tools import config_doc

    section = config_doc.selection_rules()
    assert "| `by_position` | Tokens by their position in the sequence: the first ones (last=true: the last " \
           "ones). | `last` (bool; default false), `weight` (float, [0.0, 2.0]; default 1.0) |" in section
    assert "| `importance` |" in section and "`importance_mix` (float, [0.0, 1.0]; default 0.0)" in section
