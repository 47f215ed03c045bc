"""Routing on a backbone that is not a DiT (state-space blocks), and the FLOP/memory report."""
import pytest
import torch

from conftest import run_script
from dit import get_model
from training.flops import analytic_training_flops, format_report, routing_flop_report


def ssm_model(routes, enable_routing=True):
    torch.manual_seed(0)
    model = get_model("DiS-T/2", dict(num_classes=10, in_channels=1, input_size=16, enable_routing=enable_routing,
                                      routes=routes, depth=6, hidden_size=32))
    for name, p in model.named_parameters():
        if "adaLN" in name or "final_layer" in name:
            torch.nn.init.normal_(p, std=0.05)
    return model


def test_ssm_backbone_routes_tokens_and_restores_them():
    model = ssm_model([dict(start_layer_idx=1, end_layer_idx=3, selection_ratio=0.5)]).train()
    seen = []
    for i, b in enumerate(model.blocks):
        b.register_forward_hook(lambda m, a, out, i=i: seen.append((i, a[0].detach(), out.detach())))
    x = torch.randn(2, 1, 16, 16, requires_grad=True)
    out = model(x, torch.rand(2), torch.tensor([1, 10]))
    assert [inp.shape[1] for _, inp, _ in seen] == [64, 32, 32, 32, 64, 64]
    entering, restored = seen[0][2], seen[4][1]
    changed = (restored != entering).any(-1)
    assert (changed.sum(1) == 32).all()
    assert torch.equal(restored[~changed], entering[~changed])
    out.square().sum().backward()
    assert (x.grad.abs() > 0).all()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())
    seen.clear()
    model.eval()(x, torch.rand(2), torch.tensor([1, 10]))
    assert all(inp.shape[1] == 64 for _, inp, _ in seen), "eval mode never routes"


@pytest.mark.parametrize("backbone, size, routes", [
    ("DiS-T/2", 16, [dict(start_layer_idx=2, end_layer_idx=8, selection_ratio=0.5)]),
    ("DiT-T/2", 16, [dict(start_layer_idx=0, end_layer_idx=3, selection_ratio=0.25),
                     dict(start_layer_idx=5, end_layer_idx=-2, selection_ratio=0.75)]),
    ("DiT-B/2", 32, [dict(start_layer_idx=2, end_layer_idx=8, selection_ratio=0.5)]),
])
def test_report_matches_flop_counter_within_one_percent(backbone, size, routes):
    params = dict(num_classes=10, in_channels=4, input_size=size, enable_routing=True, routes=routes)
    report = routing_flop_report(backbone, params, batch_size=3)
    assert report["analytic_flops_dense"] == pytest.approx(report["flops_per_step_dense"], rel=0.01)
    assert report["analytic_flops_routed"] == pytest.approx(report["flops_per_step_routed"], rel=0.01)
    assert report["flops_per_step_routed"] < report["flops_per_step_dense"]
    assert 0 < report["activation_memory_fraction"] < 1


def dis_t2_training_flops(tokens_per_block, batch):
    """Training FLOPs of DiS-T/2 (width 128, MLP 512, SSM state 16) on 1-channel 16 x 16 inputs (64 tokens of
    4 values), counted by hand from its layers: the backward pass costs twice the forward, except where the
    input needs no gradient (patch embedding, the timestep MLP's first layer on 256 frequencies)."""
    D, H, S, N, P = 128, 512, 16, 64, 4
    per_sample = 2 * D * D + 2 * D * 2 * D + 2 * N * D * P  # timestep MLP's 2nd layer; final adaLN and linear
    per_batch = 0
    for n in tokens_per_block:
        per_sample += 2 * D * 6 * D                              # adaLN modulation, once per sample
        per_sample += 2 * n * (D * 2 * D + D * D + 2 * D * H)    # in_proj, out_proj, MLP up and down
        per_sample += 2 * n * n * D                              # the Toeplitz token mixing: quadratic in n
        per_batch += 2 * 2 * D * S * n                           # forward and backward scan kernels, per batch
    return batch * (3 * per_sample + 2 * (2 * N * P * D + 2 * 256 * D)) + 3 * per_batch


def test_ssm_flops_fall_as_the_report_says():
    """The report (torch's FLOP counter, and the analytic count) against a count written out by hand."""
    params = dict(num_classes=10, in_channels=1, input_size=16, enable_routing=True,
                  routes=[dict(start_layer_idx=2, end_layer_idx=8, selection_ratio=0.5)])
    report = routing_flop_report("DiS-T/2", params, batch_size=4)
    routed_tokens = [64, 64] + [32] * 7 + [64] * 3
    assert report["tokens_per_block"] == routed_tokens
    dense, routed = dis_t2_training_flops([64] * 12, 4), dis_t2_training_flops(routed_tokens, 4)
    assert (report["flops_per_step_dense"], report["flops_per_step_routed"]) == (dense, routed)
    assert (report["analytic_flops_dense"], report["analytic_flops_routed"]) == (dense, routed)
    assert report["flop_speedup_bound"] == pytest.approx(1.41909, abs=1e-5) == dense / routed


def test_report_command_and_ssm_training(tmp_path):
    proc = run_script("training.flops", "model=tread", "model.params.routes.0.start_layer_idx=2",
                      "model.params.routes.0.end_layer_idx=8", "model.params.routes.0.selection_ratio=0.5", check=True)
    # the digits preset (DiT-D/4, 16 tokens), route 2 -> 8 at 0.5: blocks 3-8 see 8 tokens
    assert "speed-up bound 1.403x" in proc.stdout
    assert "tokens per block [16, 16, 8, 8, 8, 8, 8, 8, 8, 16, 16, 16]" in proc.stdout
    proc = run_script("train.py", f"results_dir={tmp_path}", "run_name=dis", "model=tread",
                      "model.backbone_type=DiS-T/2", "+model.params.depth=4", "+model.params.hidden_size=32",
                      "model.params.routes.0.start_layer_idx=1", "model.params.routes.0.end_layer_idx=2",
                      "train.max_steps=4", "train.ckpt_every=4", "train.eval.eval_interval=0",
                      "train.general.batch_size=8", check=True)
    assert "FLOPs per training step (DiS-T/2" in proc.stdout


def test_report_states_the_cost_of_the_float32_block_after_a_route():
    params = dict(num_classes=1000, in_channels=4, input_size=32,
                  routes=[dict(selection_ratio=0.5, start_layer_idx=2, end_layer_idx=8)])
    report = routing_flop_report("DiT-B/2", params, batch_size=2)
    # the paper's setting, 7 of 12 blocks on 128 of 256 tokens: the bound is 1.426 (the paper quotes about 1.4)
    assert report["flop_speedup_bound"] == pytest.approx(1.4259, abs=1e-4)
    one_block = analytic_training_flops("DiT-B/2", {**params, "routes": []}, 2, routing=False) / 12
    assert report["fp32_blocks"] == [9]
    assert report["fp32_flop_fraction"] == pytest.approx(one_block / report["flops_per_step_routed"], rel=0.02)
    assert "block(s) [9] after the route run in float32" in format_report("DiT-B/2", report, 2)
    assert "block(s) [9] after the route run in float32" in format_report("DiT-B/2", report, 2, "bf16")
    without = format_report("DiT-B/2", report, 2, "no")  # no autocast: every block is float32, and it says so
    assert "every block runs in float32 (train.mixed_precision=no)" in without and " run in float32 under" not in without
    off = routing_flop_report("DiT-B/2", {**params, "fp32_after_route": False}, batch_size=2)
    assert off["fp32_blocks"] == [] and off["fp32_flop_fraction"] == 0 and "float32" not in format_report(
        "DiT-B/2", off, 2)
