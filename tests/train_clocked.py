"""Tests only: run train.py on a fake clock, so the logged throughput can be checked exactly.

    python tests/train_clocked.py train.py-overrides...

training.loop's clock advances 1 s per training step (in accumulate_gradients) and 1000 s per evaluation (which
is replaced by that wait); nothing else moves it. Every logged steps_per_sec must then be exactly 1.
"""
import runpy
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from training import loop  # noqa: E402  (the repository must be on sys.path first)


class FakeClock:
    now = 0.0

    def time(self):
        return self.now


def clocked_accumulate(run, *args, **kwargs):
    loss = accumulate(run, *args, **kwargs)
    loop.time.now += 1.0
    return loss


def clocked_evaluate(run, step):
    loop.time.now += 1000.0


accumulate = loop.accumulate_gradients

if __name__ == "__main__":
    loop.time = FakeClock()
    loop.accumulate_gradients, loop.evaluate = clocked_accumulate, clocked_evaluate
    sys.argv = [str(REPO / "train.py"), *sys.argv[1:]]
    runpy.run_path(str(REPO / "train.py"), run_name="__main__")  # as `python train.py`: Hydra finds configs/
