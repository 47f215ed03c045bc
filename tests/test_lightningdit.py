"""The LightningDiT backbone (backbones/lightningdit.py): its registry sizes, the rotary angles of kept tokens inside
a route, its FLOP count, one compiled graph, and a training run of `model=tread model.backbone_type=LightningDiT-*`."""
import json
import math

import pytest
import torch
import torch._dynamo
from hydra import compose, initialize_config_dir

import backbones.lightningdit as lightningdit
import routing_module
from conftest import REPO, TINY_MODEL, TINY_ROUTE, TINY_TRAIN
from dit import DiT_models, get_model
from training import loop
from training.config_check import check_train_config
from training.flops import routing_flop_report
from tread_utils.errors import UserError

DATA = dict(num_classes=10, in_channels=1, input_size=16)


@pytest.mark.parametrize("name, depth, width, heads, patch", [
    ("LightningDiT-D/4", 12, 64, 4, 4), ("LightningDiT-T/2", 12, 128, 4, 2), ("LightningDiT-B/2", 12, 768, 12, 2),
    ("LightningDiT-XL/1", 28, 1152, 16, 1), ("LightningDiT-XL/2", 28, 1152, 16, 2)])
def test_registry_builds_the_lightningdit_sizes(name, depth, width, heads, patch):
    with torch.device("meta"):
        model = get_model(name, dict(DATA, input_size=32))
    block = model.blocks[0]
    assert (len(model.blocks), model.patch_size, block.attn.num_heads) == (depth, patch, heads)
    assert isinstance(block, lightningdit.LightningDiTBlock) and block.mlp.w3.in_features == int(2 / 3 * 4 * width)
    assert isinstance(model.final_layer.norm_final, lightningdit.RMSNorm)  # LightningDiT's final norm
    assert "pos_embed" in dict(model.named_buffers())  # it keeps DiT's absolute embedding beside RoPE


def test_a_head_width_rope_cannot_split_is_refused():
    with pytest.raises(UserError, match="head width .* multiple of 4.*hidden_size 36 with 2 heads"):
        get_model("LightningDiT-T/2", dict(DATA, hidden_size=36, num_heads=2))


def test_kept_tokens_turn_by_their_own_grid_positions_in_a_routed_training_step(monkeypatch):
    """Every rotation of queries and keys against one written out from the kept indices and the 8 x 8 grid: the
    first half of a head turns with the row, the second with the column, pair i at 10000^(-2i / half)."""
    torch.manual_seed(0)
    model = get_model("LightningDiT-T/2", dict(DATA, depth=5, hidden_size=32, num_heads=2, enable_routing=True,
                                               routes=[dict(selection_ratio=0.5, start_layer_idx=1, end_layer_idx=3)]))
    kept, rotations = [], []
    select, rope = routing_module.select_kept_tokens, lightningdit.apply_rope
    monkeypatch.setattr(routing_module, "select_kept_tokens", lambda *a, **k: kept.append(select(*a, **k)) or kept[-1])
    monkeypatch.setattr(lightningdit, "apply_rope", lambda x, cos, sin: rotations.append((x, rope(x, cos, sin))) or
                        rotations[-1][1])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model.train()
    model(torch.randn(3, 1, 16, 16), torch.rand(3), torch.randint(0, 10, (3,))).square().mean().backward()
    optimizer.step()
    keep, = kept
    everywhere = torch.arange(64).expand(3, -1)
    assert [x.shape[2] for x, _ in rotations] == [64] * 2 + [32] * 6 + [64] * 2  # q and k of each of 5 blocks
    for block in range(5):
        tokens = keep if 1 <= block <= 3 else everywhere
        for x, rotated in rotations[2 * block:2 * block + 2]:
            torch.testing.assert_close(rotated.double(), by_hand(x.double(), tokens, grid=8), rtol=0, atol=1e-5)
    assert not torch.equal(keep, everywhere[:, :32])  # a random half, not the first 32 tokens


def by_hand(x, tokens, grid):
    """x [B, heads, n, d] turned as 2-D RoPE turns the tokens at flat grid indices `tokens` [B, n]."""
    out = x.clone()
    half = x.shape[-1] // 2
    for b in range(x.shape[0]):
        for j, token in enumerate(tokens[b].tolist()):
            for axis, position in enumerate((token // grid, token % grid)):
                for i in range(half // 2):
                    angle = position * 10000.0 ** (-2 * i / half)
                    c, s = math.cos(angle), math.sin(angle)
                    first, second = axis * half + 2 * i, axis * half + 2 * i + 1
                    x0, x1 = x[b, :, j, first], x[b, :, j, second]
                    out[b, :, j, first], out[b, :, j, second] = x0 * c - x1 * s, x0 * s + x1 * c
    return out


def test_flop_report_counts_lightningdit_exactly():
    """The analytic count (the block's `forward_flops`: SwiGLU's 3 matmuls of width 2/3 * 4D) equals torch's
    FLOP counter on the model, dense and routed."""
    params = dict(DATA, in_channels=4, enable_routing=True,
                  routes=[dict(selection_ratio=0.5, start_layer_idx=2, end_layer_idx=8)])
    report = routing_flop_report("LightningDiT-T/2", params, batch_size=3)
    assert report["analytic_flops_dense"] == report["flops_per_step_dense"]
    assert report["analytic_flops_routed"] == report["flops_per_step_routed"]
    assert 1.3 < report["flop_speedup_bound"] < 1.5


def test_routed_lightningdit_traces_into_one_graph_without_breaks():
    torch.manual_seed(0)
    model = get_model("LightningDiT-T/2", dict(DATA, depth=6, hidden_size=32, num_heads=2, enable_routing=True,
                                               grad_checkpointing=True,
                                               routes=[dict(selection_ratio=0.5, start_layer_idx=1, end_layer_idx=3)]))
    torch._dynamo.reset()
    found = torch._dynamo.explain(model.train())(torch.randn(4, 1, 16, 16), torch.rand(4), torch.randint(0, 10, (4,)))
    assert (found.graph_count, found.graph_break_count) == (1, 0), found.break_reasons


def test_config_model_tread_with_a_lightningdit_backbone_trains(tmp_path, monkeypatch):
    """Two optimizer steps of LightningDiT blocks with the route 1 -> 2 at 0.5 in them: the blocks inside the route
    see half the tokens, the loss is logged, and the checkpoint holds LightningDiT weights the steps moved."""
    tokens = []
    forward = lightningdit.LightningDiTBlock.forward

    def counted(self, x, *args):
        if x.device.type != "meta":  # not the FLOP report's passes
            tokens.append(x.shape[1])
        return forward(self, x, *args)
    monkeypatch.setattr(lightningdit.LightningDiTBlock, "forward", counted)
    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base="1.3"):
        cfg = compose("config", overrides=[f"results_dir={tmp_path}", "run_name=ldit", "model=tread",
                                           "model.backbone_type=LightningDiT-T/2", *TINY_MODEL, *TINY_ROUTE,
                                           *TINY_TRAIN, "train.general.num_workers=0", "train.logging.log_interval=1",
                                           "train.max_steps=2", "train.ckpt_every=2"])
    checked = check_train_config(cfg, world_size=1)
    loop.training_loop(checked)
    records = [json.loads(line) for line in (tmp_path / "ldit" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r]
    assert len(losses) == 2 and all(math.isfinite(v) for v in losses)
    assert tokens == [64, 32, 32, 64] * 2, tokens  # 8 x 8 patches; blocks 1 and 2 inside the route
    state = torch.load(tmp_path / "ldit" / "checkpoints" / "ckpt_00000002.pt", weights_only=False)
    assert state["step"] == 2 and "blocks.0.mlp.w12.weight" in state["model"]
    assert state["config"]["model"]["backbone_type"] == "LightningDiT-T/2"
    moved = [k for k, v in state["model"].items() if not torch.equal(v, state["ema"][k])]
    assert any(k.startswith("blocks.") for k in moved)  # the EMA lags the optimizer's steps
    assert DiT_models["LightningDiT-T/2"]["block_type"] == "lightningdit"
