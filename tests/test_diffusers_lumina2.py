"""TREAD on Lumina2 (diffusers' Lumina2Transformer2DModel), whose image tokens follow each sample's caption at a
per-sample offset: the checks every family gets (tests/test_diffusers_tread.py's, run here on Lumina2), and the
ones its layout needs (a reference built sample by sample, its RoPE rows and mask, caption and padding kept whole,
torch.compile, the structural check of its forward)."""
import inspect
import json
import math
import warnings

import pytest
import torch
import torch._dynamo
from torch._dynamo.testing import CompileCounter
from torch._dynamo.utils import counters

pytest.importorskip("diffusers")
import test_diffusers_tread as shared  # noqa: E402
import test_diffusers_versions as versions  # noqa: E402
from lab import bench_diffusers  # noqa: E402
from diffusers_tiny import B, bound, build  # noqa: E402
from tread_diffusers import apply_tread  # noqa: E402
from tread_utils.errors import UserError  # noqa: E402

ROUTE = {"routes": [{"selection_ratio": 0.5, "start_layer_idx": 1, "end_layer_idx": -2}]}
CAPTIONS = {"differ": (5, 3), "same": (4, 4)}  # caption tokens per sample: padding and a mask, or neither


def test_ratio_zero_eval_no_grad_and_remove_are_bit_identical():
    shared.test_off_ratio_zero_eval_no_grad_and_remove_are_bit_identical("lumina2")


def test_every_token_and_parameter_gets_a_gradient():
    shared.test_every_token_and_parameter_gets_a_gradient("lumina2")


def test_lora_only_adapters_train():
    shared.test_lora_only_adapters_train("lumina2")


@pytest.mark.parametrize("checkpoint_func", [None, shared._checkpoint_fresh_rng], ids=["diffusers", "fresh_rng"])
def test_gradient_checkpointing_gives_the_same_gradients(checkpoint_func):
    shared.test_gradient_checkpointing_gives_the_same_gradients("lumina2", checkpoint_func)


@pytest.mark.parametrize("how, rule", [("handle", "half"), ("forward", "half"), ("handle", "any")])
def test_masked_tokens_are_never_dropped(how, rule):
    shared.test_masked_tokens_are_never_dropped("lumina2", how, rule)


def test_negative_indices_count_from_the_last_block():
    shared.test_negative_indices_count_from_the_last_block("lumina2")


def layer_inputs(model, inputs):
    """Each main layer's inputs (hidden_states, attention_mask, image_rotary_emb, temb) and output in one
    forward, as the layer got them."""
    seen, hooks = {}, []
    for i, layer in enumerate(model.layers):
        hooks.append(layer.register_forward_pre_hook(
            lambda m, a, k, i=i: seen.setdefault(i, {}).update(bound(m, a, k)), with_kwargs=True))
        hooks.append(layer.register_forward_hook(lambda m, a, out, i=i: seen[i].update(out=out)))
        hooks.append(layer.attn.register_forward_pre_hook(
            lambda m, a, k, i=i: seen[i].update(rope=k["image_rotary_emb"]), with_kwargs=True))
    model(**inputs)
    for hook in hooks:
        hook.remove()
    return seen


def cut(row, caption, n, keep):
    """One sample's sequence (or RoPE / mask row) in a routed layer: its caption, its kept image tokens, the rest."""
    return torch.cat([row[:caption], row[caption:caption + n][keep], row[caption + n:]])


def reference(model, seen, captions, keep, start, end, n):
    """The routed main layers run by hand, one sample at a time: the kept image tokens (and their RoPE and mask
    rows) between the sample's caption and padding from layer `start` to `end`, the skipped ones put back after
    it. Returns the last layer's output per sample."""
    outs = []
    for b, (caption, kept) in enumerate(zip(captions, keep)):
        x_full = seen[start]["hidden_states"][b, caption:caption + n]
        x = cut(seen[start]["hidden_states"][b], caption, n, kept)
        for i in range(start, len(model.layers)):
            mask, rope = seen[i]["attention_mask"], seen[i]["image_rotary_emb"][b]
            mask = None if mask is None else mask[b]
            if i <= end:
                mask, rope = None if mask is None else cut(mask, caption, n, kept), cut(rope, caption, n, kept)
            x = model.layers[i](x[None], None if mask is None else mask[None], rope[None],
                                seen[i]["temb"][b:b + 1])[0]
            if i == end:
                full = x_full.clone()
                full[kept] = x[caption:caption + len(kept)]
                x = torch.cat([x[:caption], full, x[caption + len(kept):]])
        outs.append(x)
    return torch.stack(outs)


@pytest.mark.parametrize("captions", CAPTIONS)
def test_routed_forward_matches_reference_built_sample_by_sample(captions):
    model, inputs, grid = build("lumina2", captions=CAPTIONS[captions])
    n, captions = math.prod(grid), CAPTIONS[captions]
    handle = apply_tread(model, ROUTE)
    model.train()
    routed = layer_inputs(model, inputs)
    keep, route = handle.last_keep[0], handle.routes[0]
    assert keep.shape == (B, n // 2) and not torch.equal(keep[0], keep[1]) and keep.max() < n
    model.eval()
    with torch.no_grad():
        seen = layer_inputs(model, inputs)
        assert (seen[0]["attention_mask"] is None) == (len(set(captions)) == 1)
        ref = reference(model, seen, captions, keep, route.start_layer_idx, route.end_layer_idx, n)
        torch.testing.assert_close(routed[len(model.layers) - 1]["out"], ref, rtol=1e-5, atol=1e-5)
        every = torch.arange(n).expand(B, -1)  # the check tells routed from unrouted
        unrouted = reference(model, seen, captions, every, route.start_layer_idx, route.end_layer_idx, n)
        assert not torch.allclose(unrouted, ref, atol=1e-4)


def test_caption_and_padding_are_never_routed_and_rope_rows_and_mask_follow_the_tokens():
    """In each routed layer, per sample: the caption and the padding in place and whole, the kept image tokens
    between them; the RoPE rows (as the attention gets them) and the mask cut at the same positions, so each
    kept token keeps its own angles (a shuffled order fails) and the padding stays masked."""
    model, inputs, grid = build("lumina2")
    n, captions = math.prod(grid), CAPTIONS["differ"]
    model.eval()
    with torch.no_grad():
        full = layer_inputs(model, inputs)
    handle = apply_tread(model, ROUTE)
    model.train()
    routed = layer_inputs(model, inputs)
    keep, route = handle.last_keep[0], handle.routes[0]
    shuffled = keep[:, torch.randperm(keep.shape[1])]
    start, k = route.start_layer_idx, keep.shape[1]
    for b, caption in enumerate(captions):
        assert torch.equal(routed[start]["hidden_states"][b], cut(full[start]["hidden_states"][b], caption, n, keep[b]))
        padding = max(captions) - caption
        mask = routed[start]["attention_mask"][b]
        assert mask.tolist() == [True] * (caption + k) + [False] * padding
    for i, layer in routed.items():
        for b, caption in enumerate(captions):
            if route.start_layer_idx <= i <= route.end_layer_idx:
                rows = lambda t, kept: cut(t[b], caption, n, kept)  # noqa: E731
                assert torch.equal(layer["rope"][b], rows(full[i]["rope"], keep[b]))
                assert not torch.equal(layer["rope"][b], rows(full[i]["rope"], shuffled[b]))
                assert torch.equal(layer["attention_mask"][b], rows(full[i]["attention_mask"], keep[b]))
            else:
                assert torch.equal(layer["rope"][b], full[i]["rope"][b])
                assert torch.equal(layer["attention_mask"][b], full[i]["attention_mask"][b])
    after = routed[route.end_layer_idx + 1]["hidden_states"]
    before = routed[start]["hidden_states"]
    for b, caption in enumerate(captions):  # the caption ran the routed layers: it changed on the way
        assert not torch.allclose(after[b, :caption], before[b, :caption])


def test_compiles_into_the_unrouted_graphs():
    """diffusers' own forward reads the caption lengths as Python numbers (a data-dependent break of its own);
    the routed model compiles into the same graphs and breaks, with no recompile, and draws anew per call."""
    model, inputs, _ = build("lumina2")
    model.train()

    def steps(seeds, handle=None):
        torch._dynamo.reset()
        counters["graph_break"].clear()
        counter, kept, graphs = CompileCounter(), [], []
        compiled = torch.compile(model, backend=counter)
        for seed in seeds:
            torch.manual_seed(seed)
            out = compiled(**inputs)[0]
            out.square().mean().backward()
            graphs.append(counter.frame_count)
            if handle is not None:
                kept.append(handle.last_keep[0].clone())
                torch.manual_seed(seed)
                assert torch.equal(model(**inputs)[0], out)  # the eager routed forward, same draw
        return graphs, sum(counters["graph_break"].values()), kept

    unrouted = steps([0, 1, 2])[:2]
    handle = apply_tread(model, ROUTE)
    graphs, breaks, kept = steps([0, 1, 2], handle)
    assert (graphs, breaks) == unrouted and len(set(graphs)) == 1  # no recompile after the first call
    assert not torch.equal(kept[0], kept[1])


def test_lumina_next_is_refused_in_one_line():
    from diffusers import LuminaNextDiT2DModel

    model = LuminaNextDiT2DModel(sample_size=8, patch_size=2, in_channels=4, hidden_size=16, num_layers=2,
                                 num_attention_heads=2, num_kv_heads=1, multiple_of=16, cross_attention_dim=16)
    with pytest.raises(UserError, match=r"apply_tread does not support LuminaNextDiT2DModel \(the closest it routes: "
                                        r"Lumina2Transformer2DModel\)") as err:
        apply_tread(model, ROUTE)
    assert "\n" not in str(err.value) and not model._forward_pre_hooks


def test_each_block_parameter_the_family_reads_is_checked(monkeypatch):
    versions.test_each_block_parameter_the_family_reads_is_checked(monkeypatch, "lumina2")


def test_an_untested_version_warns_in_one_line_and_routes(monkeypatch):
    import diffusers

    monkeypatch.setattr(diffusers, "__version__", "0.43.0")
    model, inputs, grid = build("lumina2")
    with pytest.warns(UserWarning, match="diffusers 0.43.0 passes the structural check of Lumina2Transformer2DModel "
                                         "but is untested") as seen:
        handle = apply_tread(model, ROUTE)
    assert len(seen) == 1 and "\n" not in str(seen[0].message)
    model.train()
    model(**inputs)
    assert handle.last_keep[0].shape == (B, math.prod(grid) // 2)


@pytest.mark.parametrize("dropped", ["encoder_attention_mask", "hidden_states"])
def test_a_forward_without_what_routing_reads_is_refused_naming_it(monkeypatch, dropped):
    model, _, _ = build("lumina2")
    original = inspect.signature(type(model).forward)

    def forward(self, *args, **kwargs):
        return args[0]
    forward.__signature__ = original.replace(parameters=[p for n, p in original.parameters.items() if n != dropped])
    monkeypatch.setattr(type(model), "forward", forward)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(UserError, match=rf"Lumina2Transformer2DModel.forward has no parameter {dropped},") as err:
            apply_tread(model, ROUTE)
    assert "\n" not in str(err.value) and not model._forward_pre_hooks


def test_bench_runs_lumina2_with_padded_captions(tmp_path):
    """lab/bench_diffusers.py on a tiny Lumina2 (its inputs: captions of two lengths, so a padded, masked batch):
    the routed step needs fewer FLOPs."""
    out = tmp_path / "bench.json"
    bench_diffusers.main(["--archs", "lumina2", "--width", "64", "--depth", "4", "--tokens-side", "4",
                          "--batch-size", "2", "--rounds", "1", "--steps", "1",
                          "--threads", str(torch.get_num_threads()), "--out", str(out)])
    row, = json.loads(out.read_text())["rows"]
    assert (row["arch"], row["tokens"]) == ("lumina2", 16)
    assert row["flops_routed"] < row["flops_unrouted"] and row["flop_bound"] > 1.0
