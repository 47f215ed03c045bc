"""Train a class-conditional DiT with or without TREAD routing, with EDM (or rectified flow).

    accelerate launch train.py model=tread            # embedded digits, minutes on a CPU
    accelerate launch train.py model=dit dataset=imagenet256 dataset.train_path=/data/latents \
        train.eval.ref_batch=/data/VIRTUAL_imagenet256_labeled.npz

Restarting with the same run_name resumes from the newest checkpoint (model, EMA, optimizer, step,
RNG states; the data position is the step). SIGTERM/SIGINT save a checkpoint before exiting.
The modules the config's `imports` names are imported first (the user's own registrations; docs/extensions.md),
then the whole config is checked (`training.config_check`, one line and exit code 2 for a bad value,
nothing written), and the dataset is read and checked (a malformed manifest.json, an unreadable shard, fewer
samples than one batch: the same), then the run directory is locked (`training.run_lock`): a second launch of a running
run is refused. The loop itself is `training.loop.training_loop`; this file is the Hydra entry point.
"""
import os
import signal
import sys
import traceback
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.errors import HydraException
from hydra.types import RunMode
from omegaconf import DictConfig
from omegaconf.errors import OmegaConfBaseException

from training.config_check import check_train_config, hydra_error_line
from training.run_lock import RunLock
from tread_utils.cli import unknown_hydra_flag
from tread_utils.errors import UserError, exit_with, one_line
from tread_utils.user_imports import import_user_modules


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


def refuse_job(cfg, message: str, run_dir=None):
    """A single run exits with one line; a sweep job is reported (and recorded in `run_dir` if given)."""
    if not is_multirun():
        if int(os.environ.get("RANK", 0)) != 0:
            exit_with(message, quiet=True)  # rank 0 says it; every rank leaves it for the launcher
        exit_with(message)
    if run_dir is not None:
        from training.run_dir import write_status
        write_status(run_dir, "failed", error=one_line(message))
    print(f"error: {one_line(message)} (job {cfg.run_name} not run; the sweep goes on)", file=sys.stderr)


def _exit_on_sigterm(signum, frame):
    sys.exit(128 + signum)  # until the loop installs its own handler: unwinds, so the lock is released


@hydra.main(config_path="configs", config_name="config", version_base="1.3")
def main(cfg: DictConfig):
    cfg.run_name = job_run_name(cfg)
    run_dir = Path(str(cfg.results_dir)) / str(cfg.run_name)
    try:  # before any side effect
        import_user_modules(cfg.imports)  # the user's registrations (rules, fusions, blocks) before the check
        checked = check_train_config(cfg, world_size=int(os.environ.get("WORLD_SIZE", 1)),
                                     overrides=HydraConfig.get().overrides.task)
        from tread_utils.distributed import check_cuda_processes  # loads torch: only for a valid config
        check_cuda_processes(mixed_precision=cfg.train.mixed_precision)
        from tread_utils.attention import check_attention
        check_attention(cfg.train.attention, "train.attention")  # its package and this GPU, before anything is written
        from training.loop import training_dataset  # torch and the model code load only for a valid config
        dataset = training_dataset(cfg)  # the data read and checked (shards, manifest.json, one global batch)
    except UserError as e:
        return refuse_job(cfg, str(e), run_dir)
    lock = RunLock(run_dir, cfg.lock_stale_minutes) if int(os.environ.get("RANK", 0)) == 0 else None
    if lock is not None:
        try:
            lock.acquire()
        except UserError as e:  # the run is someone else's: nothing of it is touched
            return refuse_job(cfg, str(e))
        except OSError as e:
            return refuse_job(cfg, f"cannot create the run folder {run_dir} ({e.strerror or e}); set "
                                   f"results_dir= to a folder this job can write")
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        run(checked, run_dir, lock, dataset)
    finally:
        if lock is not None:
            lock.release()


def run(checked, run_dir: Path, lock, dataset):
    """Train the checked config (the typed config and the model's arguments: nothing below reads another)."""
    from training.loop import training_loop

    cfg = checked.config
    from training.run_dir import prepare_run_dir, write_status

    try:
        prepare_run_dir(run_dir, cfg.resume, is_main=int(os.environ.get("RANK", 0)) == 0)  # before "running"
        write_status(run_dir, "running")
        training_loop(checked, end_training=not is_multirun(),  # a sweep's jobs share one process group
                      heartbeat=lock.refresh if lock is not None else None, dataset=dataset)
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
    os.environ["HYDRA_FULL_ERROR"] = "1"  # Hydra raises its errors (bad overrides) to us: one line, exit code 2
    flag = unknown_hydra_flag(sys.argv[1:], example="dataset.vae=DIR")
    if flag:  # one line instead of Hydra's usage text
        exit_with(flag)
    try:
        main()
    except (HydraException, OmegaConfBaseException) as e:
        exit_with(hydra_error_line(e))
