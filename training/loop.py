"""The training loop, in labelled phases: set-up returns the run's state, the loop body updates weights,
logs, saves snapshots and evaluates.

Restarting with the same run_name resumes from the newest checkpoint (model, EMA, optimizer, grad scaler,
step, every rank's RNG state; the data position is the step). SIGTERM/SIGINT save a checkpoint first.
"""
import contextlib
import copy
import dataclasses
import math
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any, Optional

import torch
from accelerate import Accelerator
from accelerate.utils import gather_object
from omegaconf import DictConfig, OmegaConf

from data import ResumableBatchSampler, build_dataset, loader_workers
from dit import get_model
from training import checkpoint as ckpt
from training.checkpoint_retention import prune_checkpoints
from training.diffuser import build_denoiser, build_objective
from training.flops import format_report, routing_flop_report
from training.in_training_eval import TrainingEvaluator
from training.optimizer import build_adamw
from training.repa import build_repa, fit_optimizer_state, load_projector
from training.progress import Progress, format_duration
from training.run_dir import drop_redone_records, prepare_run_dir
from training.run_log import MetricsLogger, format_metrics
from tread_utils.distributed import set_cpu_threads, start_processes
from tread_utils.errors import UserError
from tread_utils.precision import set_precision_policy


@torch.no_grad()
def update_ema(ema_params, model_params, decay: float):
    torch._foreach_lerp_(ema_params, model_params, 1.0 - decay)




def init_weights(cfg, model, ema, optimizer, is_main, projector=None):
    """Start a new run from another run's model and EMA weights, e.g. the paper's "(F)" fine-tuning of a
    TREAD run without routing: `model=dit init_from=results/tread-digits`. Fresh optimizer unless
    init_from_optimizer=true. init_from_weights=ema starts the model from the source's EMA too, as SPRINT's
    full-token fine-tune does (it loads the EMA checkpoint and copies it into a new EMA)."""
    source = ckpt.resolve_checkpoint(cfg.init_from)
    state = ckpt.load_checkpoint(source)
    from_ema = cfg.init_from_weights == "ema"
    ckpt.load_model_state(model, state["ema" if from_ema else "model"], source)
    ckpt.load_model_state(ema, state["ema"], source)
    load_projector(projector, state, source, is_main)
    if cfg.init_from_optimizer:
        optimizer.load_state_dict(fit_optimizer_state(state["optimizer"], optimizer, len(list(model.parameters())),
                                                      "repa" in state))
    if is_main:
        print(f"initialised from {source} (step {state['step']}{', its EMA as the model' if from_ema else ''}), "
              f"{'with its optimizer state' if cfg.init_from_optimizer else 'fresh optimizer'}")


class StopSignal:
    """Remembers SIGTERM/SIGINT so the loop can checkpoint at a step boundary and exit."""

    def __init__(self):
        self.signum = None
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        self.signum = signum


@dataclasses.dataclass
class Run:
    """Everything the loop touches, built by `setup`."""
    cfg: DictConfig
    accelerator: Accelerator
    run_dir: Path
    model: torch.nn.Module
    ema: torch.nn.Module
    net: torch.nn.Module          # the denoiser around the (possibly compiled) model, prepared by accelerate
    loss_fn: Any
    optimizer: torch.optim.Optimizer
    sampler: ResumableBatchSampler
    data_iter: Any
    step: int
    accum: int                    # micro-batches per optimizer step
    projector: Optional[torch.nn.Module] = None  # REPA's (training/repa.py), trained, not in the EMA
    repa_sum: Optional[torch.Tensor] = None      # REPA's alignment term summed since the last log record
    logger: Optional[MetricsLogger] = None
    evaluator: Optional[TrainingEvaluator] = None
    eval_net: Optional[torch.nn.Module] = None
    started: float = dataclasses.field(default_factory=time.time)
    last_scores: dict = dataclasses.field(default_factory=dict)  # of the newest evaluation, for the summary

    @property
    def trained_params(self) -> list:
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    @property
    def ckpt_dir(self) -> Path:
        return self.run_dir / "checkpoints"


def setup(cfg: DictConfig) -> Run:
    # Processes. Without a GPU, processes started by torchrun (`accelerate launch --multi_gpu`) train on the
    # CPU with gloo.
    accelerator = start_processes(cfg.train.dist_timeout_minutes, mixed_precision=cfg.train.mixed_precision,
                                  cpu=not torch.cuda.is_available())
    rank, world, is_main, device = (accelerator.process_index, accelerator.num_processes,
                                    accelerator.is_main_process, accelerator.device)
    if cfg.train.mixed_precision == "fp16" and accelerator.scaler is None:  # accelerate ignores fp16 on a CPU
        raise UserError(f"train.mixed_precision=fp16 needs a GPU: on {device.type} accelerate neither autocasts "
                        f"to float16 nor makes a grad scaler, so the run would train in float32; use bf16 or no")
    set_precision_policy(cfg.train.tf32)
    set_cpu_threads(cfg.train.cpu_threads, int(os.environ.get("LOCAL_WORLD_SIZE", 1)))  # on GPU runs too

    # Find the checkpoint to resume from.
    run_dir = Path(str(cfg.results_dir)) / str(cfg.run_name)
    prepare_run_dir(run_dir, cfg.resume, is_main)
    accelerator.wait_for_everyone()
    found = ckpt.list_checkpoints(run_dir / "checkpoints") if cfg.resume else []
    state = ckpt.load_checkpoint(found[-1][1]) if found else None

    # Construct network, EMA, objective and optimizer: identical initial weights on every rank.
    torch.manual_seed(cfg.global_seed)
    model = get_model(cfg.model.backbone_type, OmegaConf.to_container(cfg.model.params, resolve=True))
    ema = copy.deepcopy(model).requires_grad_(False).eval()
    denoiser, loss_fn = build_objective(cfg.diffuser, model)
    net, loss_fn, projector = build_repa(cfg.repa, model, denoiser, loss_fn)  # unchanged when REPA is off
    model.to(device)  # before the optimizer: its fused-kernel choice follows the parameters' device
    trained = list(model.parameters())
    n_model_params = len(trained)  # the optimizer holds the model's parameters first, then the projector's
    if projector is not None:
        projector.to(device)
        loss_fn.teacher.to(device)
        trained += list(projector.parameters())  # after the model's: fit_optimizer_state relies on the order
    o = cfg.train.optimizer
    optimizer = build_adamw(trained, lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay)

    # Resume (or start from another run's weights).
    step = 0
    if state is not None:
        source = found[-1][1]
        ckpt.load_model_state(model, state["model"], source)
        ckpt.load_model_state(ema, state["ema"], source)
        load_projector(projector, state, source, is_main)
        try:
            optimizer.load_state_dict(fit_optimizer_state(state["optimizer"], optimizer, n_model_params,
                                                          "repa" in state))
        except (ValueError, KeyError) as e:
            raise UserError(f"checkpoint {source} has an optimizer state for another model ({e})") from None
        step = int(state["step"])
    elif cfg.init_from:
        init_weights(cfg, model, ema, optimizer, is_main, projector)
    ema.to(device)

    # Load dataset: the batch sampler counts micro-batches and starts at the resumed step's first one.
    dataset = build_dataset(cfg.dataset, seed=cfg.global_seed, teacher_images=bool(cfg.repa.enabled))
    if is_main and getattr(dataset, "scale_note", None):
        print(f"latents: {dataset.scale_note}")
    accum = int(cfg.train.general.get("grad_accum_steps", 1))
    sampler = ResumableBatchSampler(len(dataset), cfg.train.general.batch_size // (world * accum), rank, world,
                                    cfg.global_seed, start_step=step * accum)
    workers, note = loader_workers(cfg.train.general.num_workers)
    if is_main and note:
        print(note)
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler, num_workers=workers,
                                         pin_memory=device.type == "cuda", persistent_workers=workers > 0,
                                         generator=torch.Generator())  # keeps the global RNG untouched

    # Distribute.
    if cfg.train.compile:
        denoiser.model = torch.compile(model, dynamic=cfg.train.get("compile_dynamic"))
    net, optimizer = accelerator.prepare(net, optimizer)
    if state is not None and state.get("scaler") and accelerator.scaler is not None:
        accelerator.scaler.load_state_dict(state["scaler"])

    # Random streams: each rank continues its own, or starts one of its own.
    rng = state["rng"] if state is not None else None
    if rng is not None and len(rng) == world:
        ckpt.restore_rng_state(rng[rank])
    else:
        torch.manual_seed(cfg.global_seed * 1_000_003 + rank + step)
        if rng is not None and is_main:
            print(f"note: checkpoint was written by {len(rng)} processes, now {world}: RNG streams are re-seeded")

    model.router.off_after_step = cfg.train.get("routing_off_after")
    run = Run(cfg, accelerator, run_dir, model, ema, net, loss_fn, optimizer, sampler, iter(loader), step, accum,
              projector, torch.zeros((), device=device) if projector is not None else None)
    if is_main:
        run.logger = open_run_log(run, resumed_from=found[-1][1] if state is not None else None)
    if cfg.train.eval.eval_interval and cfg.train.eval.eval_interval > 0:
        run.evaluator = TrainingEvaluator(cfg, accelerator, run_dir)
        run.eval_net = build_denoiser(cfg.diffuser, ema)
    return run


def describe_routes(routes) -> str:
    """Routes in one short line, e.g. `2->8 at 0.5`, `2->8 at 0.75 (sprint)` (a Route's repr runs long)."""
    return ", ".join(f"{r.start_layer_idx}->{r.end_layer_idx} at {r.selection_ratio:g}"
                     + (f" ({r.fusion})" if getattr(r, "fusion", "none") != "none" else "")
                     + (f" ({r.schedule.kind} schedule)" if r.schedule.kind != "constant" else "") for r in routes)


def open_run_log(run: Run, resumed_from) -> MetricsLogger:
    """Main process: the resolved config, metrics.jsonl (cut back to the resumed step), a start-up report."""
    cfg, world = run.cfg, run.accelerator.num_processes
    run.run_dir.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(cfg, run.run_dir / "config.yaml", resolve=True)
    drop_redone_records(run.run_dir / "metrics.jsonl", run.step)
    logger = MetricsLogger(run.run_dir, cfg.train.logging.tensorboard, cfg.train.logging.wandb,
                           OmegaConf.to_container(cfg, resolve=True), cfg.run_name)
    router = run.model.router
    n_params = sum(p.numel() for p in run.model.parameters())
    print(f"{cfg.model.backbone_type} ({cfg.model.name}): {n_params / 1e6:.2f}M parameters, routes "
          f"{describe_routes(router.routes) if router.enable_routing else 'off'}, {world} process(es) on "
          f"{run.accelerator.device}, global batch {cfg.train.general.batch_size}, run dir {run.run_dir}")
    print(f"resuming from {resumed_from} at step {run.step}" if resumed_from is not None else "starting at step 0")
    if router.routes or run.projector is not None:
        per_rank_batch = cfg.train.general.batch_size // world
        params = OmegaConf.to_container(cfg.model.params, resolve=True)
        report = routing_flop_report(cfg.model.backbone_type, params, per_rank_batch,
                                     OmegaConf.to_container(cfg.repa, resolve=True), cfg.dataset.kind)
        print(format_report(cfg.model.backbone_type, report, per_rank_batch, cfg.train.mixed_precision))
    return logger


def save_snapshot(run: Run, step: int):
    """Every rank's RNG state is gathered; the main process writes one checkpoint file."""
    accelerator = run.accelerator
    rng_states = gather_object([ckpt.capture_rng_state()])
    if accelerator.is_main_process:
        payload = {"step": step, "model": run.model.state_dict(), "ema": run.ema.state_dict(),
                   "optimizer": run.optimizer.state_dict(), "rng": rng_states,
                   **({"repa": run.projector.state_dict()} if run.projector is not None else {}),
                   "world_size": accelerator.num_processes,
                   "scaler": accelerator.scaler.state_dict() if accelerator.scaler is not None else None,
                   "config": OmegaConf.to_container(run.cfg, resolve=True)}
        Progress.write(f"saved {ckpt.save_checkpoint(payload, run.ckpt_dir, step)}")
        for removed in prune_checkpoints(run.ckpt_dir, run.cfg.train.get("keep_checkpoints")):
            Progress.write(f"removed {removed} (train.keep_checkpoints)")
    accelerator.wait_for_everyone()


def learning_rate(o, step: int) -> float:
    """The learning rate of optimizer step `step` (0-based): a function of the step alone, so resume is exact."""
    warmup = int(o.get("warmup_steps", 0) or 0)
    return float(o.lr) * min(1.0, (step + 1) / warmup) if warmup > 0 else float(o.lr)


def accumulate_gradients(run: Run, num_classes: int, drop_prob: float) -> torch.Tensor:
    """Backward over `run.accum` micro-batches (gradients synchronised across processes on the last only);
    the gradient is that of the mean loss over the whole global batch. Returns that mean loss, detached."""
    accelerator, device, total = run.accelerator, run.accelerator.device, 0.0
    for micro in range(run.accum):
        x, y, *crops = next(run.data_iter)  # latents with REPA: their clean images too (uint8 [B, 3, R, R])
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        y = torch.where(torch.rand(y.shape, device=device) < drop_prob, torch.full_like(y, num_classes), y)
        teacher = {"teacher_images": crops[0].to(device, non_blocking=True).float() / 127.5 - 1} if crops else {}
        sync = micro == run.accum - 1
        with contextlib.nullcontext() if sync else accelerator.no_sync(run.net):
            loss = run.loss_fn(run.net, x, y, **teacher).mean()
            accelerator.backward(loss / run.accum if run.accum > 1 else loss)
        total = total + loss.detach() / run.accum
        if run.repa_sum is not None:  # REPA on: its alignment term, summed on the device until the next log
            run.repa_sum += run.loss_fn.last / run.accum
    return total


def evaluate(run: Run, step: int):
    scores = run.evaluator(run.eval_net, step)
    if run.logger is not None:
        run.logger.log(step, scores)
        run.last_scores = scores
        Progress.write(f"step {step}: {format_metrics(scores)}")


def summary_line(run: Run, step: int) -> str:
    """The run in one line: the newest evaluation's headline numbers, the wall clock, the grid."""
    shown = {k: v for k, v in run.last_scores.items() if k in ("fid", "class_acc", "nn_ratio")}
    grid = run.evaluator.last_grid if run.evaluator is not None else None
    return (f"done: step {step} in {format_duration(time.time() - run.started)}"
            + (f"; {format_metrics(shown)}" if shown else "; no evaluation this session")
            + (f"; grid {grid}" if grid is not None else ""))


def training_loop(cfg: DictConfig, end_training: bool = True, heartbeat=None):
    """Train until train.max_steps, on a config `training.config_check` accepted. `end_training=False` keeps
    the process group alive (one launch that runs a whole Hydra sweep); `heartbeat()` is called at every log
    step, checkpoint and evaluation (the run lock's refresh)."""
    started = time.time()
    heartbeat = heartbeat or (lambda: None)
    run = setup(cfg)
    run.started = started
    accelerator, device, world = run.accelerator, run.accelerator.device, run.accelerator.num_processes
    t, o = cfg.train, cfg.train.optimizer
    num_classes, drop_prob = cfg.model.params.num_classes, t.general.class_drop_prob
    model_params, ema_params = list(run.model.parameters()), list(run.ema.parameters())
    stop = StopSignal()
    loss_sum = torch.zeros((), device=device)
    bad_step = torch.full((), -1, dtype=torch.long, device=device)  # first step with a non-finite loss
    steps_since_log, t_log = 0, time.time()
    step = run.step
    if step >= t.max_steps and accelerator.is_main_process:
        print(f"run {cfg.run_name} is already complete at step {step}; raise train.max_steps, or start over "
              f"with resume=false or a new run_name")
    bar = Progress(t.max_steps, step, accelerator.is_main_process)
    try:
        while step < t.max_steps:
            # Update weights (the learning rate and a scheduled routing ratio are functions of the step alone:
            # resume is exact).
            lr = learning_rate(o, step)
            for group in run.optimizer.param_groups:
                group["lr"] = lr
            run.model.router.set_step(step)
            loss = accumulate_gradients(run, num_classes, drop_prob)
            if o.grad_clip:
                accelerator.clip_grad_norm_(run.trained_params, o.grad_clip)
            run.optimizer.step()
            run.optimizer.zero_grad(set_to_none=True)
            # Update EMA.
            update_ema(ema_params, model_params, t.ema.decay)
            step += 1
            loss_sum += loss
            bad_step = torch.where((bad_step < 0) & ~torch.isfinite(loss), step, bad_step)
            steps_since_log += 1
            bar.update(1)

            # Log: the only host sync of a step, every log_interval steps; stop signals are agreed on here.
            stop_now = stop.signum is not None if world == 1 else False
            if step % t.logging.log_interval == 0 or step == t.max_steps:
                mean_loss = (accelerator.reduce(loss_sum, "mean") / steps_since_log).item()
                if world > 1:
                    flag = torch.tensor(float(stop.signum is not None), device=device)
                    stop_now = bool(accelerator.reduce(flag, "max").item())
                if not math.isfinite(mean_loss):
                    break
                repa = {}
                if run.repa_sum is not None:  # the alignment term alone (mean -cos); `loss` includes it, weighted
                    repa = {"repa_loss": (accelerator.reduce(run.repa_sum, "mean") / steps_since_log).item()}
                    run.repa_sum.zero_()
                if run.logger is not None:
                    steps_per_sec = steps_since_log / (time.time() - t_log)
                    run.logger.log(step, {"loss": mean_loss, **repa, "steps_per_sec": steps_per_sec,
                                          "images_per_sec": steps_per_sec * t.general.batch_size,
                                          "epoch": step * run.accum / run.sampler.steps_per_epoch, "lr": lr,
                                          "world_size": world})
                    bar.interval(step, mean_loss, steps_per_sec)
                loss_sum.zero_()
                steps_since_log, t_log = 0, time.time()
                heartbeat()

            # Save snapshot (never one with a non-finite loss in it).
            if step % t.ckpt_every == 0 or step == t.max_steps or stop_now:
                if int(accelerator.reduce(bad_step, "max").item()) >= 0:
                    break
                save_snapshot(run, step)
                heartbeat()

            # Evaluate.
            if run.evaluator is not None and (step % t.eval.eval_interval == 0 or step == t.max_steps) \
                    and not stop_now:
                t_eval = time.time()
                evaluate(run, step)
                t_log += time.time() - t_eval  # evaluation time is not training time (the interval's steps still count)
                heartbeat()
            if stop_now:
                bar.close()
                print(f"stopped by signal {stop.signum} at step {step}; checkpoint saved, run the same command to resume")
                sys.exit(128 + int(stop.signum or 15))
    finally:
        bar.close()
    finish(run, bad_step, end_training, step)


def finish(run: Run, bad_step: torch.Tensor, end_training: bool, step: int):
    if run.logger is not None:
        run.logger.close()
    bad = int(run.accelerator.reduce(bad_step, "max").item())
    if bad >= 0:
        last = ckpt.list_checkpoints(run.ckpt_dir)
        kept = f"the last good checkpoint is {last[-1][1]}" if last else "no checkpoint was written"
        raise UserError(f"the loss became NaN/inf at step {bad}; training stopped and {kept} (untouched); "
                        f"try a lower train.optimizer.lr, train.optimizer.grad_clip=1.0 or bf16 instead of fp16")
    if run.accelerator.is_main_process:
        print(summary_line(run, step), flush=True)
    if end_training:
        run.accelerator.end_training()
