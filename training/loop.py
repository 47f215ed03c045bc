"""The training loop, in labelled phases (edm2's order): `setup` starts the processes, builds the network,
optimizer and data and resumes their state; each step of `training_loop` updates the weights and the EMA,
then logs, saves a snapshot and evaluates when due.

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
from omegaconf import DictConfig, OmegaConf

from data import ResumableBatchSampler, build_dataset, loader_workers
from dit import DiT
from training import checkpoint as ckpt
from training import fsdp
from training.checkpoint import build_denoiser, build_objective
from training.compile import CompileStats, compile_backbone
from training.config_check import CheckedTrainConfig
from training.in_training_eval import TrainingEvaluator
from training.repa import build_repa
from training.progress import Progress
from training.run_log import MetricsLogger, format_metrics, open_run_log, summary_line
from training.run_state import init_weights, load_training_state, save_snapshot, seed_random_streams
from tread_utils.attention import use_attention
from tread_utils.distributed import set_cpu_threads, start_processes
from tread_utils.errors import UserError
from tread_utils.precision import avoid_faulting_attention, set_precision_policy


FUSED_DEVICE_TYPES = ("cuda", "cpu")  # devices with a fused AdamW kernel (the CPU's since torch 2.4, our oldest)


def fused_adamw_available(device) -> bool:
    return torch.device(device).type in FUSED_DEVICE_TYPES


def build_adamw(params, lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0):
    """AdamW, fused when every parameter lies on a device with the fused kernel (build it after moving the
    model), else the multi-tensor (foreach) path; torch's CPU default is a per-tensor loop. Its speed matters
    for TREAD: the optimizer step does not shrink with the routed tokens."""
    params = list(params)
    fused = bool(params) and all(fused_adamw_available(p.device) for p in params)
    return torch.optim.AdamW(params, lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                             fused=fused, foreach=None if fused else True)


@torch.no_grad()
def update_ema(ema_params, model_params, decay: float):
    torch._foreach_lerp_(ema_params, model_params, 1.0 - decay)


class StopSignal:
    """Remembers SIGTERM/SIGINT so the loop can checkpoint at a step boundary and exit."""

    def __init__(self):
        self.signum = None
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        self.signum = signum


class Tally:
    """The losses since the last log record, summed on the device (a step never waits for the host), and the
    first step whose loss was not finite (-1 while there is none)."""

    def __init__(self, device, repa: bool):
        self.loss = torch.zeros((), device=device)
        self.repa = torch.zeros((), device=device) if repa else None  # REPA's alignment term alone
        self.bad_step = torch.full((), -1, dtype=torch.long, device=device)
        self.steps, self.since = 0, time.time()

    def add(self, step: int, loss: torch.Tensor):
        self.loss += loss
        self.bad_step = torch.where((self.bad_step < 0) & ~torch.isfinite(loss), step + 1, self.bad_step)
        self.steps += 1

    def restart(self):
        self.loss.zero_()
        if self.repa is not None:
            self.repa.zero_()
        self.steps, self.since = 0, time.time()


@dataclasses.dataclass
class Run:
    """What the loop's phases share, built by `setup`."""
    cfg: DictConfig
    accelerator: Accelerator
    run_dir: Path
    model: torch.nn.Module
    ema: torch.nn.Module
    net: torch.nn.Module          # the denoiser around the (possibly compiled) model, prepared by accelerate
    loss_fn: Any
    optimizer: torch.optim.Optimizer
    projector: Optional[torch.nn.Module] = None  # REPA's (training/repa.py), trained, not in the EMA
    sampler: Optional[ResumableBatchSampler] = None
    data_iter: Any = None
    step: int = 0                 # the step the run starts (resumes) at
    tally: Optional[Tally] = None
    logger: Optional[MetricsLogger] = None
    evaluator: Optional[TrainingEvaluator] = None
    started: float = dataclasses.field(default_factory=time.time)
    compiled: Optional[CompileStats] = None  # with train.compile: the graphs and recompiles logged
    model_args: Optional[dict] = None  # what the model was built from (routes resolved): FSDP2's evaluation copy

    @property
    def accum(self) -> int:
        """Micro-batches per optimizer step."""
        return self.cfg.train.general.grad_accum_steps

    @property
    def trained_params(self) -> list:
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    @property
    def ckpt_dir(self) -> Path:
        return self.run_dir / "checkpoints"


def setup(checked: CheckedTrainConfig, dataset=None) -> Run:
    cfg = checked.config
    accelerator = start(cfg)
    is_main, device = accelerator.is_main_process, accelerator.device

    # Find the checkpoint to resume from (train.py has moved an old run aside if resume=false).
    run_dir = Path(str(cfg.results_dir)) / str(cfg.run_name)
    found = ckpt.list_checkpoints(run_dir / "checkpoints") if cfg.resume else []
    source = found[-1][1] if found else None
    state = ckpt.load_checkpoint(source) if found else None

    # Construct network, EMA, objective and optimizer; resume them (or start from another run's weights).
    run = construct(cfg, accelerator, run_dir, checked.model_args)
    if state is not None:
        run.step = load_training_state(run, state, source)
    elif cfg.init_from:
        init_weights(run, cfg)
    run.ema.to(device)

    # Load dataset: the batch sampler counts micro-batches and starts at the resumed step's first one.
    run.sampler, run.data_iter = load_data(cfg, accelerator, run.step * run.accum, run.accum, dataset)

    # Distribute.
    if fsdp.sharded(cfg):
        run.net, run.optimizer = fsdp.prepare(run, accelerator)
    else:
        run.net, run.optimizer = accelerator.prepare(run.net, run.optimizer)
    if state is not None and state.get("scaler") and accelerator.scaler is not None:
        accelerator.scaler.load_state_dict(state["scaler"])
    seed_random_streams(cfg, accelerator, state, run.step)

    # Log and evaluate.
    run.tally = Tally(device, repa=run.projector is not None)
    if is_main:
        run.logger = open_run_log(run, resumed_from=source)
        if run.step >= cfg.train.max_steps:
            print(f"run {cfg.run_name} is already complete at step {run.step}; raise train.max_steps, or start "
                  f"over with resume=false or a new run_name")
    if cfg.train.eval.eval_interval and cfg.train.eval.eval_interval > 0:
        run.evaluator = TrainingEvaluator(cfg, accelerator, run_dir)
    return run


def start(cfg: DictConfig) -> Accelerator:
    """Processes. Without a GPU, processes started by torchrun (`accelerate launch --multi_gpu`) train on the
    CPU with gloo."""
    accelerator = start_processes(cfg.train.dist_timeout_minutes, mixed_precision=cfg.train.mixed_precision,
                                  cpu=not torch.cuda.is_available())
    set_precision_policy(cfg.train.tf32)
    cudnn = avoid_faulting_attention(cfg.train.keep_cudnn_attention, "train.keep_cudnn_attention=true")
    kernels = use_attention(cfg.train.attention, "train.attention", accelerator.device,  # train.py checked them
                            cfg.train.attention_fp32)
    for line in (cudnn, kernels):
        if line and accelerator.is_main_process:
            print(line, flush=True)
    fsdp.refuse_accelerate_fsdp(accelerator, cfg.train.distributed)
    set_cpu_threads(cfg.train.cpu_threads, int(os.environ.get("LOCAL_WORLD_SIZE", 1)))  # on GPU runs too
    return accelerator


def construct(cfg: DictConfig, accelerator: Accelerator, run_dir: Path, model_args: dict) -> Run:
    """Network, EMA, objective (with REPA's projector when on) and optimizer: identical initial weights on
    every rank. `model_args`: the config check's, routes resolved."""
    torch.manual_seed(cfg.global_seed)
    model = DiT(**model_args)
    ema = copy.deepcopy(model).requires_grad_(False).eval()
    denoiser, loss_fn = build_objective(cfg.diffuser, model)
    net, loss_fn, projector = build_repa(cfg.repa, model, denoiser, loss_fn)  # unchanged when REPA is off
    model.to(accelerator.device)  # before the optimizer: its fused-kernel choice follows the parameters' device
    trained = list(model.parameters())  # the optimizer holds the model's parameters first, then the projector's
    if projector is not None:
        projector.to(accelerator.device)
        loss_fn.teacher.to(accelerator.device)
        trained += list(projector.parameters())  # after the model's: fit_optimizer_state relies on the order
    o = cfg.train.optimizer
    optimizer = build_adamw(trained, lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay)
    compiled = CompileStats.start() if cfg.train.compile else None
    if compiled is not None:
        denoiser.model = compile_backbone(model, cfg.train.compile_scope, dynamic=cfg.train.compile_dynamic)
    return Run(cfg, accelerator, run_dir, model, ema, net, loss_fn, optimizer, projector, compiled=compiled,
               model_args=model_args)


def load_data(cfg: DictConfig, accelerator: Accelerator, start_micro_step: int, accum: int, dataset=None):
    """(this rank's batch sampler, an iterator over its (x, y[, teacher images]) micro-batches) of `dataset`,
    the entry point's `training_dataset(cfg)` (None: built here)."""
    dataset = training_dataset(cfg) if dataset is None else dataset
    if accelerator.is_main_process and getattr(dataset, "scale_note", None):
        print(f"latents: {dataset.scale_note}")
    world, (workers, note) = accelerator.num_processes, loader_workers(cfg.train.general.num_workers)
    if accelerator.is_main_process and note:
        print(note)
    sampler = ResumableBatchSampler(len(dataset), cfg.train.general.batch_size // (world * accum),
                                    accelerator.process_index, world, cfg.global_seed, start_step=start_micro_step)
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler, num_workers=workers,
                                         pin_memory=accelerator.device.type == "cuda",
                                         persistent_workers=workers > 0,
                                         generator=torch.Generator())  # keeps the global RNG untouched
    return sampler, iter(loader)


def training_dataset(cfg: DictConfig):
    """The run's dataset, checked as far as it can be without training (data.build_dataset): train.py builds
    it before the run folder exists, so a bad dataset leaves nothing behind."""
    g = cfg.train.general
    return build_dataset(cfg.dataset, seed=cfg.global_seed, teacher_images=bool(cfg.repa.enabled),
                         global_batch=g.batch_size // g.grad_accum_steps)


def learning_rate(o, step: int) -> float:
    """The learning rate of optimizer step `step` (0-based): a function of the step alone, so resume is exact."""
    warmup = o.warmup_steps
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
        if run.projector is not None:  # REPA on: its alignment term, summed on the device until the next log
            run.tally.repa += run.loss_fn.last / run.accum
    return total


def update_weights(run: Run, step: int, model_params: list, ema_params: list):
    """One optimizer step, then the EMA. The learning rate and a scheduled routing ratio are functions of the
    step alone (resume is exact). The step's loss joins the log interval's sum, on the device."""
    t, o = run.cfg.train, run.cfg.train.optimizer
    for group in run.optimizer.param_groups:
        group["lr"] = learning_rate(o, step)
    run.model.router.set_step(step, t.routing_off_after)
    loss = accumulate_gradients(run, run.cfg.model.params.num_classes, t.general.class_drop_prob)
    if o.grad_clip:
        run.accelerator.clip_grad_norm_(run.trained_params, o.grad_clip)
    run.optimizer.step()
    run.optimizer.zero_grad(set_to_none=True)
    update_ema(ema_params, model_params, t.ema.decay)
    run.tally.add(step, loss)


def log_interval(run: Run, step: int, stop: StopSignal, bar: Progress) -> tuple:
    """The only host sync of a step, every log_interval steps: the loss (and REPA's term) averaged over the
    interval and all processes, logged by the main process. Returns (the mean loss is finite, a stop signal
    reached any process)."""
    accelerator, t, world, tally = run.accelerator, run.cfg.train, run.accelerator.num_processes, run.tally
    mean_loss = (accelerator.reduce(tally.loss, "mean") / tally.steps).item()
    stop_now = stop.signum is not None
    if world > 1:
        flag = torch.tensor(float(stop_now), device=accelerator.device)
        stop_now = bool(accelerator.reduce(flag, "max").item())
    if not math.isfinite(mean_loss):
        return False, stop_now
    repa = {}
    if tally.repa is not None:  # the alignment term alone (mean -cos); `loss` includes it, weighted
        repa = {"repa_loss": (accelerator.reduce(tally.repa, "mean") / tally.steps).item()}
    if run.logger is not None:
        steps_per_sec = tally.steps / (time.time() - tally.since)
        run.logger.log(step, {"loss": mean_loss, **repa, "steps_per_sec": steps_per_sec,
                              "images_per_sec": steps_per_sec * t.general.batch_size,
                              "epoch": step * run.accum / run.sampler.steps_per_epoch,
                              "lr": learning_rate(t.optimizer, step - 1), "world_size": world,
                              **(run.compiled.metrics() if run.compiled is not None else {})})
        bar.interval(step, mean_loss, steps_per_sec)
    tally.restart()
    return True, stop_now


def evaluate(run: Run, step: int):
    ema = fsdp.unsharded_ema(run) if fsdp.sharded(run.cfg) else run.ema
    scores = run.evaluator(build_denoiser(run.cfg.diffuser, ema), step)
    if run.logger is not None:
        run.logger.log(step, scores)
        Progress.write(f"step {step}: {format_metrics(scores)}")


def training_loop(checked: CheckedTrainConfig, end_training: bool = True, heartbeat=None, dataset=None):
    """Train until train.max_steps, on what `training.config_check.check_train_config` returned: the typed config
    and the model's checked arguments. `end_training=False` keeps the process group alive (one launch that runs a
    whole Hydra sweep); `heartbeat()` is called at every log step, checkpoint and evaluation (the run lock's
    refresh); `dataset`: `training_dataset(cfg)`, built by the caller before the run folder (None: built here)."""
    started = time.time()
    heartbeat = heartbeat or (lambda: None)
    cfg = checked.config
    run = setup(checked, dataset)
    run.started = started
    accelerator, t = run.accelerator, cfg.train
    model_params, ema_params = list(run.model.parameters()), list(run.ema.parameters())
    stop = StopSignal()
    step = run.step
    run.tally.restart()
    bar = Progress(t.max_steps, step, accelerator.is_main_process)
    off_after = t.routing_off_after  # announced in the log when reached
    try:
        while step < t.max_steps:
            # Update weights and EMA.
            if step == off_after and run.model.router.routes and accelerator.is_main_process:
                bar.write(f"step {step}: routing off from here on (train.routing_off_after={step}), every token "
                          f"through every block")
            update_weights(run, step, model_params, ema_params)
            if run.compiled is not None:
                run.compiled.step_done()
            step += 1
            bar.update(1)

            # Log; a stop signal is agreed on here (one process: at once).
            stop_now = accelerator.num_processes == 1 and stop.signum is not None
            if step % t.logging.log_interval == 0 or step == t.max_steps:
                finite, stop_now = log_interval(run, step, stop, bar)
                if not finite:
                    break
                heartbeat()

            # Save snapshot (never one with a non-finite loss in it).
            if step % t.ckpt_every == 0 or step == t.max_steps or stop_now:
                if int(accelerator.reduce(run.tally.bad_step, "max").item()) >= 0:
                    break
                save_snapshot(run, step)
                heartbeat()

            # Evaluate (its time is not training time: the interval's steps still count).
            if run.evaluator is not None and (step % t.eval.eval_interval == 0 or step == t.max_steps) \
                    and not stop_now:
                t_eval = time.time()
                evaluate(run, step)
                run.tally.since += time.time() - t_eval
                heartbeat()
            if stop_now:
                bar.close()
                print(f"stopped by signal {stop.signum} at step {step}; checkpoint saved, run the same command to resume")
                sys.exit(128 + int(stop.signum or 15))
    finally:
        bar.close()
    finish(run, end_training, step)


def finish(run: Run, end_training: bool, step: int):
    if run.logger is not None:
        run.logger.close()
    bad = int(run.accelerator.reduce(run.tally.bad_step, "max").item())
    if bad >= 0:
        last = ckpt.list_checkpoints(run.ckpt_dir)
        kept = f"the last good checkpoint is {last[-1][1]}" if last else "no checkpoint was written"
        raise UserError(f"the loss became NaN/inf at step {bad}; training stopped and {kept} (untouched); "
                        f"try a lower train.optimizer.lr, train.optimizer.grad_clip=1.0 or bf16 instead of fp16")
    if run.accelerator.is_main_process:
        print(summary_line(run, step), flush=True)
    if end_training:
        run.accelerator.end_training()
