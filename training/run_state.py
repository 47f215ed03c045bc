"""A run's state in and out of its checkpoints: resuming (`load_training_state`), starting from another run's
weights (`init_weights`, `init_from=`), each rank's random streams (`seed_random_streams`) and the snapshot the
main process writes (`save_snapshot`, every rank's RNG state gathered; under FSDP2 the full states gathered)."""
import random
from typing import Optional

import numpy as np
import torch
from accelerate import Accelerator
from accelerate.utils import gather_object
from omegaconf import DictConfig, OmegaConf

from training import checkpoint as ckpt
from training import fsdp
from training.checkpoint_retention import prune_checkpoints
from training.progress import Progress
from training.repa import fit_optimizer_state, load_projector
from tread_utils.errors import UserError


def init_weights(run, cfg):
    """Start a new run from another run's model and EMA weights, e.g. the paper's "(F)" fine-tuning of a
    TREAD run without routing: `model=dit init_from=results/tread-digits`. Fresh optimizer unless
    init_from_optimizer=true. init_from_weights=ema starts the model from the source's EMA too, as SPRINT's
    full-token fine-tune does (it loads the EMA checkpoint and copies it into a new EMA)."""
    source = ckpt.resolve_checkpoint(cfg.init_from)
    state = ckpt.load_checkpoint(source)
    from_ema = cfg.init_from_weights == "ema"
    load_training_state(run, state, source, model_key="ema" if from_ema else "model",
                        optimizer=cfg.init_from_optimizer)
    if run.accelerator.is_main_process:
        print(f"initialised from {source} (step {state['step']}{', its EMA as the model' if from_ema else ''}), "
              f"{'with its optimizer state' if cfg.init_from_optimizer else 'fresh optimizer'}")


def load_training_state(run, state: dict, source, model_key="model", optimizer=True) -> int:
    """Model (from the checkpoint's `model_key` weights), EMA, projector and (if `optimizer`) optimizer from
    a checkpoint; returns its step."""
    ckpt.load_model_state(run.model, state[model_key], source)
    ckpt.load_model_state(run.ema, state["ema"], source)
    load_projector(run.projector, state, source, run.accelerator.is_main_process)
    try:
        if optimizer:
            run.optimizer.load_state_dict(fit_optimizer_state(state["optimizer"], run.optimizer,
                                                              len(list(run.model.parameters())), "repa" in state))
    except (ValueError, KeyError) as e:
        raise UserError(f"checkpoint {source} has an optimizer state for another model ({e})") from None
    return int(state["step"])


def seed_random_streams(cfg: DictConfig, accelerator: Accelerator, state: Optional[dict], step: int):
    """Random streams (torch's, numpy's and Python's): each rank continues its own, or starts its own from
    (global_seed, rank, step) in a new run or from a checkpoint written by another number of processes."""
    rng, rank, world = state["rng"] if state is not None else None, accelerator.process_index, accelerator.num_processes
    if rng is not None and len(rng) == world:
        ckpt.restore_rng_state(rng[rank])
        return
    # numpy's and Python's too: a checkpoint restores them, so they must not start from the OS's entropy (an
    # uninterrupted run would then differ from a resumed one)
    seed = cfg.global_seed * 1_000_003 + rank + step
    torch.manual_seed(seed), np.random.seed(seed % 2 ** 32), random.seed(seed)
    if rng is not None and accelerator.is_main_process:
        print(f"note: checkpoint was written by {len(rng)} processes, now {world}: RNG streams are re-seeded")


def save_snapshot(run, step: int):
    """Every rank's RNG state is gathered; the main process writes one checkpoint file."""
    accelerator = run.accelerator
    rng_states = gather_object([ckpt.capture_rng_state()])
    full = fsdp.full_checkpoint_states(run) if fsdp.sharded(run.cfg) else None  # every rank gathers
    if accelerator.is_main_process:
        payload = {"step": step, **(full or {"model": run.model.state_dict(), "ema": run.ema.state_dict(),
                                             "optimizer": run.optimizer.state_dict()}), "rng": rng_states,
                   **({"repa": run.projector.state_dict()} if run.projector is not None else {}),
                   "world_size": accelerator.num_processes,
                   "scaler": accelerator.scaler.state_dict() if accelerator.scaler is not None else None,
                   "config": OmegaConf.to_container(run.cfg, resolve=True)}
        Progress.write(f"saved {ckpt.save_checkpoint(payload, run.ckpt_dir, step)}")
        for removed in prune_checkpoints(run.ckpt_dir, run.cfg.train.get("keep_checkpoints")):
            Progress.write(f"removed {removed} (train.keep_checkpoints)")
    accelerator.wait_for_everyone()
