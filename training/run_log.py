"""Run logging on rank 0: the start-up report, metrics.jsonl (one JSON object per log step, flushed),
TensorBoard, wandb only when it is enabled and installed, and the closing summary line."""
import json
import math
import os
import time
from pathlib import Path

from omegaconf import OmegaConf

from dit import DiT_models
from routing_module import selection_options
from training.flops import format_report, routing_flop_report
from tread_utils.cli import format_duration
from training.run_dir import drop_redone_records


def _jsonable(value):
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no NaN/inf; keep them readable
    return value


def format_metrics(metrics: dict) -> str:
    """`fid 23.41, class_acc 0.9, ...`: four significant digits, for log lines and grid captions."""
    return ", ".join(f"{k} {v:.4g}" if isinstance(v, (int, float)) else f"{k} {v}" for k, v in metrics.items())


class MetricsLogger:
    def __init__(self, run_dir, tensorboard: bool = True, wandb_cfg=None, config_dict=None, run_name=None):
        self.run_dir = Path(run_dir)
        self.file = open(self.run_dir / "metrics.jsonl", "a", buffering=1)
        self.tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(str(self.run_dir / "tensorboard"))
            except ImportError:
                print("tensorboard is not installed; logging to metrics.jsonl only (pip install tensorboard)")
        self.wandb = None
        if wandb_cfg is not None and wandb_cfg.get("enabled", False):
            try:
                import wandb
            except ImportError:
                print("train.logging.wandb.enabled=true but wandb is not installed (pip install wandb); skipping it")
            else:
                self.wandb = wandb.init(project=wandb_cfg.get("project", "tread"), name=run_name, config=config_dict,
                                        dir=str(self.run_dir), resume="allow", id=wandb_cfg.get("id") or None)

    def log(self, step: int, metrics: dict):
        record = {"step": int(step), "time": time.time(), **{k: _jsonable(v) for k, v in metrics.items()}}
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        for key, value in record.items():
            if key not in ("step", "time") and isinstance(value, (int, float)):
                if self.tb is not None:
                    self.tb.add_scalar(key, value, step)
        if self.tb is not None:
            self.tb.flush()
        if self.wandb is not None:
            self.wandb.log(record, step=step)

    def close(self):
        self.file.close()
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()


def describe_selection(route) -> str:
    """A route's selection rule with every option it runs with (its defaults written out), e.g. `random
    selection`, `importance selection importance_mix=0.5`."""
    options = {name: default for name, (_, _, default) in selection_options(route.selection).items()}
    options.update(route.options)
    return " ".join([f"{route.selection} selection", *(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}"
                                                       for k, v in options.items())])


def describe_routes(routes) -> str:
    """Placed routes (`Route`s) in one short line, e.g. `2->8 at 0.5 (random selection)`, `2->8 at 0.75
    (importance selection importance_mix=0.5, sprint fusion, linear schedule)` (a Route's repr runs long)."""
    return ", ".join(f"{r.start_layer_idx}->{r.end_layer_idx} at {r.selection_ratio:g} ("
                     + ", ".join([describe_selection(r)]
                                 + ([f"{r.fusion} fusion"] if r.fusion != "none" else [])
                                 + ([f"{r.schedule.kind} schedule"] if r.schedule.kind != "constant" else []))
                     + ")" for r in routes)


def launch_shortfall(running: int, environ=os.environ) -> str:
    """One line when `accelerate launch` was asked for more processes than run. Its plain launcher (`--cpu`, or no
    `--multi_gpu`) starts one process whatever `--num_processes` says (several only under MPI); it marks its
    child with ACCELERATE_USE_CPU and, when asked for more than one process, MASTER_ADDR, without the
    WORLD_SIZE that torchrun (`--multi_gpu`) gives every process it starts."""
    asked_for_more = "ACCELERATE_USE_CPU" in environ and "MASTER_ADDR" in environ and "WORLD_SIZE" not in environ
    if running > 1 or not asked_for_more:
        return ""
    return ("warning: accelerate launch was asked for more than one process but started this one alone (its --cpu "
            "launcher, as any launch without --multi_gpu, starts one): this run trains on 1 process; for data-parallel "
            "training on CPUs launch with `accelerate launch --multi_gpu --num_processes N train.py ...` (without "
            "a GPU the processes train on the CPU)")


def describe_model(backbone_type: str, model) -> str:
    """The registry name, with the sizes the config changed, e.g. `DiT-B/2 with depth 4, hidden_size 32`."""
    built = {"depth": len(model.blocks), "hidden_size": model.pos_embed.shape[-1], "num_heads": model.num_heads,
             "patch_size": model.patch_size}
    changed = [f"{k} {v}" for k, v in built.items() if DiT_models[backbone_type].get(k) != v]
    return backbone_type + (f" with {', '.join(changed)}" if changed else "")


def parameter_count(n: int) -> str:
    return f"{n / 1e6:.2f}M" if n >= 1e6 else f"{n:,}"


def open_run_log(run, resumed_from) -> MetricsLogger:
    """Main process, for a `training.loop.Run`: the resolved config, metrics.jsonl (cut back to the resumed
    step), a start-up report."""
    cfg, world = run.cfg, run.accelerator.num_processes
    run.run_dir.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(cfg, run.run_dir / "config.yaml", resolve=True)
    drop_redone_records(run.run_dir / "metrics.jsonl", run.step)
    logger = MetricsLogger(run.run_dir, cfg.train.logging.tensorboard, cfg.train.logging.wandb,
                           OmegaConf.to_container(cfg, resolve=True), cfg.run_name)
    router, off_after = run.model.router, cfg.train.routing_off_after
    n_params = sum(p.numel() for p in run.model.parameters())
    routes = describe_routes(router.routes) if router.enable_routing else "off"
    if router.enable_routing and router.routes and off_after is not None:
        routes += f", off from step {off_after} (train.routing_off_after)"
    print(f"{describe_model(cfg.model.backbone_type, run.model)} ({cfg.model.name}): {parameter_count(n_params)} "
          f"parameters, routes {routes}, {world} process(es) on {run.accelerator.device}, global batch "
          f"{cfg.train.general.batch_size}, run dir {run.run_dir}")
    shortfall = launch_shortfall(world)
    if shortfall:
        print(shortfall)
    print(f"resuming from {resumed_from} at step {run.step}" if resumed_from is not None else "starting at step 0")
    if router.routes or run.projector is not None:
        per_rank_batch = cfg.train.general.batch_size // world
        params = dict(OmegaConf.to_container(cfg.model.params, resolve=True), routes=router.routes)
        report = routing_flop_report(cfg.model.backbone_type, params, per_rank_batch,
                                     OmegaConf.to_container(cfg.repa, resolve=True), cfg.dataset.kind)
        print(format_report(cfg.model.backbone_type, report, per_rank_batch, cfg.train.mixed_precision))
    return logger


def summary_line(run, step: int) -> str:
    """The run in one line: the newest evaluation's headline numbers, the wall clock, the grid."""
    last = run.evaluator.last_scores if run.evaluator is not None else {}
    shown = {k: v for k, v in last.items() if k in ("fid", "class_acc", "nn_ratio")}
    grid = run.evaluator.last_grid if run.evaluator is not None else None
    return (f"done: step {step} in {format_duration(time.time() - run.started)}"
            + (f"; {format_metrics(shown)}" if shown else "; no evaluation this session")
            + (f"; grid {grid}" if grid is not None else ""))
