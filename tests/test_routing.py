"""The TREAD router: token counts, identity path, ratio 0, eval mode, gradients, validation, FLOPs."""
import pytest
import torch

from dit import get_model
from tread_utils.errors import UserError
from training.flops import routing_flop_report
from routing_module import RouteError, end_route, num_kept, resolve_routes, select_kept_tokens, start_route


def small_model(routes, depth=6, enable_routing=True, **extra):
    torch.manual_seed(0)
    model = get_model("DiT-T/2", dict(num_classes=10, in_channels=1, input_size=16, enable_routing=enable_routing,
                                      routes=routes, depth=depth, hidden_size=32, num_heads=2, **extra))
    for p in model.parameters():  # leave adaLN-Zero: make every path carry signal
        torch.nn.init.normal_(p, std=0.05)
    return model


def route(start, end, ratio=0.5):
    return dict(start_layer_idx=start, end_layer_idx=end, selection_ratio=ratio)


def inputs(batch=3, seed=1):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, 1, 16, 16, generator=g), torch.rand(batch, generator=g),
            torch.randint(0, 11, (batch,), generator=g))


def record_block_io(model):
    seen = []
    hooks = [b.register_forward_hook(lambda m, args, out, i=i: seen.append((i, args[0].detach().clone(),
                                                                             out.detach().clone())))
             for i, b in enumerate(model.blocks)]
    return seen, hooks


def test_token_count_inside_route_and_skipped_tokens_unchanged():
    model = small_model([route(1, 3, 0.5)]).train()
    seen, _ = record_block_io(model)
    x, t, y = inputs()
    model(x, t, y)
    n = 64
    counts = {i: inp.shape[1] for i, inp, _ in seen}
    assert counts == {0: n, 1: num_kept(n, 0.5), 2: 32, 3: 32, 4: n, 5: n}
    before_route = seen[0][2]  # output of block 0 = what enters the route
    after_route = seen[4][1]   # input of block 4 = the restored sequence
    kept_out = seen[3][2]
    changed = (after_route != before_route).any(-1)  # [B, N]: True where a token went through the blocks
    assert (changed.sum(1) == 32).all(), "exactly the kept tokens are processed"
    skipped = ~changed
    assert torch.equal(after_route[skipped], before_route[skipped]), "skipped tokens come back bit-identical"
    assert torch.equal(after_route[changed].reshape(3, 32, -1), kept_out), "kept tokens return in order"


def test_per_sample_selection_differs():
    model = small_model([route(1, 3, 0.5)]).train()
    seen, _ = record_block_io(model)
    x, t, y = inputs(batch=4)
    model(x, t, y)
    restored = seen[4][1]
    changed = (restored != seen[0][2]).any(-1)
    assert len({tuple(row.tolist()) for row in changed}) > 1


def test_ratio_zero_and_eval_mode_give_unrouted_output():
    x, t, y = inputs()
    dense = small_model([route(1, 3, 0.5)], enable_routing=False).train()(x, t, y)
    zero = small_model([route(1, 3, 0.0)]).train()(x, t, y)
    assert torch.equal(dense, zero)
    model = small_model([route(1, 3, 0.5)]).eval()
    seen, _ = record_block_io(model)
    assert torch.equal(model(x, t, y), dense)
    assert all(inp.shape[1] == 64 for _, inp, _ in seen), "eval mode never routes"


def test_force_routing_ratio_and_seed_at_inference():
    model = small_model([route(1, 3, 0.5)]).eval()
    seen, _ = record_block_io(model)
    x, t, y = inputs()
    a = model(x, t, y, force_routing_ratio=0.75, routing_seed=3)
    assert seen[2][1].shape[1] == num_kept(64, 0.75)
    b = model(x, t, y, force_routing_ratio=0.75, routing_seed=3)
    c = model(x, t, y, force_routing_ratio=0.75, routing_seed=4)
    assert torch.equal(a, b) and not torch.equal(a, c)
    with pytest.raises(RouteError):
        small_model([]).eval()(x, t, y, force_routing_ratio=0.5)


def test_gradients_reach_every_parameter_and_token():
    model = small_model([route(1, 3, 0.5), route(4, -1, 0.25)]).train()
    x, t, y = inputs(batch=4)
    y[0] = 10  # the null class row also learns
    x.requires_grad_(True)
    model(x, t, y).square().sum().backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
    assert (x.grad.abs() > 0).all(), "every input pixel (so every token) receives gradient"


def test_two_routes_token_counts():
    model = small_model([route(0, 1, 0.25), route(3, -1, 0.75)]).train()
    seen, _ = record_block_io(model)
    model(*inputs())
    assert [inp.shape[1] for _, inp, _ in seen] == [48, 48, 64, 16, 16, 16]


def test_fp32_block_after_route_under_autocast():
    """The block right after a route ends computes in float32; the others follow autocast."""
    model = small_model([route(1, 2, 0.5)]).train()
    dtypes = {}
    for i, block in enumerate(model.blocks):
        block.attn.qkv.register_forward_hook(lambda m, a, out, i=i: dtypes.__setitem__(i, out.dtype))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(*inputs())
    assert dtypes[3] == torch.float32
    assert {dtypes[i] for i in (0, 1, 2, 4, 5)} == {torch.bfloat16}


@pytest.mark.parametrize("routes, needle", [
    ([route(2, 12)], "outside a model of depth 12"),
    ([route(-13, 5)], "outside a model of depth 12"),
    ([route(8, 2)], "comes after"),
    ([route(2, 8, 1.0)], "[0, 1)"),
    ([route(2, 8, -0.1)], "[0, 1)"),
    ([route(2, 6), route(5, 9)], "overlaps"),
    ([route(6, 9), route(1, 3)], "overlaps or comes before"),
    ([{"start_layer_idx": 2}], "needs integer"),
])
def test_invalid_routes_name_route_and_depth(routes, needle):
    with pytest.raises(RouteError) as info:
        resolve_routes(routes, 12)
    assert needle in str(info.value) and "route" in str(info.value)


def test_negative_indices_count_from_the_last_block():
    assert resolve_routes([route(2, -4)], 12)[0].end_layer_idx == 8
    assert resolve_routes([route(2, -4)], 28)[0].end_layer_idx == 24
    assert resolve_routes([route(-1, -1)], 12)[0].start_layer_idx == 11


def test_the_primitives_route_any_token_stack():
    """select_kept_tokens / start_route / end_route need no DiT part: plain Linear blocks, routed 1 -> 3 as a
    model's block loop does (DiT.forward, the diffusers hooks)."""
    torch.manual_seed(0)
    blocks = [torch.nn.Linear(8, 8) for _ in range(5)]
    h = torch.randn(2, 10, 8)
    sizes = []
    for i, block in enumerate(blocks):
        if i == 1:
            h_route, keep = h, select_kept_tokens(h, 0.5)
            h = start_route(h, keep)
        sizes.append(h.shape[1])
        h = block(h)
        if i == 3:
            h = restored = end_route(h, h_route, keep)
    assert sizes == [10, 5, 5, 5, 10] and keep.shape == (2, 5)
    skipped = torch.ones(2, 10, dtype=torch.bool).scatter(1, keep, False)
    assert torch.equal(restored[skipped], h_route[skipped]), "skipped tokens rejoin unchanged"


def test_unknown_backbone_and_param():
    with pytest.raises(UserError, match="unknown backbone"):
        get_model("DiT-Q/2", dict(num_classes=10, in_channels=1, input_size=16))
    with pytest.raises(UserError, match="unknown model.params"):
        get_model("DiT-T/2", dict(num_classes=10, in_channels=1, input_size=16, learn_sigmaa=True))


def test_dit_b2_training_flops_fall_about_1_4x():
    params = dict(num_classes=1000, in_channels=4, input_size=32, enable_routing=True, routes=[route(2, 8, 0.5)])
    report = routing_flop_report("DiT-B/2", params, batch_size=1)
    assert report["flops_per_step_dense"] == pytest.approx(3 * 2 * 23.01e9, rel=0.01)  # paper's 23.01 GMACs
    assert 1.35 < report["flop_speedup_bound"] < 1.5


def test_importance_selection_keeps_the_highest_norm_tokens():
    from routing_module import select_kept_tokens

    x = torch.randn(4, 64, 16)
    keep = select_kept_tokens(x, 0.5, selection="importance", importance_mix=1.0)
    top = x.abs().sum(-1).topk(32, dim=1).indices.sort(dim=1).values
    assert torch.equal(keep, top)
    # and through the model: what enters the route is the highest-norm half of block 0's output
    model = small_model([dict(route(1, 3, 0.5), selection="importance", importance_mix=1.0)]).train()
    seen, _ = record_block_io(model)
    model(*inputs())
    norms = seen[0][2].abs().sum(-1)
    expect = norms.topk(32, dim=1).indices.sort(dim=1).values
    assert torch.equal(seen[1][1], torch.gather(seen[0][2], 1, expect.unsqueeze(-1).expand(-1, -1, 32)))


def test_importance_mix_zero_is_uniform():
    from routing_module import select_kept_tokens

    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 16, 8) * torch.arange(1, 17).view(1, 16, 1)  # strongly varying norms
    counts = torch.zeros(16)
    for _ in range(2000):
        counts[select_kept_tokens(x, 0.5, g, "importance", importance_mix=0.0)[0]] += 1
    freq = counts / 2000
    assert (freq - 0.5).abs().max() < 0.05, freq  # 4.5 sigma for a binomial(2000, 0.5)


def test_importance_mix_between_zero_and_one_keeps_the_documented_mix():
    """importance_mix=0.3: the kept tokens are the top-k of 0.3 * min-max-normalised L1 norm + 0.7 * the
    seeded uniform draw (the module docstring's formula, recomputed here from the same seed); over many
    samples a token is kept more often the larger its norm, yet neither always nor never."""
    from routing_module import select_kept_tokens

    mix, batch, n = 0.3, 4000, 16
    x = torch.randn(1, n, 8).sign() * torch.arange(1, n + 1).view(1, n, 1)  # L1 norm 8, 16, ..., 128
    x = x.expand(batch, -1, -1)
    keep = select_kept_tokens(x, 0.5, torch.Generator().manual_seed(3), "importance", importance_mix=mix)
    noise = torch.rand(batch, n, generator=torch.Generator().manual_seed(3))
    norm = torch.arange(n) / (n - 1)  # (norm - min) / (max - min)
    expect = (mix * norm + (1 - mix) * noise).topk(8, dim=1).indices.sort(dim=1).values
    assert torch.equal(keep, expect)
    freq = torch.zeros(n).index_add_(0, keep.flatten(), torch.ones(keep.numel())) / batch
    assert 0.02 < freq[0] < 0.3 and 0.7 < freq[-1] < 0.98, freq  # a mix: not uniform, not the top half
    assert torch.all(freq[1:] > freq[:-1] - 0.03), freq  # rising with the norm (binomial noise ~0.008)


def test_force_keep_tokens_are_never_skipped():
    from routing_module import select_kept_tokens

    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 64, 8)
    force = torch.zeros(3, 64, dtype=torch.bool)
    force[0, :5] = True
    force[1, 10:50] = True  # more than the 32 a ratio of 0.5 keeps: the batch keeps 40
    for _ in range(50):
        keep = select_kept_tokens(x, 0.5, g, force_keep=force)
        assert keep.shape == (3, 40)
        for b in range(3):
            assert set(force[b].nonzero().flatten().tolist()) <= set(keep[b].tolist())
    model = small_model([route(1, 3, 0.75)]).train()
    out = model(*inputs(batch=3), force_keep=force[:, :64])
    assert out.shape == (3, 1, 16, 16)


def test_route_selection_validation():
    with pytest.raises(RouteError, match="selection must be one of random, importance.*, got 'norm'"):
        resolve_routes([dict(route(2, 8), selection="norm")], 12)
    with pytest.raises(RouteError, match="importance_mix"):
        resolve_routes([dict(route(2, 8), selection="importance", importance_mix=1.5)], 12)


def test_unknown_route_key_is_refused_listing_the_accepted_ones():
    with pytest.raises(RouteError, match=r"unknown key\(s\) \['importance_mx'\]; accepted: start_layer_idx"):
        resolve_routes([dict(route(2, 8), selection="importance", importance_mx=0.5)], 12)


@pytest.mark.parametrize("spec, message", [
    (dict(start_layer_idx=2, end_layer_idx=2.5, selection_ratio=0.5), "route 0: end_layer_idx must be an integer, got 2.5"),
    (dict(start_layer_idx=True, end_layer_idx=4, selection_ratio=0.5), "start_layer_idx must be an integer, got True"),
    (dict(start_layer_idx=2, end_layer_idx=4, selection_ratio=False), "selection_ratio must be a number, got False"),
    (dict(start_layer_idx=2, end_layer_idx="4", selection_ratio=0.5), "end_layer_idx must be an integer, got '4'"),
    (dict(start_layer_idx=2, selection_ratio=0.5), "it has no end_layer_idx$"),
])
def test_a_route_value_is_never_converted_into_another(spec, message):
    """A float block index is not truncated, a boolean is not a ratio (an exported config.json or apply_tread's
    routes reach resolve_routes without the config's typed schema); a missing key is named, not the route."""
    with pytest.raises(RouteError, match=message):
        resolve_routes([spec], 12)
    assert resolve_routes([dict(start_layer_idx=2, end_layer_idx=4.0, selection_ratio=0)], 12)[0].end_layer_idx == 4


def test_a_route_built_in_python_with_negative_indices_is_placed_by_the_model():
    from tread_utils.route_spec import Route

    model = small_model([Route(1, -3, 0.5)])
    assert model.router.routes[0].end_layer_idx == 3
    with pytest.raises(RouteError, match="outside a model of depth 6"):
        small_model([Route(1, 7, 0.5)])
