"""Train a class-conditional DiT with or without TREAD routing, with EDM.

    accelerate launch train.py model=tread            # embedded digits, minutes on a CPU
    accelerate launch train.py model=dit dataset=imagenet256 dataset.train_path=/data/latents

Restarting with the same run_name resumes from the newest checkpoint (model, EMA, optimizer, step,
RNG states; the data position is the step). SIGTERM/SIGINT save a checkpoint before exiting.
"""
import copy
import math
import os
import signal
import sys
import time
import traceback
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
import torch
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException
from tqdm import tqdm

import checkpoint as ckpt
from data import ResumableBatchSampler, build_dataset
from dit import get_model
from errors import UserError, exit_with, one_line
from flops import format_report, routing_flop_report
from metrics_log import MetricsLogger
from objectives import build_denoiser, build_objective
from optimizer import build_adamw


@torch.no_grad()
def update_ema(ema_params, model_params, decay: float):
    torch._foreach_lerp_(ema_params, model_params, 1.0 - decay)


def check_config(cfg, world_size: int):
    g = cfg.train.general
    if g.batch_size % world_size:
        raise UserError(f"train.general.batch_size={g.batch_size} is not divisible by the {world_size} processes")
    if not 0.0 <= g.class_drop_prob < 1.0:
        raise UserError(f"train.general.class_drop_prob must be in [0, 1), got {g.class_drop_prob}")
    for key in ("max_steps", "ckpt_every"):
        if cfg.train[key] <= 0:
            raise UserError(f"train.{key} must be a positive number of steps, got {cfg.train[key]}")
    if cfg.train.logging.log_interval <= 0:
        raise UserError(f"train.logging.log_interval must be positive, got {cfg.train.logging.log_interval}")


def set_cpu_threads(setting, local_processes: int):
    """`accelerate launch` sets OMP_NUM_THREADS=1 unless told otherwise; on a CPU run, `auto` gives each
    local process its share of the cores instead."""
    threads = max(1, (os.cpu_count() or 1) // max(1, local_processes)) if setting == "auto" else int(setting)
    torch.set_num_threads(threads)


def prepare_run_dir(run_dir: Path, resume: bool, is_main: bool):
    """With resume=false, an earlier run under the same name is moved aside, never deleted."""
    if resume or not ckpt.list_checkpoints(run_dir / "checkpoints") or not is_main:
        return
    backup = run_dir.with_name(f"{run_dir.name}.replaced-{time.strftime('%Y%m%d-%H%M%S')}")
    run_dir.rename(backup)
    print(f"resume=false: moved the earlier run to {backup}")


def drop_redone_records(metrics_file: Path, step: int):
    """Records past the resumed step describe steps that run again; keep the file consistent."""
    if not metrics_file.exists():
        return
    import json

    lines = metrics_file.read_text().splitlines()
    kept = [line for line in lines if line.strip() and json.loads(line).get("step", 0) <= step]
    if len(kept) != len(lines):
        metrics_file.write_text("".join(line + "\n" for line in kept))


def init_weights(cfg, model, ema, optimizer, is_main):
    """Start a new run from another run's model and EMA weights, e.g. the paper's "(F)" fine-tuning of a
    TREAD run without routing: `model=dit init_from=results/tread-digits`. Fresh optimizer unless
    init_from_optimizer=true."""
    source = ckpt.resolve_checkpoint(cfg.init_from)
    state = ckpt.load_checkpoint(source)
    ckpt.load_model_state(model, state["model"], source)
    ckpt.load_model_state(ema, state["ema"], source)
    if cfg.init_from_optimizer:
        optimizer.load_state_dict(state["optimizer"])
    if is_main:
        print(f"initialised from {source} (step {state['step']}), "
              f"{'with its optimizer state' if cfg.init_from_optimizer else 'fresh optimizer'}")


class StopSignal:
    """Remembers SIGTERM/SIGINT so the loop can checkpoint at a step boundary and exit."""

    def __init__(self):
        self.signum = None
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        self.signum = signum


def training_loop(cfg: DictConfig):
    from accelerate import Accelerator
    from accelerate.utils import gather_object

    # Without a GPU, processes started by torchrun (`accelerate launch --multi_gpu`) train on the CPU with gloo.
    accelerator = Accelerator(mixed_precision=cfg.train.mixed_precision, cpu=not torch.cuda.is_available())
    rank, world, is_main, device = (accelerator.process_index, accelerator.num_processes,
                                    accelerator.is_main_process, accelerator.device)
    check_config(cfg, world)
    if device.type == "cpu":
        set_cpu_threads(cfg.train.cpu_threads, int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
    run_dir = Path(str(cfg.results_dir)) / str(cfg.run_name)
    ckpt_dir = run_dir / "checkpoints"

    prepare_run_dir(run_dir, cfg.resume, is_main)
    accelerator.wait_for_everyone()
    found = ckpt.list_checkpoints(ckpt_dir) if cfg.resume else []
    state = ckpt.load_checkpoint(found[-1][1]) if found else None

    torch.manual_seed(cfg.global_seed)  # identical initial weights on every rank
    model = get_model(cfg.model.backbone_type, OmegaConf.to_container(cfg.model.params, resolve=True))
    ema = copy.deepcopy(model).requires_grad_(False).eval()
    net, loss_fn = build_objective(cfg.diffuser, model)
    o = cfg.train.optimizer
    optimizer = build_adamw(model.parameters(), device, lr=o.lr, betas=o.betas, eps=o.eps,
                            weight_decay=o.weight_decay)
    step = 0
    if state is not None:
        source = found[-1][1]
        ckpt.load_model_state(model, state["model"], source)
        ckpt.load_model_state(ema, state["ema"], source)
        try:
            optimizer.load_state_dict(state["optimizer"])
        except (ValueError, KeyError) as e:
            raise UserError(f"checkpoint {source} has an optimizer state for another model ({e})") from None
        step = int(state["step"])
    elif cfg.init_from:
        init_weights(cfg, model, ema, optimizer, is_main)
    ema.to(device)

    dataset = build_dataset(cfg.dataset, seed=cfg.global_seed)
    per_rank_batch = cfg.train.general.batch_size // world
    sampler = ResumableBatchSampler(len(dataset), per_rank_batch, rank, world, cfg.global_seed, start_step=step)
    workers = cfg.train.general.num_workers
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler, num_workers=workers,
                                         pin_memory=device.type == "cuda", persistent_workers=workers > 0,
                                         generator=torch.Generator())  # keeps the global RNG untouched
    if cfg.train.compile:
        net.model = torch.compile(model)
    net, optimizer = accelerator.prepare(net, optimizer)
    if state is not None and state.get("scaler") and accelerator.scaler is not None:
        accelerator.scaler.load_state_dict(state["scaler"])

    rng = state["rng"] if state is not None else None
    if rng is not None and len(rng) == world:
        ckpt.restore_rng_state(rng[rank])
    else:
        torch.manual_seed(cfg.global_seed * 1_000_003 + rank + step)
        if rng is not None and is_main:
            print(f"note: checkpoint was written by {len(rng)} processes, now {world}: RNG streams are re-seeded")

    logger = None
    if is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        OmegaConf.save(cfg, run_dir / "config.yaml", resolve=True)
        drop_redone_records(run_dir / "metrics.jsonl", step)
        logger = MetricsLogger(run_dir, cfg.train.logging.tensorboard, cfg.train.logging.wandb,
                               OmegaConf.to_container(cfg, resolve=True), cfg.run_name)
        n_params = sum(p.numel() for p in model.parameters())
        print(f"{cfg.model.backbone_type} ({cfg.model.name}): {n_params / 1e6:.2f}M parameters, routes "
              f"{model.router.routes if model.router.enable_routing else 'off'}, {world} process(es) on "
              f"{device}, global batch {cfg.train.general.batch_size}, run dir {run_dir}")
        print(f"resuming from {found[-1][1]} at step {step}" if state is not None else "starting at step 0")
        if model.router.routes:
            params = OmegaConf.to_container(cfg.model.params, resolve=True)
            print(format_report(cfg.model.backbone_type, routing_flop_report(cfg.model.backbone_type, params,
                                                                            per_rank_batch), per_rank_batch))

    def save(at_step):
        rng_states = gather_object([ckpt.capture_rng_state()])
        if is_main:
            payload = {"step": at_step, "model": model.state_dict(), "ema": ema.state_dict(),
                       "optimizer": optimizer.state_dict(), "rng": rng_states, "world_size": world,
                       "scaler": accelerator.scaler.state_dict() if accelerator.scaler is not None else None,
                       "config": OmegaConf.to_container(cfg, resolve=True)}
            path = ckpt.save_checkpoint(payload, ckpt_dir, at_step)
            tqdm.write(f"saved {path}")
        accelerator.wait_for_everyone()

    def first_bad_step():
        return int(accelerator.reduce(bad_step, "max").item())

    evaluator, eval_net, eval_interval = None, None, cfg.train.eval.eval_interval
    if eval_interval and eval_interval > 0:
        from train_eval import TrainingEvaluator

        evaluator = TrainingEvaluator(cfg, accelerator, run_dir)
        eval_net = build_denoiser(cfg.diffuser, ema)

    stop = StopSignal()
    model_params = list(model.parameters())
    ema_params = list(ema.parameters())
    num_classes = cfg.model.params.num_classes
    drop_prob, decay, grad_clip = cfg.train.general.class_drop_prob, cfg.train.ema.decay, o.grad_clip
    log_interval, ckpt_every, max_steps = cfg.train.logging.log_interval, cfg.train.ckpt_every, cfg.train.max_steps
    loss_sum = torch.zeros((), device=device)
    bad_step = torch.full((), -1, dtype=torch.long, device=device)  # first step with a non-finite loss
    steps_since_log, t_log = 0, time.time()
    bar = tqdm(total=max_steps, initial=step, disable=not is_main, dynamic_ncols=True, desc="train")
    data_iter = iter(loader)
    if step >= max_steps and is_main:
        print(f"run {cfg.run_name} is already complete at step {step}; raise train.max_steps, or start over "
              f"with resume=false or a new run_name")
    try:
        while step < max_steps:
            x, y = next(data_iter)
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            drop = torch.rand(y.shape, device=device) < drop_prob
            y = torch.where(drop, torch.full_like(y, num_classes), y)
            loss = loss_fn(net, x, y).mean()
            accelerator.backward(loss)
            if grad_clip:
                accelerator.clip_grad_norm_(model.parameters(), grad_clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            update_ema(ema_params, model_params, decay)
            step += 1
            loss = loss.detach()
            loss_sum += loss
            bad_step = torch.where((bad_step < 0) & ~torch.isfinite(loss), step, bad_step)
            steps_since_log += 1
            bar.update(1)

            stop_now = stop.signum is not None if world == 1 else False
            if step % log_interval == 0 or step == max_steps:
                mean_loss = (accelerator.reduce(loss_sum, "mean") / steps_since_log).item()
                if world > 1:
                    stop_now = bool(accelerator.reduce(torch.tensor(float(stop.signum is not None), device=device),
                                                       "max").item())
                if not math.isfinite(mean_loss):
                    break
                elapsed = time.time() - t_log
                if is_main:
                    steps_per_sec = steps_since_log / elapsed
                    logger.log(step, {"loss": mean_loss, "steps_per_sec": steps_per_sec,
                                      "images_per_sec": steps_per_sec * cfg.train.general.batch_size,
                                      "epoch": step / sampler.steps_per_epoch, "lr": o.lr, "world_size": world})
                    bar.set_postfix(loss=f"{mean_loss:.4f}", it_s=f"{steps_per_sec:.2f}")
                loss_sum.zero_()
                steps_since_log, t_log = 0, time.time()
            if step % ckpt_every == 0 or step == max_steps or stop_now:
                if first_bad_step() >= 0:
                    break
                save(step)
            if evaluator is not None and (step % eval_interval == 0 or step == max_steps) and not stop_now:
                scores = evaluator(eval_net, step)
                if is_main:
                    logger.log(step, scores)
                    tqdm.write(f"step {step}: " + ", ".join(f"{k} {v:.4g}" for k, v in scores.items()))
                t_log = time.time()  # evaluation time is not training time
            if stop_now:
                bar.close()
                print(f"stopped by signal {stop.signum} at step {step}; checkpoint saved, run the same command to resume")
                sys.exit(128 + int(stop.signum or 15))
    finally:
        bar.close()
    if logger is not None:
        logger.close()
    bad = first_bad_step()
    if bad >= 0:
        last = ckpt.list_checkpoints(ckpt_dir)
        kept = f"the last good checkpoint is {last[-1][1]}" if last else "no checkpoint was written"
        raise UserError(f"the loss became NaN/inf at step {bad}; training stopped and {kept} (untouched); "
                        f"try a lower train.optimizer.lr, train.optimizer.grad_clip=1.0 or bf16 instead of fp16")
    if not is_multirun():  # the process group must outlive a job when one launch runs a whole sweep
        accelerator.end_training()


def is_multirun() -> bool:
    try:
        return HydraConfig.get().mode == RunMode.MULTIRUN
    except ValueError:  # not started by hydra.main
        return False


def job_run_name(cfg) -> str:
    """In a Hydra multirun every job gets its own run directory, <run_name>/<its overrides>."""
    if not is_multirun():
        return str(cfg.run_name)
    job = HydraConfig.get().job
    return f"{cfg.run_name}/{(job.override_dirname or str(job.num)).replace('/', '_')}"


def write_status(cfg, status: str, **info):
    """status.json in the run directory: running / completed / stopped / failed (read by report.py)."""
    import json

    if int(os.environ.get("RANK", 0)) != 0:
        return
    run_dir = Path(str(cfg.results_dir)) / str(cfg.run_name)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "status.json").write_text(json.dumps({"status": status, "time": time.time(), **info}) + "\n")


@hydra.main(config_path="configs", config_name="config", version_base="1.3")
def main(cfg: DictConfig):
    cfg.run_name = job_run_name(cfg)
    try:
        write_status(cfg, "running")
        training_loop(cfg)
        write_status(cfg, "completed")
    except SystemExit as e:  # a signal stopped the run after its checkpoint
        write_status(cfg, "stopped", exit_code=e.code)
        raise
    except (UserError, OmegaConfBaseException) as e:
        message = str(e) if isinstance(e, UserError) else \
            f"configuration: {str(e).splitlines()[0]} (set it on the command line, e.g. key=value)"
        write_status(cfg, "failed", error=one_line(message))
        if not is_multirun():
            exit_with(message)
        print(f"error: {one_line(message)} (job recorded as failed; the sweep goes on)", file=sys.stderr)
    except Exception as e:
        write_status(cfg, "failed", error=f"{type(e).__name__}: {one_line(str(e))}")
        if not is_multirun():
            raise
        traceback.print_exc()
        print(f"job {cfg.run_name} failed; the sweep goes on", file=sys.stderr)


if __name__ == "__main__":
    main()
