"""Tests only: run train.py and SIGKILL it at an exact point of the loop, so a resume test does not depend
on timing. The process dies as under `kill -9`: no handler, no cleanup.

    python tests/train_killed_at.py WHEN STEP train.py-overrides...

WHEN is one of
    after_checkpoint  right after the checkpoint of step STEP is written, before that step's evaluation;
    mid_step          inside step STEP, after its weight and EMA update (before its log, checkpoint, evaluation).
"""
import os
import runpy
import signal
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from training import loop  # noqa: E402  (the repository must be on sys.path first)


def die():
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def kill_after_checkpoint(step: int):
    save_snapshot = loop.save_snapshot

    def save_then_die(run, at, *args, **kwargs):
        save_snapshot(run, at, *args, **kwargs)
        if at == step:
            die()

    loop.save_snapshot = save_then_die


def kill_mid_step(step: int):
    update_ema = loop.update_ema
    counter = {"step": None}  # the loop updates the EMA once per step; a run starts at its checkpoint

    def update_counted(*args, **kwargs):
        update_ema(*args, **kwargs)
        counter["step"] += 1
        if counter["step"] == step:
            die()

    setup = loop.setup

    def setup_counted(cfg, *args):
        run = setup(cfg, *args)
        counter["step"] = run.step
        return run

    loop.update_ema, loop.setup = update_counted, setup_counted


WHEN = {"after_checkpoint": kill_after_checkpoint, "mid_step": kill_mid_step}

if __name__ == "__main__":
    when, step, overrides = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
    for name in ("save_snapshot", "update_ema", "setup"):
        assert hasattr(loop, name), f"training.loop.{name} is gone: update tests/train_killed_at.py"
    WHEN[when](step)
    sys.argv = [str(REPO / "train.py"), *overrides]
    runpy.run_path(str(REPO / "train.py"), run_name="__main__")  # as `python train.py`: Hydra finds configs/
