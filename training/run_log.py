"""Run logging on rank 0: metrics.jsonl (one JSON object per log step, flushed), TensorBoard, and wandb
only when it is enabled and installed."""
import json
import math
import time
from pathlib import Path


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
