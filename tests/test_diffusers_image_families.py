"""The checks of tread_diffusers/image_families.py's families that tests/test_diffusers_tread.py's shared ones
do not reach: their per-sample RoPE tables and attention masks in the routed blocks, and the variants refused."""
import inspect

import pytest
import torch

pytest.importorskip("diffusers")
from diffusers_tiny import B, blocks_of, build  # noqa: E402
from tread_diffusers import apply_tread  # noqa: E402
from tread_diffusers.image_families import ZIMAGE_PATCH  # noqa: E402
from tread_utils.errors import UserError  # noqa: E402

ROUTE = {"routes": [{"selection_ratio": 0.5, "start_layer_idx": 1, "end_layer_idx": -2}]}
ROPE = {"zimage": ("attention", "freqs_cis")}  # each block's attention module, and its RoPE keyword
MASK = {"zimage": "attn_mask"}  # each block's attention mask argument


def block_inputs_seen(name, model):
    """Hooks that keep, per block, the RoPE table its attention is given and the block's attention mask."""
    seen, hooks = {}, []
    attention, rope = ROPE[name]
    for i, block in enumerate(blocks_of(model)):
        hooks.append(getattr(block, attention).register_forward_pre_hook(
            lambda m, a, k, i=i: seen.setdefault(i, {}).__setitem__("rope", k[rope]), with_kwargs=True))
        names = list(inspect.signature(block.forward).parameters)
        hooks.append(block.register_forward_pre_hook(
            lambda m, a, k, i=i: seen.setdefault(i, {}).__setitem__(
                "mask", {**dict(zip(names, a)), **k}[MASK[name]]), with_kwargs=True))
    return seen, hooks


def rows_match(table, full, keep):
    """Each sample's rows in a routed block: its kept image tokens' rows, then every row after the image."""
    k, tail = keep.shape[1], table.shape[1] - keep.shape[1]
    return all(torch.equal(table[b, :k], full[b, keep[b]]) and torch.equal(table[b, k:], full[b, -tail:])
               for b in range(keep.shape[0]))


@pytest.mark.parametrize("name", ["zimage"])
def test_each_kept_token_keeps_its_rope_rows_and_mask(name):
    model, inputs, _ = build(name)
    seen, hooks = block_inputs_seen(name, model)
    model.eval()
    with torch.no_grad():
        model(**inputs)
    full = {i: dict(s) for i, s in seen.items()}
    assert full[0]["mask"] is not None and not full[0]["mask"].all()  # the short caption's padding is masked
    handle = apply_tread(model, ROUTE)
    model.train()
    model(**inputs)
    keep, r = handle.last_keep[0], handle.routes[0]
    assert not torch.equal(keep[0], keep[1])  # each sample its own tokens and rows
    shuffled = keep[:, torch.randperm(keep.shape[1])]
    for i, s in seen.items():
        if r.start_layer_idx <= i <= r.end_layer_idx:
            assert rows_match(s["rope"], full[i]["rope"], keep) and rows_match(s["mask"], full[i]["mask"], keep)
            assert not rows_match(s["rope"], full[i]["rope"], shuffled)
        else:
            assert torch.equal(s["rope"], full[i]["rope"]) and torch.equal(s["mask"], full[i]["mask"])
    for hook in hooks:
        hook.remove()


def zimage_omni(inputs):
    return dict(inputs, x=[[image] for image in inputs["x"]], cap_feats=[[cap] for cap in inputs["cap_feats"]],
                siglip_feats=[[None]] * B, image_noise_mask=[[1]] * B)


@pytest.mark.parametrize("name,change,match", [
    ("zimage", lambda i: dict(i, controlnet_block_samples={0: torch.zeros(1)}), "given controlnet_block_samples"),
    ("zimage", zimage_omni, "given siglip_feats"),
    ("zimage", lambda i: dict(i, siglip_feats=None, image_noise_mask=None, x=[[x] for x in i["x"]]),
     "omni mode"),
    ("zimage", lambda i: dict(i, x=[i["x"][0], i["x"][1, :, :, :4]]), "share one shape"),
])
def test_unsupported_variants_are_refused_in_one_line(name, change, match):
    model, inputs, _ = build(name)
    apply_tread(model, ROUTE)
    model.train()
    with pytest.raises(UserError, match=match) as err:
        model(**change(inputs))
    assert "\n" not in str(err.value)


def test_zimage_patch_defaults_are_its_forwards():
    from diffusers import ZImageTransformer2DModel

    params = inspect.signature(ZImageTransformer2DModel.forward).parameters
    assert (params["patch_size"].default, params["f_patch_size"].default) == ZIMAGE_PATCH
