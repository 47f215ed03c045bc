"""FLUX Kontext's reference-image tokens (after the target's in hidden_states, img_ids' first coordinate 1, as
diffusers' FluxKontextPipeline builds them) are never routed, and a TREAD mask covers the target only; a compiled
forward, which cannot read the ids, is given their count and checks it when it runs."""
import pytest
import torch
import torch._dynamo
from torch._dynamo.testing import CompileCounter
from torch._dynamo.utils import counters

pytest.importorskip("diffusers")
from diffusers_tiny import B, blocks_of, build, reference_forward  # noqa: E402
from tread_diffusers import apply_tread  # noqa: E402
from tread_diffusers.flux_families import check_reference_ids  # noqa: E402
from tread_utils.errors import UserError  # noqa: E402

N, R = 24, 6  # the target's 4 x 6 tokens, the reference's 2 x 3
ROUTE = {"routes": [{"selection_ratio": 0.5, "start_layer_idx": 1, "end_layer_idx": -2}]}  # dual 1 to single 0


def kontext():
    model, inputs, grid = build("flux")
    ids = torch.zeros(2, 3, 3)
    ids[..., 0], ids[..., 1], ids[..., 2] = 1, torch.arange(2)[:, None], torch.arange(3)[None]
    inputs["img_ids"] = torch.cat([inputs["img_ids"], ids.reshape(-1, 3)])
    inputs["hidden_states"] = torch.cat([inputs["hidden_states"], torch.randn(B, R, 4)], 1)
    return model.train(), inputs, grid


def test_reference_tokens_are_never_routed_and_the_routed_forward_equals_a_hand_built_one():
    model, inputs, _ = kontext()
    handle = apply_tread(model, ROUTE)  # before the hooks below: they see what each block is given
    blocks = blocks_of(model)
    seen, hooks = {}, []
    for i, block in enumerate(blocks):
        hooks.append(block.register_forward_pre_hook(
            lambda m, a, k, i=i: seen.__setitem__(i, k["hidden_states"].clone()), with_kwargs=True))
    last = {}
    hooks.append(blocks[-1].register_forward_hook(lambda m, a, out: last.__setitem__("x", out[1])))
    torch.manual_seed(0)
    model(**inputs)
    keep = handle.last_keep[0]
    assert keep.shape == (B, N // 2) and keep.max() < N  # only the target's tokens are candidates
    assert [seen[i].shape[1] for i in range(len(blocks))] == [N + R, N // 2 + R, N // 2 + R, N + R]
    for i in (1, 2):  # the routed blocks get the kept target tokens, then every reference token
        assert seen[i][:, N // 2:].shape[1] == R
    model.eval()
    with torch.no_grad():
        ref = reference_forward("flux", model, inputs, keep, 1, 2, N)
        torch.testing.assert_close(last["x"], ref, rtol=1e-5, atol=1e-5)
        every = torch.arange(N).expand(B, -1)
        assert not torch.allclose(reference_forward("flux", model, inputs, every, 1, 2, N), ref, atol=1e-4)
    for hook in hooks:
        hook.remove()


def test_every_target_and_reference_token_gets_a_gradient_and_ratio_zero_is_the_plain_model():
    model, inputs, _ = kontext()
    base = model(**inputs)[0]
    zero = apply_tread(model, {"routes": [{"selection_ratio": 0.0, "start_layer_idx": 1, "end_layer_idx": 2}]})
    assert torch.equal(model(**inputs)[0], base)
    zero.remove()
    apply_tread(model, ROUTE)
    x = inputs["hidden_states"].clone().requires_grad_()
    out = model(**{**inputs, "hidden_states": x})[0]
    assert out.shape == base.shape
    out.square().mean().backward()
    assert (x.grad.abs().sum(-1) > 0).all()


def test_a_mask_covers_the_target_only():
    model, inputs, (h, w) = kontext()
    handle = apply_tread(model, {"routes": [{"selection_ratio": 0.75, "start_layer_idx": 0, "end_layer_idx": 2}]})
    image = torch.zeros(B, h * 8, w * 8)
    image[0, :8, :16], image[1, 16:, 24:] = 1, 1  # the target's top-left 1 x 2 tokens, bottom-right 2 x 3
    torch.manual_seed(0)
    model(**inputs, tread_mask=image)
    keep = handle.last_keep[0]
    assert keep.max() < N
    assert {0, 1} <= set(keep[0].tolist()) and {15, 16, 17, 21, 22, 23} <= set(keep[1].tolist())
    with pytest.raises(UserError, match="has 30 tokens per sample, the image 24"):  # target and references: refused
        model(**inputs, tread_mask=torch.zeros(B, N + R, dtype=torch.bool))


def test_the_count_can_be_given_and_a_wrong_or_misplaced_one_is_refused_in_one_line():
    model, inputs, _ = kontext()
    handle = apply_tread(model, ROUTE)
    model(**inputs, tread_reference_tokens=R)
    assert handle.last_keep[0].max() < N
    for bad in (-1, N + R, 1.5, True):
        with pytest.raises(UserError, match="tread_reference_tokens") as err:
            model(**inputs, tread_reference_tokens=bad)
        assert "\n" not in str(err.value)
    for wrong in (0, R + 1):  # 0 would route the references, R + 1 would take a target token for one
        with pytest.raises(UserError, match=f"tread_reference_tokens={wrong}, but img_ids has {R} .*"
                                            f"pass tread_reference_tokens={R}$"):
            model(**inputs, tread_reference_tokens=wrong)
    ids = inputs["img_ids"].flip(0)  # the reference first: not where diffusers puts it
    with pytest.raises(UserError, match="reference-image tokens as the last"):
        model(**{**inputs, "img_ids": ids})


def test_a_compiled_forward_checks_the_reference_count_in_its_graph_and_routes_as_the_eager_one():
    model, inputs, _ = kontext()
    handle = apply_tread(model, ROUTE)
    torch._dynamo.reset()
    counters["graph_break"].clear()
    counter = CompileCounter()
    compiled = torch.compile(model, backend=counter)
    with pytest.raises(UserError, match=f"img_ids has {R} FLUX Kontext reference-image tokens .* a compiled "
                                        f"forward cannot read; pass tread_reference_tokens={R} to the forward$") as err:
        compiled(**inputs)  # without the count the references would be routed with the target's
    assert "\n" not in str(err.value)
    graphs = [counter.frame_count]
    for seed in (0, 1, 2):
        torch.manual_seed(seed)
        out = compiled(**inputs, tread_reference_tokens=R)[0]
        graphs.append(counter.frame_count)
        keep = handle.last_keep[0].clone()
        assert keep.shape == (B, N // 2) and keep.max() < N
        torch.manual_seed(seed)
        assert torch.equal(model(**inputs, tread_reference_tokens=R)[0], out)  # eager, same draw
        assert torch.equal(handle.last_keep[0], keep)
    with pytest.raises(UserError, match=f"tread_reference_tokens={R - 1}, but img_ids has {R}"):
        compiled(**inputs, tread_reference_tokens=R - 1)
    # one graph; the count is a constant of the graph, so it compiles once more, and no more after that
    assert graphs == [1, 2, 2, 2] and sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])



def test_the_check_reaches_the_caller_as_it_is_through_aot_autograd():
    """aot_eager traces the op with its fake kernel and runs it inside the compiled graph, as inductor does: the
    error the caller gets is the one line itself, not a compiler error around it."""
    ids = kontext()[1]["img_ids"]
    keep = torch.arange(N // 2).expand(B, -1)
    torch._dynamo.reset()
    checked = torch.compile(lambda ids, keep, count: check_reference_ids(ids, keep, count, True) + 0,
                            backend="aot_eager", fullgraph=True)
    assert torch.equal(checked(ids, keep, R), keep)
    with pytest.raises(UserError, match=f"^tread_reference_tokens={R - 1}, but img_ids has {R} .*") as err:
        checked(ids, keep, R - 1)
    assert type(err.value) is UserError and "\n" not in str(err.value)
