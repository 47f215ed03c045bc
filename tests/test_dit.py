"""dit.py: the initialisation switch (the authors' default against DiT's adaLN-Zero) and the authors' model keys."""
import math
import os

import pytest
import torch

from dit import get_model
from tread_utils.errors import UserError

DATA = dict(num_classes=10, in_channels=4, input_size=32)


def expected_init(name: str, shape) -> tuple:
    """(distribution, std) that the authors' `initialize_weights` gives parameter `name`."""
    if name.endswith("bias"):
        return "zero", 0.0
    if name in ("y_embedder.embedding_table.weight", "t_embedder.mlp.0.weight", "t_embedder.mlp.2.weight"):
        return "normal", 0.02
    fan_out, fan_in = shape[0], math.prod(shape[1:])  # the patch embedding is xavier on its flattened kernel
    return "xavier", math.sqrt(2.0 / (fan_in + fan_out))


@pytest.mark.parametrize("backbone", ["DiT-S/2", "DiT-T/2"])
def test_official_init_gives_every_parameter_the_authors_statistics(backbone):
    torch.manual_seed(0)
    model = get_model(backbone, DATA)  # no init key: the authors' init
    for name, p in model.named_parameters():
        kind, std = expected_init(name, p.shape)
        if kind == "zero":
            assert torch.count_nonzero(p) == 0, name
            continue
        assert abs(p.std().item() / std - 1) < 0.05, (name, p.std().item(), std)
        assert abs(p.mean().item()) < 4 * std / math.sqrt(p.numel()), name
        if kind == "xavier":  # uniform on [-a, a] with a = sqrt(3) std
            assert p.abs().max().item() <= math.sqrt(3) * std * (1 + 1e-6), name


def test_official_output_is_not_zero_and_adaln_zero_is():
    torch.manual_seed(0)
    x, t, y = torch.randn(4, 4, 32, 32), torch.randn(4), torch.randint(0, 10, (4,))
    official = get_model("DiT-S/2", {**DATA, "init": "official"})(x, t, y)
    assert 0.8 < official.std().item() < 1.5  # the authors' fresh DiT-S/2: std about 1.1
    zero = get_model("DiT-S/2", {**DATA, "init": "adaln_zero"})
    assert torch.count_nonzero(zero(x, t, y)) == 0
    for name in ("blocks.0.adaLN_modulation.1.weight", "final_layer.adaLN_modulation.1.weight",
                 "final_layer.linear.weight"):
        assert torch.count_nonzero(zero.get_parameter(name)) == 0, name


def test_hydra_model_configs_default_to_the_authors_init():
    from hydra import compose, initialize_config_dir

    from conftest import REPO

    for model in ("dit", "tread"):
        with initialize_config_dir(config_dir=str(REPO / "configs"), version_base="1.3"):
            cfg = compose("config", overrides=[f"model={model}"])
        assert cfg.model.params.init == "official"
        assert cfg.model.params.cond_mode == "adaln" and cfg.model.params.learn_sigma is False


@pytest.mark.parametrize("key, value, needle", [
    ("init", "xavier", "model.params.init must be one of official, adaln_zero"),
    ("cond_mode", "cross_attn", "model.params.cond_mode='cross_attn' is not supported: only 'adaln'"),
    ("learn_sigma", True, "model.params.learn_sigma=True is not supported: only False"),
])
def test_unsupported_values_are_refused_in_one_line(key, value, needle):
    with pytest.raises(UserError) as e:
        get_model("DiT-T/2", {**DATA, key: value})
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_the_authors_model_keys_are_accepted():
    """Their values build the model the keys' absence builds: the same parameters and the same output."""
    models = []
    for extra in ({"cond_mode": "adaln", "learn_sigma": False}, {}):
        torch.manual_seed(0)
        models.append(get_model("DiT-T/2", {**DATA, **extra}).eval())
    theirs, ours = (dict(m.state_dict()) for m in models)
    assert theirs.keys() == ours.keys() and all(torch.equal(theirs[k], ours[k]) for k in ours)
    g = torch.Generator().manual_seed(1)
    x, t, y = torch.randn(2, 4, 32, 32, generator=g), torch.rand(2, generator=g), torch.tensor([3, 7])
    out = models[0](x, t, y)
    assert out.shape == x.shape and torch.equal(out, models[1](x, t, y))  # no variance channels: learn_sigma off


@pytest.mark.skipif(not os.environ.get("TREAD_PAPER_CODE"), reason="set TREAD_PAPER_CODE=<clone of CompVis/tread>")
def test_official_init_matches_the_paper_code_parameter_by_parameter():
    from lab.paper_code import load_paper_dit

    theirs_module = load_paper_dit(os.environ["TREAD_PAPER_CODE"])
    torch.manual_seed(0)
    theirs = dict(theirs_module.DiT_models["DiT-S/2"](**DATA).named_parameters())
    ours = dict(get_model("DiT-S/2", DATA).named_parameters())
    shared = sorted(set(theirs) & set(ours))
    assert len(shared) == len(ours)  # every parameter of ours is one of theirs
    for name in shared:
        a, b = ours[name], theirs[name]
        assert a.shape == b.shape, name
        if torch.count_nonzero(b) == 0:
            assert torch.count_nonzero(a) == 0, name
            continue
        assert abs(a.std().item() / b.std().item() - 1) < 0.05, name
        assert abs(a.mean().item() - b.mean().item()) < 5 * b.std().item() / math.sqrt(b.numel()), name


def test_force_keep_tokens_reach_the_routed_blocks():
    """force_keep through the model (training mode, route 1 -> 2 keeping 16 of 64 tokens): hooks on the blocks
    count max(16, most forced in a sample) = 40 tokens inside the route, and every forced token of block 0's
    output enters block 1 unchanged."""
    torch.manual_seed(0)
    route = dict(start_layer_idx=1, end_layer_idx=2, selection_ratio=0.75)
    model = get_model("DiT-T/2", dict(num_classes=10, in_channels=1, input_size=16, depth=4, hidden_size=32,
                                      num_heads=2, enable_routing=True, routes=[route])).train()
    seen = {}

    def record(i):
        def hook(module, args, out):
            seen[i] = (args[0].detach(), out.detach())
        return hook

    for i, block in enumerate(model.blocks):
        block.register_forward_hook(record(i))
    force = torch.zeros(3, 64, dtype=torch.bool)
    force[0, :5] = True
    force[1, 10:50] = True
    with torch.no_grad():
        model(torch.randn(3, 1, 16, 16), torch.rand(3), torch.tensor([1, 2, 3]), force_keep=force)
    assert [seen[i][0].shape[1] for i in range(4)] == [64, 40, 40, 64]
    entering, block_0_out = seen[1][0], seen[0][1]
    for b, token in force.nonzero().tolist():
        assert (entering[b] == block_0_out[b, token]).all(-1).any(), (b, token)
