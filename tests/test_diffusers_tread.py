"""TREAD on diffusers transformers (tread_diffusers/tread.py): one set of checks per family, on tiny
random models built offline, each routed forward compared with a reference gathered and scattered here."""
import functools
import inspect
import math

import pytest
import torch

pytest.importorskip("diffusers")
from diffusers_tiny import (TINY, B, blocks_of, bound, build, packed, reference_forward,  # noqa: E402
                            shared_checks, token_key)
from tread_diffusers import apply_tread  # noqa: E402
from tread_diffusers.families import family_of  # noqa: E402
from tread_diffusers.tread import MISSING_ROUTES, masked_loss  # noqa: E402
from tread_utils.errors import UserError  # noqa: E402

FAMILIES = shared_checks()  # every tiny entry the checks here run on as they are (tests/diffusers_tiny_*.py)
ROUTE = {"routes": [{"selection_ratio": 0.5, "start_layer_idx": 1, "end_layer_idx": -2}]}  # FLUX: dual 1, single 0


def run(model, inputs):
    out = model(**inputs)[0]
    return torch.stack(out) if isinstance(out, list) else out  # Z-Image: one latent per sample


def training_loss(model, inputs):
    """The mean squared output; LTX-2 returns (video, audio), both denoised, so both join the loss."""
    out = model(**inputs)
    parts = out if isinstance(out, tuple) else (out[0],)
    return sum((torch.stack(p) if isinstance(p, list) else p).square().mean() for p in parts)  # Z-Image: a list


def capture_image_output(model, block):
    seen, image_first = {}, family_of(model).out_index == 0

    def hook(module, args, output):
        seen["x"] = output if isinstance(output, torch.Tensor) else output[0 if image_first else 1]
    return seen, block.register_forward_hook(hook)


@pytest.mark.parametrize("name", FAMILIES)
def test_off_ratio_zero_eval_no_grad_and_remove_are_bit_identical(name):
    model, inputs, _ = build(name)
    model.train()
    base = run(model, inputs)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    handle = apply_tread(model, {"routes": [{"selection_ratio": 0.0, "start_layer_idx": 1, "end_layer_idx": 2}]})
    assert torch.equal(run(model, inputs), base)
    handle.remove()
    handle = apply_tread(model, ROUTE)
    assert not torch.equal(run(model, inputs), base)  # routing is on in training
    with torch.no_grad():
        assert torch.equal(run(model, inputs), base)
    model.eval()
    assert torch.equal(run(model, inputs), base)
    model.train()
    handle.remove()
    assert torch.equal(run(model, inputs), base)
    assert not hasattr(model, "_tread_handle")
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in model.modules())
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())


SINGLE_STREAM_ROUTE = {"routes": [{"selection_ratio": 0.5, "start_layer_idx": -2, "end_layer_idx": -2}]}


@pytest.mark.parametrize("name,variant", [*((n, None) for n in FAMILIES), ("wan", "per_token_t"),
                                          ("ltx", "per_token_t"), ("auraflow", "single_stream"),
                                          ("flux2", "single_stream"), ("chroma", "single_stream"),
                                          ("chroma", "text_mask"), ("hunyuan", "single_stream"),
                                          ("cosmos", "per_frame_t"), ("ltx2", "per_token_t"),
                                          ("ltx2_split", "per_token_t"), ("ltx2", "self_mask")])
def test_routed_forward_matches_hand_built_reference(name, variant):
    model, inputs, grid = build(name)
    n = math.prod(grid)
    if variant == "per_token_t":  # Wan 2.2 TI2V, LTX-Video's conditioning frames: a per-token embedding per block
        inputs["timestep"] = torch.randint(0, 1000, (B, n))
        if "audio_hidden_states" in inputs:  # LTX-2's audio then needs its own
            inputs["audio_timestep"] = torch.randint(0, 1000, (B,))
    if variant == "self_mask":  # LTX-2's video self-attention mask (IC-LoRA), [B, N, N] in [0, 1]
        inputs["video_self_attention_mask"] = (torch.rand(B, n, n) < 0.7).float().maximum(torch.eye(n))
    if variant == "per_frame_t":  # Cosmos video-to-world: a timestep per frame [B, 1, F, 1, 1]
        inputs["timestep"] = torch.rand(B, 1, grid[0], 1, 1)
    if variant == "text_mask":  # Chroma's mask over [text, image]: the second sample's last two text tokens are padding
        inputs["attention_mask"] = torch.ones(B, 5 + n, dtype=torch.bool)
        inputs["attention_mask"][1, 3:5] = False
    route = SINGLE_STREAM_ROUTE if variant == "single_stream" else ROUTE
    handle = apply_tread(model, route)
    blocks = blocks_of(model)
    last, hook = capture_image_output(model, blocks[-1])
    model.train()
    run(model, inputs)
    hook.remove()
    keep = handle.last_keep[0]
    start, end = handle.routes[0].start_layer_idx, handle.routes[0].end_layer_idx
    spec = route["routes"][0]
    assert (start, end) == (spec["start_layer_idx"] % len(blocks), spec["end_layer_idx"] % len(blocks))
    assert keep.shape == (B, n // 2) and not torch.equal(keep[0], keep[1])  # each sample its own tokens
    assert keep.max() < n  # of the target image: reference-image tokens (Qwen-Image-Edit) are never routed
    model.eval()
    with torch.no_grad():
        ref = reference_forward(name, model, inputs, keep, start, end, n)
        torch.testing.assert_close(last["x"], ref, rtol=1e-5, atol=1e-5)
        # the unrouted last block differs: the check can tell routed from unrouted
        every = torch.arange(n).expand(B, -1)
        assert not torch.allclose(reference_forward(name, model, inputs, every, start, end, n), ref, atol=1e-4)


def rope_tables_seen(name, model):
    """Hooks on every block's self-attention that keep the RoPE table it is given, per block."""
    seen, hooks = {}, []
    attention, argument = TINY[name].rope_attention
    for i, block in enumerate(blocks_of(model)):
        attn = getattr(block, attention) if attention else block.attn1 if hasattr(block, "attn1") else block.attn

        def hook(module, args, kwargs, i=i):
            seen[i] = kwargs[argument] if argument in kwargs else args[3]
        hooks.append(attn.register_forward_pre_hook(hook, with_kwargs=True))
    return seen, hooks


def rope_cases():
    """Every entry whose RoPE the check covers (`Tiny.angles`); a video family's at one frame and at three."""
    cases = []
    for name, tiny in TINY.items():
        if tiny.angles is not None and not tiny.checked_by:
            video = "frames" in inspect.signature(tiny.build).parameters
            cases += [(name, 1), (name, 3)] if video else [(name, None)]
    return cases


@pytest.mark.parametrize("name,frames", rope_cases())
def test_rope_each_kept_token_keeps_its_angles(name, frames):
    model, inputs, _ = build(name, **({} if frames is None else {"frames": frames}))
    seen, hooks = rope_tables_seen(name, model)
    model.eval()
    with torch.no_grad():
        run(model, inputs)
    full = {i: cos_sin for i, cos_sin in seen.items()}
    handle = apply_tread(model, ROUTE)
    model.train()
    run(model, inputs)
    keep, r = handle.last_keep[0], handle.routes[0]
    text = inputs["encoder_hidden_states"].shape[1]
    shuffled = keep[:, torch.randperm(keep.shape[1])]
    for i, (cos, sin) in seen.items():
        if r.start_layer_idx <= i <= r.end_layer_idx:
            assert not torch.equal(keep[0], keep[1])  # each sample its own tokens and angles
            angles = TINY[name].angles
            assert angles(cos, full[i][0], keep, text) and angles(sin, full[i][1], keep, text)
            assert not angles(cos, full[i][0], shuffled, text)
        else:
            assert torch.equal(cos, full[i][0])
    for hook in hooks:
        hook.remove()


def input_grads(name, model, inputs):
    key = token_key(inputs)
    x = inputs[key].clone().requires_grad_(True)
    training_loss(model, dict(inputs, **{key: x})).backward()
    return x.grad


@pytest.mark.parametrize("name", FAMILIES)
def test_every_token_and_parameter_gets_a_gradient(name):
    model, inputs, _ = build(name)
    model.train()
    input_grads(name, model, inputs)
    # Qwen-Image's last block computes a text stream the model never reads: no gradient, routed or not
    unrouted = {n for n, p in model.named_parameters() if p.grad is None}
    assert not unrouted or name.startswith("qwen") and all(n.startswith("transformer_blocks.2.") for n in unrouted)
    model.zero_grad(set_to_none=True)
    handle = apply_tread(model, {"routes": [{"selection_ratio": 0.7, "start_layer_idx": 0, "end_layer_idx": -1}]})
    grad = input_grads(name, model, inputs)
    channels_last = packed(inputs) or TINY[name].channels_last
    per_position = grad.abs().sum(-1 if channels_last else 1)  # per token (FLUX) or per latent pixel
    assert (per_position > 0).all()
    assert handle.last_keep[0].shape[1] < per_position.flatten(1).shape[1]  # tokens were dropped
    unused = {n for n, p in model.named_parameters() if p.grad is None}
    assert unused == unrouted, f"parameters without a gradient only when routed (DDP would stop): {unused - unrouted}"


@pytest.mark.parametrize("name", FAMILIES)
def test_lora_only_adapters_train(name):
    from peft import LoraConfig

    model, inputs, _ = build(name)
    config = LoraConfig(r=4, lora_alpha=4, init_lora_weights="gaussian",
                        target_modules=list(TINY[name].lora_targets))
    if hasattr(model, "add_adapter"):
        model.add_adapter(config)
    else:  # PixArt has no PeftAdapterMixin: peft's own injection, base weights frozen by hand
        from peft import inject_adapter_in_model

        inject_adapter_in_model(config, model)
        for n, p in model.named_parameters():
            p.requires_grad_("lora_" in n)
    apply_tread(model, ROUTE)
    base = {k: v.clone() for k, v in model.state_dict().items() if "lora_" not in k}
    model.train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(trainable, lr=0.1)
    training_loss(model, inputs).backward()
    grads = {n for n, p in model.named_parameters() if p.grad is not None}
    assert grads and all("lora_" in n for n in grads)
    assert grads == {n for n, p in model.named_parameters() if p.requires_grad}
    opt.step()
    assert all(torch.equal(v, base[k]) for k, v in model.state_dict().items() if "lora_" not in k)


def _checkpoint_fresh_rng(module, *args):
    """A checkpoint that does not restore the RNG: a recomputation that drew new tokens would show."""
    return torch.utils.checkpoint.checkpoint(module, *args, use_reentrant=False, preserve_rng_state=False)


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("checkpoint_func", [None, _checkpoint_fresh_rng], ids=["diffusers", "fresh_rng"])
def test_gradient_checkpointing_gives_the_same_gradients(name, checkpoint_func):
    model, inputs, _ = build(name)
    handle = apply_tread(model, ROUTE)
    model.train()

    def grads():
        model.zero_grad(set_to_none=True)
        torch.manual_seed(3)
        g = input_grads(name, model, inputs)
        return g, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, handle.last_keep[0]

    g0, p0, k0 = grads()
    model.enable_gradient_checkpointing(checkpoint_func)
    g1, p1, k1 = grads()
    assert torch.equal(k0, k1)
    torch.testing.assert_close(g1, g0, rtol=1e-5, atol=1e-6)
    assert p1.keys() == p0.keys()
    for n in p0:
        torch.testing.assert_close(p1[n], p0[n], rtol=1e-5, atol=1e-6, msg=n)
    handle.remove()
    assert model._gradient_checkpointing_func is not None and not hasattr(model._gradient_checkpointing_func,
                                                                          "_tread_original")


def tokens_by_hand(mask, grid, rule):
    """Each token's 2x2 pixels (a frame's for video; packed latents: one pixel per token) counted by the rule."""
    if mask.shape[1:] == grid:
        mask = mask.flatten(1)[..., None]
    elif len(grid) == 3:
        mask = mask.reshape(B, grid[0], grid[1], 2, grid[2], 2).permute(0, 1, 2, 4, 3, 5).flatten(1, 3).flatten(2)
    else:
        mask = mask.reshape(B, grid[0], 2, grid[1], 2).permute(0, 1, 3, 2, 4).flatten(1, 2).flatten(2)
    inside = mask.sum(-1)
    return inside > mask.shape[-1] / 2 if rule == "half" else inside > 0


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("how, rule", [("handle", "half"), ("forward", "half"), ("handle", "any")])
def test_masked_tokens_are_never_dropped(name, how, rule):
    model, inputs, grid = build(name)
    handle = apply_tread(model, {"routes": [{"selection_ratio": 0.75, "start_layer_idx": 0, "end_layer_idx": 1}]},
                         mask_rule=rule)
    image = (B, *[2 * g for g in grid]) if len(grid) == 2 else (B, grid[0], *[2 * g for g in grid[1:]])  # video
    if packed(inputs):
        image = (B, *grid)  # packed latents: one mask pixel per token
    mask = torch.rand(image) < 0.4
    tokens = tokens_by_hand(mask, grid, rule)
    model.train()
    for _ in range(3):
        if how == "handle":
            handle.set_mask(mask)
            run(model, inputs)
        else:
            run(model, dict(inputs, tread_mask=mask))
        keep = handle.last_keep[0]
        kept = torch.zeros_like(tokens).scatter(1, keep, True)
        assert tokens.any() and (kept | ~tokens).all()


def run_the_checks_every_family_gets(name):
    """The checks above that need no reference by hand, for an entry outside FAMILIES: one whose test file has the
    reference its layout needs, or registers it."""
    test_off_ratio_zero_eval_no_grad_and_remove_are_bit_identical(name)
    test_every_token_and_parameter_gets_a_gradient(name)
    test_lora_only_adapters_train(name)
    for checkpoint_func in (None, _checkpoint_fresh_rng):
        test_gradient_checkpointing_gives_the_same_gradients(name, checkpoint_func)
    for how, rule in (("handle", "half"), ("forward", "half"), ("handle", "any")):
        test_masked_tokens_are_never_dropped(name, how, rule)


def test_masked_loss_weights_the_loss_by_the_mask():
    loss = torch.arange(2 * 3 * 4 * 4, dtype=torch.float32).reshape(2, 3, 4, 4)
    mask = torch.zeros(2, 8, 8, dtype=torch.bool)
    mask[0, :4, :4] = True  # the top-left quarter of sample 0 only
    assert masked_loss(loss, mask).item() == pytest.approx(loss[0, :, :2, :2].mean().item())
    tokens = torch.rand(2, 5, 3)
    token_mask = torch.tensor([[1, 0, 0, 0, 1], [0, 0, 1, 0, 0]], dtype=torch.bool)
    assert masked_loss(tokens, token_mask).item() == pytest.approx(tokens[token_mask].mean().item())


def block_lengths(model, inputs):
    """Each block's routed-argument length in one training-mode forward, by block index."""
    key, lengths = family_of(model).tokens, {}
    hooks = [b.register_forward_pre_hook(lambda m, a, k, i=i: lengths.__setitem__(i, bound(m, a, k)[key].shape[1]),
                                         with_kwargs=True) for i, b in enumerate(blocks_of(model))]
    model.train()
    run(model, inputs)
    for hook in hooks:
        hook.remove()
    return lengths


@pytest.mark.parametrize("name", FAMILIES)
def test_negative_indices_count_from_the_last_block(name):
    model, inputs, _ = build(name)
    blocks = blocks_of(model)
    full = block_lengths(model, inputs)
    handle = apply_tread(model, {"routes": [{"selection_ratio": 0.5, "start_layer_idx": -2, "end_layer_idx": -1}]})
    routed = block_lengths(model, inputs)
    assert [routed[i] < full[i] for i in range(len(blocks))] == [False] * (len(blocks) - 2) + [True, True]
    assert (handle.routes[0].start_layer_idx, handle.routes[0].end_layer_idx) == (len(blocks) - 2, len(blocks) - 1)


@pytest.mark.parametrize("routes,match", [
    (None, MISSING_ROUTES), ({}, MISSING_ROUTES), ({"routes": []}, MISSING_ROUTES), ([], MISSING_ROUTES),
    ([{"selection_ratio": 0.5, "start_layer_idx": 0, "end_layer_idx": 4}], "outside a model of depth 4"),
    ([{"selection_ratio": 0.5, "start_layer_idx": 2, "end_layer_idx": 1}], "comes after end block"),
    ([{"selection_ratio": 1.0, "start_layer_idx": 0, "end_layer_idx": 1}], "selection_ratio must be in"),
    ([{"selection_ratio": 0.5, "start_layer_idx": 0, "end_layer_idx": 2},
      {"selection_ratio": 0.5, "start_layer_idx": 2, "end_layer_idx": 3}], "overlaps"),
    ([{"selection_ratio": 0.5, "start_layer_idx": 0}], "needs integer start_layer_idx"),
])
def test_bad_routes_are_refused_in_one_line(routes, match):
    model, _, _ = build("sd3")
    with pytest.raises(UserError, match=match) as err:
        apply_tread(model, routes)
    assert "\n" not in str(err.value)
    assert not model._forward_pre_hooks


def test_unsupported_model_is_refused():
    with pytest.raises(UserError, match="does not support Linear") as err:
        apply_tread(torch.nn.Linear(2, 2), ROUTE)
    assert "\n" not in str(err.value)


def test_applied_twice_and_controlnet_residuals_are_refused():
    model, inputs, _ = build("flux")
    handle = apply_tread(model, ROUTE)
    with pytest.raises(UserError, match="already has TREAD routes"):
        apply_tread(model, ROUTE)
    model.train()
    with pytest.raises(UserError, match="given controlnet_block_samples"):
        run(model, dict(inputs, controlnet_block_samples=[torch.zeros(B, 24, 16)]))
    handle.remove()
    assert functools.reduce(lambda a, m: a and not m._forward_hooks, model.modules(), True)


@pytest.mark.parametrize("name,argument,value", [("flux", "controlnet_single_block_samples", [torch.zeros(B, 24, 16)]),
                                                 ("flux2", "kv_cache_mode", "extract"),
                                                 ("chroma", "controlnet_block_samples", [torch.zeros(B, 24, 16)]),
                                                 ("qwen", "controlnet_block_samples", [torch.zeros(B, 24, 16)]),
                                                 ("qwen", "img_shapes", [[(1, 24)]] * B),
                                                 ("cosmos", "block_controlnet_hidden_states",
                                                  [torch.zeros(B, 24, 24)]),
                                                 ("kandinsky", "sparse_params", {"to_fractal": False})])
def test_unsupported_forward_arguments_are_refused_in_one_line(name, argument, value):
    model, inputs, _ = build(name)
    apply_tread(model, ROUTE)
    model.train()
    with pytest.raises(UserError, match=f"given {argument}|from {argument}") as err:
        run(model, dict(inputs, **{argument: value}))
    assert "\n" not in str(err.value)


def test_hunyuan_video_token_replace_is_refused_in_one_line():
    model, inputs, _ = build("hunyuan", image_condition_type="token_replace")
    apply_tread(model, ROUTE)
    model.train()
    with pytest.raises(UserError, match="image_condition_type='token_replace'") as err:
        run(model, inputs)
    assert "\n" not in str(err.value)


def test_ddp_without_find_unused_parameters_trains_routed_steps(tmp_path):
    """One gloo process: DDP's reducer stops at the next step if a parameter got no gradient in the last one."""
    import torch.distributed as dist

    model, inputs, _ = build("flux")
    apply_tread(model, ROUTE)
    model.train()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        ddp = torch.nn.parallel.DistributedDataParallel(model, find_unused_parameters=False)
        for _ in range(3):
            ddp(**inputs)[0].square().mean().backward()
    finally:
        dist.destroy_process_group()


def test_flux_force_keep_is_per_sample():
    """Each sample forces its own 8 tokens: 8 are kept per sample, not the batch's union of 16."""
    model, inputs, (h, w) = build("flux")
    handle = apply_tread(model, {"routes": [{"selection_ratio": 0.75, "start_layer_idx": 0, "end_layer_idx": 1}]})
    mask = torch.zeros(B, h * w, dtype=torch.bool)
    mask[0, :8], mask[1, 8:16] = True, True
    model.train()
    run(model, dict(inputs, tread_mask=mask))
    keep = handle.last_keep[0]
    assert keep.shape == (B, 8)
    assert all(set(keep[b].tolist()) == set(mask[b].nonzero()[:, 0].tolist()) for b in range(B))


@pytest.mark.parametrize("name,frames", [("kandinsky", 1), ("kandinsky", 3)])
def test_rope_of_one_per_sample_table_each_kept_token_keeps_its_angles(name, frames):
    """Families whose blocks get one RoPE tensor with a batch dimension (Kandinsky 5's rotation matrices
    [B, N, 1, head_dim / 2, 2, 2]): a routed block's attention sees each sample's kept rows, in the kept order."""
    model, inputs, _ = build(name, frames=frames)
    attention, argument = TINY[name].rope_attention
    seen, hooks = {}, []
    for i, block in enumerate(blocks_of(model)):
        hooks.append(getattr(block, attention).register_forward_pre_hook(
            lambda m, a, k, i=i: seen.__setitem__(i, k[argument]), with_kwargs=True))
    model.eval()
    with torch.no_grad():
        run(model, inputs)
    full = dict(seen)
    handle = apply_tread(model, ROUTE)
    model.train()
    run(model, inputs)
    keep, r = handle.last_keep[0], handle.routes[0]
    shuffled = keep[:, torch.randperm(keep.shape[1])]
    for i, table in seen.items():
        if r.start_layer_idx <= i <= r.end_layer_idx:
            kept_rows = [all(torch.equal(table[b], full[i][b, k[b]]) for b in range(B)) for k in (keep, shuffled)]
            assert not torch.equal(keep[0], keep[1]) and kept_rows == [True, False]
        else:
            assert torch.equal(table, full[i])
    for hook in hooks:
        hook.remove()
