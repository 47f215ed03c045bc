"""Masks as trainers hold them (tread_diffusers/masks.py): SimpleTuner's [-1, 1] conditioning images and
[0, 1] ones, one or three channels, torch or numpy, tokenised by the "half" or "any" rule; the masked loss."""
import numpy as np
import pytest
import torch

pytest.importorskip("diffusers")
from diffusers_tiny import B, build  # noqa: E402
from tread_diffusers import apply_tread  # noqa: E402
from tread_diffusers.masks import mask_to_tokens, masked_loss, read_mask  # noqa: E402
from tread_utils.errors import UserError  # noqa: E402

GRID = (4, 4)  # SD3's tiny model: an 8 x 8 latent in 2 x 2 patches


def disc(size=32, radius=9.0, centre=(13.0, 18.0)):
    """A [size, size] bool disc."""
    y, x = torch.meshgrid(torch.arange(size) + 0.5, torch.arange(size) + 0.5, indexing="ij")
    return (y - centre[0]) ** 2 + (x - centre[1]) ** 2 < radius ** 2


def coverage(mask, grid):
    """The share of each token's pixels inside a [B, H, W] 0/1 mask, counted block by block."""
    b, h, w = mask.shape
    blocks = mask.float().reshape(b, grid[0], h // grid[0], grid[1], w // grid[1])
    return blocks.mean((2, 4)).flatten(1)


@pytest.mark.parametrize("rule", ["half", "any"])
def test_simpletuner_and_unit_range_images_give_the_same_tokens_by_the_rule(rule):
    inside = torch.stack([disc(), disc(radius=4.0, centre=(5.0, 10.0))])
    inside[1, :, 20:21] = True  # a 1 px line: no token is half covered by it
    share = coverage(inside, (8, 8))
    want = share > 0.5 if rule == "half" else share > 0
    rgb = (inside.float() * 2 - 1)[:, None].expand(-1, 3, -1, -1)  # SimpleTuner's conditioning image
    forms = [inside, inside.float(), inside.float()[:, None], rgb, rgb.numpy(), inside.numpy(),
             (inside.float() * 2 - 1).numpy().astype(np.float16)]
    for form in forms:
        got = mask_to_tokens(read_mask(form), (8, 8), 64, rule)
        assert torch.equal(got, want), type(form)
    assert 0 < want[0].sum() < 64 and 0 < want[1].sum() < 64
    if rule == "half":  # the line's column never crosses half a token; the any-pixel rule keeps its 8 tokens
        assert not want[1].reshape(8, 8)[:, 5].any()
    else:
        assert want[1].reshape(8, 8)[:, 5].all()


def test_a_soft_mask_is_read_by_its_area():
    soft = torch.full((1, 4, 4), -1.0)
    soft[0, :2, :2] = 0.2  # 0.6 on the [0, 1] scale: more than half of token 0 inside
    soft[0, :2, 2:] = -0.2  # 0.4: less than half of token 1
    assert mask_to_tokens(read_mask(soft), (2, 2), 4, "half").tolist() == [[True, False, False, False]]
    assert mask_to_tokens(read_mask(soft), (2, 2), 4, "any").tolist() == [[True, True, False, False]]


def test_token_masks_are_taken_as_they_are():
    flags = torch.tensor([[1, 0, 0, 1], [0, 0, 1, 0]])
    for form in (flags, flags.bool(), flags.float(), flags.numpy(), flags.numpy().astype(bool)):
        assert torch.equal(mask_to_tokens(read_mask(form), (2, 2), 4), flags.bool())


@pytest.mark.parametrize("mask, match", [
    ([[1, 0]], "is a list"),
    (torch.ones(2), "has shape"),
    (torch.tensor([[0, 2, 1]]), "only 0 and 1"),
    (torch.full((1, 4, 4), 255.0), r"values in \[255, 255\]"),
    (np.full((1, 4, 4), 128, dtype=np.uint8), r"a 0-255 image divided by 255"),
    (torch.rand(1, 4, 4) * 0.5 + 0.3, "reads as neither"),
    (np.array([["a"]]), "ndarray of dtype <U1"),
])
def test_unreadable_masks_are_refused_in_one_line(mask, match):
    with pytest.raises(UserError, match=match) as err:
        read_mask(mask)
    assert "\n" not in str(err.value)


def test_a_mask_of_another_shape_is_refused_naming_the_forms():
    for mask, grid in ((torch.ones(2, 2, 8, 8), GRID), (torch.ones(2, 5), GRID), (torch.ones(2, 8, 8), (1, 4, 4))):
        with pytest.raises(UserError, match="mask") as err:
            mask_to_tokens(read_mask(mask), grid, 16)
        assert "\n" not in str(err.value)


def test_simpletuner_outside_pixels_force_nothing_and_the_route_still_skips():
    """-1 is outside: a [-1, 1] mask with one small square forces that square's tokens only."""
    model, inputs, grid = build("sd3")
    handle = apply_tread(model, {"routes": [{"selection_ratio": 0.75, "start_layer_idx": 0, "end_layer_idx": 1}]})
    image = -torch.ones(B, 3, 8, 8)
    image[:, :, :2, :2] = 1.0  # token 0 of each sample
    model.train()
    run = model(**inputs, tread_mask=image)[0]
    assert run.shape == inputs["hidden_states"].shape
    keep = handle.last_keep[0]
    assert keep.shape == (B, 4) and (keep == 0).any(1).all()  # 16 - int(16 * 0.75) kept, token 0 among them
    with pytest.raises(UserError, match="choose one of half, any"):
        apply_tread(build("sd3")[0], {"routes": [{"selection_ratio": 0.5, "start_layer_idx": 0, "end_layer_idx": 1}]},
                    mask_rule="majority")


def test_masked_loss_normalisations():
    loss = torch.rand(2, 3, 4, 4)
    inside = torch.zeros(2, 8, 8)
    inside[0, :4, :4] = 1  # the top-left quarter of sample 0
    inside[1, :2, :1] = 1  # half of sample 1's first loss pixel
    weight = torch.zeros(2, 1, 4, 4)
    weight[0, :, :2, :2], weight[1, 0, 0, 0] = 1, 0.5
    expected_all = (loss * weight).mean()
    expected_masked = (loss * weight).sum() / (weight.sum() * 3)
    simpletuner = (inside * 2 - 1)[:, None].expand(-1, 3, -1, -1).numpy()
    for mask in (inside, inside.bool(), simpletuner):
        torch.testing.assert_close(masked_loss(loss, mask, "all"), expected_all)
        torch.testing.assert_close(masked_loss(loss, mask), expected_masked)
    tokens, flags = torch.rand(2, 5, 3), torch.tensor([[1, 0, 0, 0, 1], [0, 0, 1, 0, 0]])
    torch.testing.assert_close(masked_loss(tokens, flags), tokens[flags.bool()].mean())
    torch.testing.assert_close(masked_loss(tokens, flags, "all"), (tokens * flags[..., None]).mean())
    with pytest.raises(UserError, match="choose one of masked, all"):
        masked_loss(loss, inside, "sum")
    with pytest.raises(UserError, match="masked_loss got a mask of shape"):
        masked_loss(loss, torch.ones(3, 8, 8))
