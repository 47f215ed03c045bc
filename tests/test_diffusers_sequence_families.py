"""TREAD on Ernie (sequence-first blocks) and MiniMax H3 (one packed sequence), diffusers_sequence_families.py:
the checks every family gets (tests/test_diffusers_tread.py's, run here on these two), and those written for
their layouts: a routed forward against one built by hand, each kept token's RoPE rows and modulation, the text
and conditioning rows never routed, negative indices on the token axis, the layouts refused, and torch.compile."""
import math
import os

import pytest
import torch

pytest.importorskip("diffusers")
import test_diffusers_compile as compile_checks  # noqa: E402
import test_diffusers_tread as shared  # noqa: E402
import test_diffusers_versions as versions  # noqa: E402
from diffusers_tiny import B, blocks_of, bound, build  # noqa: E402
from diffusers_tiny_sequence import minimax_layout  # noqa: E402
from tread_diffusers import apply_tread  # noqa: E402
from tread_utils.errors import UserError  # noqa: E402

NAMES = ("ernie", "minimax")
ROUTE = {"routes": [{"selection_ratio": 0.5, "start_layer_idx": 1, "end_layer_idx": -2}]}
KEY = {"ernie": "x", "minimax": "hidden_states"}  # the blocks' token argument
ROPE = {"ernie": "rotary_pos_emb", "minimax": "rotary_emb"}


@pytest.mark.parametrize("name", NAMES)
def test_the_checks_every_family_gets(name, monkeypatch):
    shared.run_the_checks_every_family_gets(name)
    versions.test_each_block_parameter_the_family_reads_is_checked(monkeypatch, name)


def batch_first(name, x):
    return x.transpose(0, 1) if name == "ernie" else x


def block_inputs(name, model, inputs):
    """Every block's (bound) inputs in an unrouted pass."""
    seen, hooks = {}, []
    for i, block in enumerate(blocks_of(model)):
        hooks.append(block.register_forward_pre_hook(lambda m, a, k, i=i: seen.__setitem__(i, bound(m, a, k)),
                                                     with_kwargs=True))
    with torch.no_grad():
        model(**inputs)
    for hook in hooks:
        hook.remove()
    return seen


class HandRows:
    """Per-sample rows [B, L, rotary_dim] seen by MiniMax H3's `cos.shape[-1]`, `cos.to(dtype)[None, :, None, :]`."""

    def __init__(self, table):
        self.table, self.shape = table, table.shape

    def to(self, dtype):
        return HandRows(self.table.to(dtype))

    def __getitem__(self, index):
        assert index == (None, slice(None), None, slice(None)), index
        return self.table[:, :, None]


def narrow_by_hand(name, kw, keep, lead, n):
    """A routed block's other inputs, sample by sample: each sample's kept rows and the rows of the text
    (Ernie: after the image) or of the conditioning (MiniMax H3: before the target)."""
    per_sample = lambda f: torch.stack([f(b) for b in range(B)])  # noqa: E731
    if name == "ernie":
        rows = [torch.cat([keep[b], torch.arange(n, kw["rotary_pos_emb"].shape[1])]) for b in range(B)]
        kw["rotary_pos_emb"] = per_sample(lambda b: kw["rotary_pos_emb"][b, rows[b]])
        kw["temb"] = [torch.stack([t[rows[b], b] for b in range(B)], 1) for t in kw["temb"]]
        kw["attention_mask"] = per_sample(lambda b: kw["attention_mask"][b][..., rows[b]])
    else:
        rows = [torch.cat([torch.arange(lead), lead + keep[b]]) for b in range(B)]
        kw["rotary_emb"] = tuple(HandRows(per_sample(lambda b: t[rows[b]])) for t in kw["rotary_emb"])
        kw["adaln_indices"] = kw["adaln_indices"][:lead + keep.shape[1]]


def reference_forward(name, model, inputs, keep, start, end, n):
    """The blocks from `start` run by hand on the kept tokens, which are scattered back after `end`: the last
    block's output [B, S, D]."""
    seen, blocks = block_inputs(name, model, inputs), blocks_of(model)
    x = batch_first(name, seen[start][KEY[name]])
    lead = 0 if name == "ernie" else x.shape[1] - n
    rows = torch.arange(B)[:, None]
    x_full = x[:, lead:lead + n]
    x = torch.cat([x[:, :lead], x_full[rows, keep], x[:, lead + n:]], 1)
    for i in range(start, len(blocks)):
        kw = dict(seen[i], **{KEY[name]: batch_first(name, x)})
        if i <= end:
            narrow_by_hand(name, kw, keep, lead, n)
        x = batch_first(name, blocks[i](**kw))
        if i == end:
            full = x_full.clone()
            full[rows, keep] = x[:, lead:lead + keep.shape[1]]
            x = torch.cat([x[:, :lead], full, x[:, lead + keep.shape[1]:]], 1)
    return x


@pytest.mark.parametrize("name", NAMES)
def test_routed_forward_matches_hand_built_reference(name):
    model, inputs, grid = build(name)
    n = math.prod(grid)
    handle = apply_tread(model, ROUTE)
    blocks = blocks_of(model)
    last, first_routed = {}, {}
    hooks = [blocks[-1].register_forward_hook(lambda m, a, out: last.__setitem__("x", batch_first(name, out))),
             blocks[1].register_forward_pre_hook(lambda m, a, k: first_routed.update(bound(m, a, k)), with_kwargs=True)]
    model.train()
    shared.run(model, inputs)
    for hook in hooks:
        hook.remove()
    keep = handle.last_keep[0]
    assert keep.shape == (B, n // 2) and keep.max() < n and not torch.equal(keep[0], keep[1])
    model.eval()
    unrouted = batch_first(name, block_inputs(name, model, inputs)[1][KEY[name]])
    routed = batch_first(name, first_routed[KEY[name]])
    # the text (Ernie: after the image) and the conditioning rows (MiniMax H3: before the target) enter whole
    others = (slice(n // 2, None), slice(n, None)) if name == "ernie" else (slice(None, -n // 2), slice(None, -n))
    assert torch.equal(routed[:, others[0]], unrouted[:, others[1]].detach())
    with torch.no_grad():
        ref = reference_forward(name, model, inputs, keep, 1, len(blocks) - 2, n)
        torch.testing.assert_close(last["x"], ref, rtol=1e-5, atol=1e-5)
        every = torch.arange(n).expand(B, -1)  # the unrouted last block differs: the check tells them apart
        assert not torch.allclose(reference_forward(name, model, inputs, every, 1, len(blocks) - 2, n), ref, atol=1e-4)


def rope_seen(name, model):
    """Each block attention's RoPE (Ernie: [B, S, 1, head_dim]; MiniMax H3: cos [S, rotary_dim] or RowsRope)."""
    seen, hooks = {}, []
    for i, block in enumerate(blocks_of(model)):
        if name == "ernie":
            hooks.append(block.self_attention.register_forward_pre_hook(
                lambda m, a, k, i=i: seen.__setitem__(i, k["image_rotary_emb"]), with_kwargs=True))
        else:
            hooks.append(block.attn.register_forward_pre_hook(lambda m, a, i=i: seen.__setitem__(i, a[1][0])))
    return seen, hooks


def rows_match(name, table, full, keep, n):
    """Each sample's rows in a routed block: Ernie its kept image rows then the text's; MiniMax H3 the
    conditioning rows then its kept target rows."""
    if name == "ernie":
        k = keep.shape[1]
        return all(torch.equal(table[b, :k], full[b, keep[b]]) and torch.equal(table[b, k:], full[b, n:])
                   for b in range(B))
    table, lead = table.table, full.shape[0] - n
    return all(torch.equal(table[b, :lead], full[:lead]) and torch.equal(table[b, lead:], full[lead + keep[b]])
               for b in range(B))


@pytest.mark.parametrize("name", NAMES)
def test_each_kept_token_keeps_its_rope_rows(name):
    model, inputs, grid = build(name)
    n = math.prod(grid)
    seen, hooks = rope_seen(name, model)
    model.eval()
    with torch.no_grad():
        model(**inputs)
    full = dict(seen)
    handle = apply_tread(model, ROUTE)
    model.train()
    model(**inputs)
    keep, r = handle.last_keep[0], handle.routes[0]
    shuffled = keep[:, torch.randperm(keep.shape[1])]
    for i, table in seen.items():
        if r.start_layer_idx <= i <= r.end_layer_idx:
            assert rows_match(name, table, full[i], keep, n) and not rows_match(name, table, full[i], shuffled, n)
        else:
            assert torch.equal(table, full[i])
    for hook in hooks:
        hook.remove()


@pytest.mark.parametrize("name", NAMES)
def test_negative_indices_count_from_the_last_block(name):
    model, inputs, _ = build(name)
    blocks, axis = blocks_of(model), 0 if name == "ernie" else 1
    handle = apply_tread(model, {"routes": [{"selection_ratio": 0.5, "start_layer_idx": -2, "end_layer_idx": -1}]})
    lengths = {}
    hooks = [b.register_forward_pre_hook(lambda m, a, k, i=i: lengths.__setitem__(
        i, bound(m, a, k)[KEY[name]].shape[axis]), with_kwargs=True) for i, b in enumerate(blocks)]
    model.train()
    shared.run(model, inputs)
    n = max(lengths.values())
    assert [lengths[i] < n for i in range(len(blocks))] == [False] * (len(blocks) - 2) + [True, True]
    assert (handle.routes[0].start_layer_idx, handle.routes[0].end_layer_idx) == (len(blocks) - 2, len(blocks) - 1)
    for hook in hooks:
        hook.remove()


def test_minimax_layout_without_the_target_last_is_refused_in_one_line():
    model, inputs, _ = build("minimax")
    apply_tread(model, ROUTE)
    model.train()
    order = torch.cat([torch.arange(5), torch.arange(12, 36), torch.arange(5, 12)])  # the audio rows moved last
    moved = {k: inputs[k][order] for k in ("timestep_indices", "token_tags", "position_ids")}
    rows = {k: order.argsort()[inputs[k]] for k in ("video_indices", "audio_indices", "text_indices")}
    with pytest.raises(UserError, match="as the last rows of the packed sequence") as err:
        model(**dict(inputs, **moved, **rows))
    assert "\n" not in str(err.value)


def minimax_text_to_video():
    model, inputs, grid = build("minimax")
    layout = minimax_layout(conditions=0)
    return model, dict(inputs, hidden_states=inputs["hidden_states"][:, 4:], **layout), grid


@pytest.mark.parametrize("name", NAMES)
def test_routed_model_compiles_as_the_unrouted_one(name):
    model, inputs, _ = minimax_text_to_video() if name == "minimax" else build(name)
    model.train()
    unrouted, _, _ = compile_checks.compiled_steps(model, inputs, [0])
    handle = apply_tread(model, ROUTE)
    graphs, breaks, kept = compile_checks.compiled_steps(model, inputs, [0, 1, 2], handle)
    assert (graphs, breaks) == (unrouted, 0)
    assert not torch.equal(kept[0], kept[1])


def test_minimax_conditioning_rows_stop_a_compiled_forward():
    """Compiled, the rows are not read while tracing: a layout with conditioning video rows is stopped when the
    graph runs, in one line, not routed wrongly; the text-to-video layout runs, in one graph."""
    model, inputs, _ = build("minimax")
    apply_tread(model, ROUTE)
    model.train()
    for backend in ("eager", "aot_eager"):
        torch._dynamo.reset()
        with pytest.raises(UserError, match="run the routed model without torch.compile") as err:
            torch.compile(model, backend=backend)(**inputs)
        assert "\n" not in str(err.value)
    torch._dynamo.reset()
    _, text_to_video, _ = minimax_text_to_video()
    assert torch.isfinite(torch.compile(model, backend="aot_eager")(**text_to_video)[0]).all()


def test_minimax_modalities_are_diffusers():
    from diffusers.models.transformers.transformer_minimax_h3 import MINIMAX_H3_MODALITY_NUM

    from tread_diffusers.sequence_families import MODALITIES

    assert MODALITIES == MINIMAX_H3_MODALITY_NUM


def test_bench_runs_ernie_and_minimax(tmp_path):
    """lab.bench_diffusers on tiny sizes: each routed step needs fewer FLOPs."""
    import json

    from lab import bench_diffusers

    out = tmp_path / "bench.json"
    bench_diffusers.main(["--archs", "ernie", "minimax", "--width", "64", "--depth", "4", "--tokens-side", "4",
                          "--frames", "2", "--batch-size", "2", "--rounds", "1", "--steps", "1",
                          "--threads", str(torch.get_num_threads()), "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [(r["arch"], r["tokens"]) for r in rows] == [("ernie", 16), ("minimax", 32)]
    for row in rows:
        assert row["flops_routed"] < row["flops_unrouted"] and row["flop_bound"] > 1.0


@pytest.mark.skipif(not os.environ.get("TREAD_SIMPLETUNER"), reason="set TREAD_SIMPLETUNER=<SimpleTuner checkout>")
@pytest.mark.parametrize("name", NAMES)
def test_simpletuner_gives_our_outputs_and_gradients_on_the_same_kept_rows(name):
    """Bit-identical in every route layout; SimpleTuner's own count takes the ratio of the whole block sequence (text
    and conditioning rows included, all forced kept), so it keeps fewer image rows than the ratio says; with
    padded text (Ernie) it attends the padding while routed, and differs."""
    from lab.simpletuner_joint import compare_sequence_family
    from lab.simpletuner_models import LAYOUTS

    result = compare_sequence_family(name, os.environ["TREAD_SIMPLETUNER"], padded_text=True)
    assert result["baseline"] == (0.0, 0.0)
    rows = {r["layout"]: r for r in result["rows"]}
    for layout in LAYOUTS:
        row = rows[layout]
        assert row["error"] is None and row["diff"] == (0.0, 0.0) and row["blocks"][0] == row["blocks"][1], row
        assert all(theirs < ours for theirs, ours, _ in row["counts"]), row["counts"]
    assert rows["two routes 0..0, 2..3"]["blocks"][0] == [0, 2, 3]
    if name == "ernie":
        padded = rows["across lists 1..2, padded text"]
        assert padded["error"] is None and padded["diff"][0] > 1e-3
