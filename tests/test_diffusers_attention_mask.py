"""Attention masks while routing (tread_diffusers/families.py): FLUX's joint attention mask over text and
image and PixArt's image mask reach each routed block as their text part and the kept image tokens' part."""
import pytest
import torch

pytest.importorskip("diffusers")
from diffusers_tiny import B, blocks_of, build  # noqa: E402
from tread_diffusers import apply_tread  # noqa: E402
from tread_utils.errors import UserError  # noqa: E402

TEXT = 5
# FLUX (2 dual + 2 single blocks): one route in the dual-stream blocks, one across into the single-stream ones,
# one inside them; PixArt's 4 blocks.
ROUTES = {"flux": [{"selection_ratio": 0.5, "start_layer_idx": 0, "end_layer_idx": 0},
                   {"selection_ratio": 0.5, "start_layer_idx": 1, "end_layer_idx": 2},
                   {"selection_ratio": 0.25, "start_layer_idx": 3, "end_layer_idx": 3}],
          "pixart": [{"selection_ratio": 0.5, "start_layer_idx": 1, "end_layer_idx": 2}]}


def with_mask(name, inputs, mask):
    if name == "flux":
        return dict(inputs, joint_attention_kwargs={"attention_mask": mask})
    return dict(inputs, attention_mask=mask)


def routed(name, model, inputs, seed=3):
    torch.manual_seed(seed)
    out = model(**inputs)[0]
    out.square().mean().backward()
    grad = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    return out, grad


def full_masks(name, tokens):
    length = TEXT + tokens if name == "flux" else tokens
    masks = [torch.ones(B, length, dtype=torch.bool), torch.ones(B, length)]
    if name == "flux":  # additive and 4-D forms, as SDPA takes them
        masks += [torch.zeros(B, 1, length, length), torch.ones(1, 2, 1, length, dtype=torch.bool)]
    return masks


@pytest.mark.parametrize("name", ["flux", "pixart"])
def test_an_all_ones_mask_routes_as_no_mask_in_every_block_kind(name):
    model, inputs, grid = build(name)
    handle = apply_tread(model, {"routes": ROUTES[name]})
    model.train()
    base, base_grad = routed(name, model, inputs)
    keep = dict(handle.last_keep)
    assert len(keep) == len(ROUTES[name])
    for mask in full_masks(name, grid[0] * grid[1]):
        out, grad = routed(name, model, with_mask(name, inputs, mask))
        assert all(torch.equal(handle.last_keep[k], keep[k]) for k in keep)
        torch.testing.assert_close(out, base, rtol=1e-5, atol=1e-6)
        for n in base_grad:
            torch.testing.assert_close(grad[n], base_grad[n], rtol=1e-4, atol=1e-6, msg=n)


def test_flux_routed_blocks_get_the_text_and_kept_parts_of_the_mask():
    """A padded-text mask that also hides some image tokens: each routed block's attention gets the text columns
    and the kept image tokens' columns (rows too for a square mask), gathered by hand here."""
    model, inputs, grid = build("flux")
    tokens = grid[0] * grid[1]
    blocks = blocks_of(model)
    handle = apply_tread(model, {"routes": ROUTES["flux"]})
    seen = {}
    for i, block in enumerate(blocks):
        block.register_forward_pre_hook(lambda m, a, k, i=i: seen.__setitem__(i, k["joint_attention_kwargs"]),
                                        with_kwargs=True)
    keys = torch.rand(B, TEXT + tokens) > 0.3
    keys[:, 0] = True
    square = torch.randn(B, 1, TEXT + tokens, TEXT + tokens)
    model.train()
    for mask in (keys, square):
        torch.manual_seed(5)
        model(**with_mask("flux", inputs, mask))
        route_of = {0: 0, 1: 1, 2: 1, 3: 2}
        for i, k in route_of.items():
            keep = handle.last_keep[k]
            got = seen[i]["attention_mask"]
            for b in range(B):
                cols = list(range(TEXT)) + [TEXT + int(j) for j in keep[b]]
                want = mask[b][..., cols] if mask.ndim == 2 else mask[b][:, cols][:, :, cols]
                assert torch.equal(got[b], want), (i, b)
    model.eval()
    with torch.no_grad():
        model(**with_mask("flux", inputs, keys))
    assert seen[1]["attention_mask"] is keys  # unrouted: the mask as given


def test_pixart_routed_blocks_get_the_kept_part_of_the_image_mask():
    model, inputs, grid = build("pixart")
    blocks = blocks_of(model)
    handle = apply_tread(model, {"routes": ROUTES["pixart"]})
    seen = {}
    blocks[2].register_forward_pre_hook(lambda m, a, k: seen.update(k), with_kwargs=True)
    mask = torch.rand(B, grid[0] * grid[1]) > 0.3
    model.train()
    model(**with_mask("pixart", inputs, mask))
    bias = (1 - mask.float()) * -10000.0  # diffusers' PixArt turns the [B, N] mask into this bias [B, 1, N]
    keep = handle.last_keep[0]
    want = torch.stack([bias[b, keep[b]] for b in range(B)])[:, None]
    assert torch.equal(seen["attention_mask"], want)


def test_an_attention_mask_of_another_shape_is_refused_in_one_line():
    model, inputs, _ = build("flux")
    apply_tread(model, {"routes": ROUTES["flux"]})
    model.train()
    with pytest.raises(UserError, match=r"FLUX attention mask of shape \(2, 3, 29\)") as err:
        model(**with_mask("flux", inputs, torch.ones(B, 3, TEXT + 24)))
    assert "\n" not in str(err.value)
