"""Train a class-conditional DiT with or without TREAD routing, with EDM (or rectified flow).

    accelerate launch train.py model=tread            # embedded digits, minutes on a CPU
    accelerate launch train.py model=dit dataset=imagenet256 dataset.train_path=/data/latents

Restarting with the same run_name resumes from the newest checkpoint (model, EMA, optimizer, step,
RNG states; the data position is the step). SIGTERM/SIGINT save a checkpoint before exiting.
The loop itself is `training.loop.training_loop`; this file is the Hydra entry point.
"""
import sys
import traceback
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig
from omegaconf.errors import OmegaConfBaseException

from training.loop import training_loop
from training.run_dir import write_status
from tread_utils.errors import UserError, exit_with, one_line


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


@hydra.main(config_path="configs", config_name="config", version_base="1.3")
def main(cfg: DictConfig):
    cfg.run_name = job_run_name(cfg)
    run_dir = Path(str(cfg.results_dir)) / str(cfg.run_name)
    try:
        write_status(run_dir, "running")
        training_loop(cfg, end_training=not is_multirun())  # a sweep's jobs share one process group
        write_status(run_dir, "completed")
    except SystemExit as e:  # a signal stopped the run after its checkpoint
        write_status(run_dir, "stopped", exit_code=e.code)
        raise
    except (UserError, OmegaConfBaseException) as e:
        message = str(e) if isinstance(e, UserError) else \
            f"configuration: {str(e).splitlines()[0]} (set it on the command line, e.g. key=value)"
        write_status(run_dir, "failed", error=one_line(message))
        if not is_multirun():
            exit_with(message)
        print(f"error: {one_line(message)} (job recorded as failed; the sweep goes on)", file=sys.stderr)
    except Exception as e:
        write_status(run_dir, "failed", error=f"{type(e).__name__}: {one_line(str(e))}")
        if not is_multirun():
            raise
        traceback.print_exc()
        print(f"job {cfg.run_name} failed; the sweep goes on", file=sys.stderr)


if __name__ == "__main__":
    main()
