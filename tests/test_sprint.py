"""SPRINT fusion routes: construction, the fusion against SPRINT's formulation, path drop, bad values."""
import pytest
import torch

from dit import get_model
from routing_module import RouteError, resolve_routes, select_kept_tokens
from test_routing import inputs, route
from tread_utils.errors import UserError

SPRINT = dict(route(2, 3, 0.75), fusion="sprint")


def sprint_model(**options):
    torch.manual_seed(0)
    model = get_model("DiT-T/2", dict(num_classes=10, in_channels=1, input_size=16, enable_routing=True, depth=6,
                                      routes=[dict(SPRINT, **options)], hidden_size=32, num_heads=2))
    for name, p in model.named_parameters():  # carry signal through every block (not adaLN-Zero)
        if "fusions" not in name:
            torch.nn.init.normal_(p, std=0.05)
    return model


def test_construction_and_their_initialisation():
    model = sprint_model()
    fusion = model.fusions["0"]
    assert not fusion.mask_token.requires_grad and fusion.mask_token.abs().max() > 0
    assert fusion.proj.in_features == 64 and fusion.proj.out_features == 32 and not fusion.proj.bias.any()
    assert fusion.proj.weight.abs().max() <= (6 / (64 + 32)) ** 0.5  # xavier-uniform bound
    trained = sprint_model(mask_token_trainable=True, mask_token_init="zeros", fusion_init="deep").fusions["0"]
    assert trained.mask_token.requires_grad and not trained.mask_token.any()
    assert torch.equal(trained.proj.weight, torch.cat([torch.eye(32), torch.zeros(32, 32)], 1))


def test_state_dict_of_tread_models_is_unchanged():
    """Old checkpoints keep loading: a model without sprint routes has no fusion keys."""
    def keys(routes):
        return set(get_model("DiT-T/2", dict(num_classes=10, in_channels=1, input_size=16, enable_routing=True,
                                             routes=routes, depth=6, hidden_size=32, num_heads=2)).state_dict())

    assert keys([route(2, 3)]) == keys([])
    assert keys([SPRINT]) - keys([]) == {"fusions.0.mask_token", "fusions.0.proj.weight", "fusions.0.proj.bias"}


def reference(model, x, t, y, seed=None, drop_all=False):
    """SPRINT's formulation written out: encoder, kept tokens through the middle, restore with mask tokens by
    ids_restore (kept then removed, un-shuffled by argsort), concatenation with the encoder output, projection,
    decoder. `seed`: the router's token choice; None: no token dropped."""
    fusion = model.fusions["0"]
    h = model.x_embedder(x) + model.pos_embed
    c = model.t_embedder(t) + model.y_embedder(y)
    for block in model.blocks[:2]:
        h = block(h, c)
    x_clone = h.clone()
    B, N, D = h.shape
    if seed is None:
        ids_keep = torch.arange(N).expand(B, N)
    else:
        ids_keep = select_kept_tokens(h, 0.75, torch.Generator().manual_seed(seed))
    removed = torch.ones(B, N, dtype=torch.bool).scatter(1, ids_keep, False)
    ids_remove = torch.stack([row.nonzero().flatten() for row in removed])
    ids_restore = torch.argsort(torch.cat([ids_keep, ids_remove], 1), dim=1)
    deep = torch.gather(h, 1, ids_keep.unsqueeze(-1).repeat(1, 1, D))
    for block in model.blocks[2:4]:
        deep = block(deep, c)
    deep = torch.cat([deep, fusion.mask_token.repeat(B, N - deep.shape[1], 1)], 1)
    deep = torch.gather(deep, 1, ids_restore.unsqueeze(-1).repeat(1, 1, D))
    if drop_all:
        deep = fusion.mask_token.expand(B, N, D)
    h = fusion.proj(torch.cat([deep, x_clone], -1))
    for block in model.blocks[4:]:
        h = block(h, c)
    return model.unpatchify(model.final_layer(h, c))


def test_fusion_matches_their_formulation():
    model = sprint_model(path_drop_prob=0.0)
    x, t, y = inputs()
    with torch.no_grad():
        routed = model.train()(x, t, y, routing_seed=3)
        torch.testing.assert_close(routed, reference(model, x, t, y, seed=3), rtol=1e-5, atol=1e-6)
        dense = model.eval()(x, t, y)  # inference: no token dropped, the fusion still applies
        torch.testing.assert_close(dense, reference(model, x, t, y), rtol=1e-5, atol=1e-6)


def test_path_drop_in_training_gives_only_mask_tokens_from_the_deep_path():
    model = sprint_model(path_drop_prob=0.5).train()
    fusion, seen = model.fusions["0"], []
    fusion.proj.register_forward_hook(lambda m, args, out: seen.append(args[0].detach()))
    torch.manual_seed(1)
    model(*inputs(batch=8))
    deep = seen[0][..., :32]  # the restored deep half of the projection's input
    dropped = (deep == fusion.mask_token).all(-1).all(-1)
    assert 0 < dropped.sum() < 8, "with p = 0.5 over 8 samples (seeded) some are dropped, some not"
    kept = deep[~dropped]
    assert ((kept == fusion.mask_token).all(-1).sum(1) == 48).all(), "others: mask tokens at the 48 dropped places"
    seen.clear()
    model.eval()(*inputs(batch=8))
    assert not (seen[0][..., :32] == fusion.mask_token).all(-1).any(), "no drop at inference"


def test_drop_deep_path_skips_the_deep_blocks():
    model = sprint_model().eval()
    calls = []
    for i, block in enumerate(model.blocks):
        block.register_forward_hook(lambda m, args, out, i=i: calls.append(i))
    x, t, y = inputs()
    with torch.no_grad():
        weak = model(x, t, y, drop_deep_path=True)
        assert calls == [0, 1, 4, 5]
        torch.testing.assert_close(weak, reference(model, x, t, y, drop_all=True), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("option, needle", [(dict(fusion="sprnt"), "fusion must be one of none, sprint"),
                                            (dict(path_drop_prob=1.0), "path_drop_prob"),
                                            (dict(mask_token_init="uniform"), "mask_token_init"),
                                            (dict(fusion_init="zero"), "fusion_init"),
                                            (dict(mask_token_trainable="yes"), "mask_token_trainable")])
def test_bad_fusion_value_is_one_clear_line(option, needle):
    with pytest.raises(RouteError, match=needle):
        resolve_routes([dict(SPRINT, **option)], 6)
    assert issubclass(RouteError, UserError)


def test_config_check_and_flop_count_know_sprint_routes():
    from hydra import compose, initialize_config_dir

    from conftest import REPO
    from training.config_check import check_train_config
    from training.flops import analytic_training_flops, training_step_flops

    def check(*overrides):
        with initialize_config_dir(config_dir=str(REPO / "configs"), version_base="1.3"):
            return check_train_config(compose("config", overrides=list(overrides)))

    assert check("model.params.routes.0.fusion=sprint").model.params.routes[0].path_drop_prob == 0.1
    with pytest.raises(UserError, match="fusion must be one of none, sprint"):
        check("model.params.routes.0.fusion=sprnt")
    params = dict(num_classes=10, in_channels=4, input_size=32, enable_routing=True, routes=[SPRINT])
    measured, analytic = training_step_flops("DiT-S/2", params, 2), analytic_training_flops("DiT-S/2", params, 2)
    assert abs(measured - analytic) / measured < 0.01


def test_path_drop_guidance_weak_branch_is_the_model_with_its_path_dropped():
    from edm.guidance import PathDropGuidance
    from edm.precond import EDMPrecond
    from generation import build_guided_net

    model = sprint_model().eval()
    net = EDMPrecond(model)
    x, _, y = inputs()
    sigma = torch.tensor(2.0)
    with torch.no_grad():
        weak, full = net(x, sigma, y, drop_deep_path=True), net(x, sigma, y)
        guided = build_guided_net(net, {"path_drop_guidance": {"scale": 1.5}, "guidance_interval": [1, 3]})
        assert isinstance(guided, PathDropGuidance)
        torch.testing.assert_close(guided(x, sigma, y), weak + 1.5 * (full - weak))
        torch.testing.assert_close(guided(x, torch.tensor(5.0), y), net(x, torch.tensor(5.0), y))  # outside
        assert PathDropGuidance(net, 0.0)(x, sigma, y).equal(weak)
    with pytest.raises(UserError, match="SPRINT routes"):
        build_guided_net(EDMPrecond(get_model("DiT-T/2", dict(num_classes=10, in_channels=1, input_size=16,
                                                              enable_routing=False, depth=2))),
                         {"path_drop_guidance": {"scale": 1.5}})
