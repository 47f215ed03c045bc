"""On a CUDA GPU: mixed precision, compilation, RNG state, fused AdamW, sampling. Skipped without a GPU;
run them alone with `python -m pytest -m cuda`."""
import json

import pytest
import torch
from torch._dynamo.utils import counters

from conftest import run_script, tiny_overrides
from data.decoders import IdentityDecoder
from dit import get_model
from edm import EDMLoss, EDMPrecond
from generation import generate
from training import checkpoint as ckpt
from training.loop import build_adamw
from tread_utils.precision import precision_policy, set_precision_policy

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
DEVICE = torch.device("cuda")


def small(routed=True, in_channels=4, **extra):
    torch.manual_seed(0)
    routes = [dict(selection_ratio=0.5, start_layer_idx=1, end_layer_idx=2)]
    return get_model("DiT-T/2", dict(num_classes=10, in_channels=in_channels, input_size=16, enable_routing=routed,
                                     depth=4, routes=routes, **extra)).to(DEVICE)


def test_compiled_routed_bf16_training_compiles_per_shape_not_per_step():
    torch._dynamo.reset()
    counters.clear()
    model = small()
    net, loss_fn, opt = EDMPrecond(model), EDMLoss(), build_adamw(model.parameters())
    net.model = torch.compile(model)
    frames = []
    for batch in (16, 16, 16, 32, 32, 16, 8):
        x, y = torch.randn(batch, 4, 16, 16, device=DEVICE), torch.randint(0, 10, (batch,), device=DEVICE)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = loss_fn(net, x, y).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        frames.append(counters["frames"]["total"])
    assert frames[0] == frames[1] == frames[2]          # same shape: no recompilation per step
    assert frames[-1] <= frames[0] + 2                  # a new batch size: at most one dynamic recompile
    assert torch.isfinite(loss)


def test_block_after_a_route_runs_in_float32_under_bf16():
    model = small().train()
    seen = {}
    for i, block in enumerate(model.blocks):
        block.register_forward_pre_hook(lambda m, args, i=i: seen.__setitem__(
            i, (args[0].dtype, torch.is_autocast_enabled("cuda"))))
    x, t, y = torch.randn(4, 4, 16, 16, device=DEVICE), torch.rand(4, device=DEVICE), torch.zeros(4, dtype=torch.long,
                                                                                                    device=DEVICE)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        model(x, t, y)
    assert seen[3] == (torch.float32, False)
    assert seen[2][1] is True


def test_precision_policy_and_fused_adamw_on_cuda():
    set_precision_policy(True)
    assert torch.backends.cuda.matmul.allow_tf32 and precision_policy()["tf32_matmul"]
    assert build_adamw(small().parameters()).defaults["fused"] is True


def test_rng_state_round_trip_on_the_current_gpu():
    state = ckpt.capture_rng_state()
    a = torch.rand(5, device=DEVICE)
    ckpt.restore_rng_state(state)
    assert torch.equal(a, torch.rand(5, device=DEVICE))


def test_generation_on_cuda_does_not_depend_on_the_batch_size():
    net = EDMPrecond(small(routed=False, in_channels=1)).eval()
    kw = dict(sampler_kwargs={"num_steps": 4}, decoder=IdentityDecoder(), progress=False)
    a, la = generate(net, range(6), batch_size=2, **kw)
    b, lb = generate(net, range(6), batch_size=4, **kw)
    assert (a == b).all() and (la == lb).all()


def test_train_py_bf16_compiled_with_evaluation(tmp_path):
    proc = run_script("train.py", f"results_dir={tmp_path}", "run_name=gpu", *tiny_overrides("tread"),
                      "train.mixed_precision=bf16", "train.compile=true", "train.max_steps=20", "train.ckpt_every=10",
                      "train.eval.eval_interval=20", "train.eval.fid_num_samples=256", "train.logging.log_interval=10",
                      timeout=600, check=True)
    records = [json.loads(line) for line in (tmp_path / "gpu" / "metrics.jsonl").read_text().splitlines()]
    assert any("fid" in r for r in records), proc.stdout[-2000:]
    assert all(r["loss"] == r["loss"] for r in records if "loss" in r)
