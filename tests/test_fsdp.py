"""train.distributed=fsdp2 on the CPU (2 gloo processes): the DiT trains to the parameters of the DDP run; killed
with kill -9 and resumed it ends bit for bit where an uninterrupted FSDP2 run ends; its checkpoints export and
evaluate as any run's; what it does not shard is refused in one line. And a LoRA on a tiny diffusers FLUX routed
by `apply_tread`, sharded by `tread_diffusers.shard_blocks`, gets the gradients of one process."""
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from accelerate import Accelerator
from omegaconf import OmegaConf

from conftest import once_per_session, run_forked_ranks
from test_config_schema import compose_train
from train_runs import assert_bit_identical, final_state, records, run_args, run_train
from training import checkpoint as ckpt
from training.config_check import check_train_config
from training.in_training_eval import TrainingEvaluator
from tread_utils.distributed import set_cpu_threads
from tread_utils.errors import UserError

# Block recomputation on: the routes must pick the same tokens when a block is recomputed in the backward pass.
FSDP2 = ["train.distributed=fsdp2", "+model.params.grad_checkpointing=true"]


def fsdp_args(root, name):
    return [*run_args(root, name), *FSDP2]


@pytest.fixture(scope="session")
def sharded(tmp_path_factory):
    """An uninterrupted 2-process FSDP2 run, as `straight` (DDP) but sharded: 8 steps, evaluated at 4 and 8."""
    def make(root):
        proc = run_train(*fsdp_args(root, "fsdp"), processes=2)
        return [str(root / "fsdp"), proc.stdout]

    folder, stdout = once_per_session(tmp_path_factory, "sharded", make)
    return Path(folder), stdout


def test_fsdp2_trains_the_parameters_of_ddp(sharded, straight):
    """Same seeds, data and routes: the same model, EMA, optimizer state, losses and in-training FIDs as the DDP
    run (to float tolerance: the gradients are averaged by a reduce-scatter instead of an all-reduce)."""
    folder, stdout = sharded
    assert "sharded over 2 processes, 4 blocks and the root" in stdout, stdout
    a, b = final_state(folder), final_state(straight)
    assert a["step"] == b["step"] == 8 and a["config"]["train"]["distributed"] == "fsdp2"
    for key in ("model", "ema"):
        assert a[key].keys() == b[key].keys()
        for name in a[key]:
            torch.testing.assert_close(a[key][name].cpu(), b[key][name].cpu(), rtol=1e-5, atol=1e-6, msg=name)
    for (i, sa), sb in zip(a["optimizer"]["state"].items(), b["optimizer"]["state"].values()):
        for k in sa:
            torch.testing.assert_close(sa[k].cpu(), sb[k].cpu(), rtol=1e-5, atol=1e-8, msg=f"{i}.{k}")
    for key in ("loss", "fid"):
        got, want = records(folder, key), records(straight, key)
        assert got.keys() == want.keys() and got == pytest.approx(want, rel=1e-4), key


def test_fsdp2_killed_mid_step_resumes_bit_identical(tmp_path, sharded):
    """Both ranks SIGKILLed inside step 6, after the checkpoint of step 4: the same launch again ends where the
    uninterrupted FSDP2 run ends, bit for bit (weights, EMA, optimizer, every rank's streams, logs)."""
    folder, _ = sharded
    killed = run_train("mid_step", 6, *fsdp_args(tmp_path, "killed"), script="tests/train_killed_at.py",
                       processes=2, expect=None)
    assert killed.returncode != 0 and "SIGKILL" in killed.stderr, killed.stderr[-3000:]
    assert final_state(tmp_path / "killed")["step"] == 4
    resumed = run_train(*fsdp_args(tmp_path, "killed"), processes=2)
    assert "at step 4" in resumed.stdout and "re-seeded" not in resumed.stdout, resumed.stdout
    assert_bit_identical(final_state(folder), final_state(tmp_path / "killed"))
    for key in ("loss", "fid"):
        assert records(tmp_path / "killed", key) == records(folder, key), key


def test_fsdp2_checkpoint_exports_and_evaluates(tmp_path, sharded):
    """The FSDP2 run's step-8 checkpoint (the full state, one file) exports with tools.export and loads for
    sampling; both give the EMA the run evaluated in training: the FID it logged, recomputed by one process."""
    from tools import export

    folder, _ = sharded
    state = final_state(folder)
    export.main([str(folder), "--out", str(tmp_path / "exported")])
    exported, _ = ckpt.load_sampling_net(tmp_path / "exported")
    net, _ = ckpt.load_sampling_net(folder)
    for loaded in (exported, net):
        weights = loaded.model.state_dict()
        assert all(torch.equal(weights[name], value) for name, value in state["ema"].items())
    threads = torch.get_num_threads()
    set_cpu_threads(state["config"]["train"]["cpu_threads"], 2)  # each rank's: the reference features' last bits
    try:
        scores = TrainingEvaluator(OmegaConf.create(state["config"]), Accelerator(cpu=True), tmp_path)(exported, 8)
    finally:
        set_cpu_threads(threads, 1)
    assert scores["fid"] == records(folder, "fid")[8]


@pytest.mark.parametrize("overrides, world, needle", [
    ([], 1, "with a single process; launch several"), (["repa.enabled=true"], 2, "repa.enabled=true"),
    (["train.compile=true"], 2, "train.compile=true"), (["train.mixed_precision=fp16"], 2, "fp16"),
    (["train.distributed=zero3"], 2, "train.distributed=zero3 is not allowed: it must be one of ddp, fsdp2")])
def test_fsdp2_refuses_what_it_does_not_shard(overrides, world, needle):
    with pytest.raises(UserError, match=needle):
        check_train_config(compose_train("train.distributed=fsdp2", *overrides), world_size=world)
    assert check_train_config(compose_train("train.distributed=fsdp2"), world_size=2).config.train.distributed == "fsdp2"


# ---- a LoRA on a tiny diffusers FLUX, routed by apply_tread and sharded per block ----

def lora_flux(checkpointing: bool):
    """A random 2 + 2-block FLUX, LoRA adapters with random (non-zero) weights, the route 1 -> 2 at 0.5."""
    from tools.diffusers_toy import random_flux
    from tools.finetune_lora import add_lora
    from tread_diffusers import apply_tread

    transformer = random_flux(1, 32, 2, 2, 2, 16, seed=0)
    g = torch.Generator().manual_seed(1)
    for p in add_lora(transformer, 4):
        p.data.copy_(torch.randn(p.shape, generator=g) * 0.1)
    if checkpointing:
        transformer.enable_gradient_checkpointing()
    apply_tread(transformer, {"routes": [{"selection_ratio": 0.5, "start_layer_idx": 1, "end_layer_idx": -2}]})
    return transformer.train()


def half_loss(transformer, rank: int):
    """The flow-matching loss of rank `rank`'s half of the batch, its noise and routes from its own seed."""
    from tools.diffusers_toy import flow_matching_loss

    g = torch.Generator().manual_seed(10 + rank)
    latents, text, pooled = torch.randn(2, 16, 4, generator=g), torch.randn(2, 4, 16, generator=g), \
        torch.randn(2, 16, generator=g)
    torch.manual_seed(100 + rank)
    return flow_matching_loss(transformer, latents, text, pooled)


def lora_grads(transformer, whole=lambda g: g) -> dict:
    return {n: whole(p.grad) for n, p in transformer.named_parameters() if p.requires_grad}


def _flux_rank(rank, store, out):
    from tread_diffusers import shard_blocks

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    transformer = lora_flux(checkpointing=True)
    assert shard_blocks(transformer) == 4
    half_loss(transformer, rank).backward()
    grads = lora_grads(transformer, lambda g: g.full_tensor())  # a collective: both ranks
    if rank == 0:
        torch.save(grads, out)
    dist.destroy_process_group()


def test_fsdp2_lora_on_routed_flux_gets_the_one_process_gradients(tmp_path):
    """Two ranks, each its half of the batch, the blocks sharded and recomputed (gradient checkpointing): the
    LoRA gradients of one unsharded process that takes both halves with the ranks' seeds, without checkpointing."""
    import peft  # noqa: F401  (imported here once, not by each forked rank)
    from diffusers import FluxTransformer2DModel  # noqa: F401

    run_forked_ranks(_flux_rank, tmp_path / "store", tmp_path / "grads.pt")
    transformer = lora_flux(checkpointing=False)
    ((half_loss(transformer, 0) + half_loss(transformer, 1)) / 2).backward()
    want, got = lora_grads(transformer), torch.load(tmp_path / "grads.pt", weights_only=True)
    assert got.keys() == want.keys() and len(want) > 20
    assert any(name.startswith("single_transformer_blocks") for name in want)
    for name in want:
        assert want[name].abs().max() > 0, name
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-6, msg=name)
