"""train.distributed=fsdp2: the model, its EMA and the optimizer state sharded over the processes with torch's
FSDP2 (`fully_shard`, the primitive accelerate's FSDP2 plugin applies), each DiT block its own unit, then the
root. accelerate still starts the processes (`accelerate launch --multi_gpu`, or the config file
scripts/accelerate_fsdp2.yaml); train.py does the sharding itself, so the same code runs on GPUs over NCCL and
on CPUs over gloo (accelerate's own FSDP plugin takes GPUs only).

Checkpoints keep the DDP format: every rank takes part in gathering the full model, EMA and optimizer state and
the main process writes the one file, so sampling, `tools.export`, `fid.py` and `init_from` read an FSDP2 run's
checkpoints as they read any other, and a run may resume under the other mode or another process count.
Resuming loads the full state into the unsharded model and optimizer, and `prepare` then cuts each rank's shard
out of it: exact, as a DDP resume is.

Routes: each rank draws its kept tokens from its own torch stream (seeded from (global_seed, rank, step),
restored from the checkpoint), in `DiT.forward` before the route's first block, outside any checkpointed
block: recomputation under `model.params.grad_checkpointing` (non-reentrant, per block) gets the indices as an
input and draws nothing, so it sees the same tokens. FSDP2's hooks draw no random numbers, so a rank keeps the
tokens it would keep under DDP.

In-training evaluation samples from an unsharded copy of the EMA, gathered for it and dropped after.
"""
import torch
from torch.distributed.tensor import DTensor, distribute_tensor

from dit import DiT
from training.checkpoint import rng_untouched
from tread_utils.distributed import fully_shard_blocks
from tread_utils.errors import UserError


def sharded(cfg) -> bool:
    return cfg.train.distributed == "fsdp2"


def refuse_accelerate_fsdp(accelerator, mode: str):
    """accelerate's own FSDP (an accelerate config with distributed_type: FSDP) would wrap the model a second
    time and save it in its own format: one line instead."""
    if accelerator.distributed_type.name == "FSDP":
        raise UserError(f"the accelerate config asks for accelerate's FSDP (distributed_type: FSDP), which train.py "
                        f"does not use (train.distributed={mode}): launch with --multi_gpu or "
                        f"scripts/accelerate_fsdp2.yaml and set train.distributed=fsdp2 to shard")


def local_shard(full: torch.Tensor, like: DTensor) -> DTensor:
    """`full` (the same on every rank) cut as `like` is sharded, without communication."""
    return distribute_tensor(full.to(like.device), like.device_mesh, like.placements, src_data_rank=None)


def prepare(run, accelerator):
    """(the denoiser, the optimizer) of `run` with the model and EMA sharded, and the same optimizer over the
    shards with its (loaded) state cut as they are; the forward autocast as accelerate's `prepare` would."""
    old = run.optimizer
    state = old.state_dict()  # the loaded state, if any, before its parameters are replaced
    fully_shard_blocks(run.model, run.model.blocks)
    fully_shard_blocks(run.ema, run.ema.blocks)
    params = list(run.model.parameters())
    if len(params) != len(old.param_groups[0]["params"]) or len(old.param_groups) != 1:
        raise UserError("train.distributed=fsdp2 trains the model's parameters alone (repa.enabled=false)")
    old.param_groups[0]["params"] = params  # the same optimizer (its settings) over the shards
    old.state.clear()
    for index, saved in state["state"].items():
        p = params[index]
        old.state[p] = {k: local_shard(v, p) if v.ndim else v for k, v in saved.items()}
    if accelerator.is_main_process:
        local = sum(p.to_local().numel() for p in params)
        print(f"train.distributed=fsdp2: model, EMA and optimizer state sharded over {accelerator.num_processes} "
              f"processes, {len(run.model.blocks)} blocks and the root ({local:,} of "
              f"{sum(p.numel() for p in params):,} parameters on this rank)", flush=True)
    if accelerator.native_amp:
        from accelerate.utils import convert_outputs_to_fp32, get_mixed_precision_context_manager

        autocast = get_mixed_precision_context_manager(accelerator.native_amp, accelerator.autocast_handler)
        run.net.forward = convert_outputs_to_fp32(autocast(run.net.forward))
    return run.net, old


def full(value, keep: bool = True):
    """A DTensor gathered whole (a collective: every rank calls it), on the CPU where `keep`, else dropped at
    once (None): a rank holds one gathered tensor at a time. Anything else as it is."""
    if isinstance(value, DTensor):
        value = value.full_tensor()
        return value.cpu() if keep else None
    return value


def full_state(module: torch.nn.Module, keep: bool = True) -> dict:
    return {k: full(v, keep) for k, v in module.state_dict().items()}


def full_checkpoint_states(run) -> dict:
    """The model, EMA and optimizer states as an unsharded run saves them, on the main process (every rank must
    call this)."""
    keep = run.accelerator.is_main_process
    opt = run.optimizer.state_dict()
    opt = {**opt, "state": {i: {k: full(v, keep) for k, v in s.items()} for i, s in opt["state"].items()}}
    return {"model": full_state(run.model, keep), "ema": full_state(run.ema, keep), "optimizer": opt}


def unsharded_ema(run):
    """An unsharded copy of the EMA on this rank's device, for evaluation (every rank must call this). Built
    with the training streams untouched: the model's initialisation draws random numbers."""
    weights = {k: v.to(run.accelerator.device) for k, v in full_state(run.ema).items()}
    with rng_untouched():
        model = DiT(**run.model_args)  # the launch's checked arguments: the routes are not resolved again
    model.load_state_dict(weights)
    return model.requires_grad_(False).eval().to(run.accelerator.device)
