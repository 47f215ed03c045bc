"""Tests only: run train.py and record what each process did, so a multi-process test can compare ranks.

    accelerate launch ... tests/train_traced.py train.py-overrides...

Every rank writes <run dir>/trace_rank<r>.pt at the end of the run: `batches` (the dataset indices its
batch sampler handed out, one list per micro-batch, in order; a loader with workers asks for a few ahead),
`inputs` (the (x, y) micro-batches the loop drew from the loader), `losses` (its own loss of each step,
before any reduction) and `model` (its final weights).
"""
import runpy
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from training import loop  # noqa: E402  (the repository must be on sys.path first)

TRACE = {"batches": [], "inputs": [], "losses": []}


class RecordingBatchSampler(loop.ResumableBatchSampler):
    def __iter__(self):
        for batch in super().__iter__():
            TRACE["batches"].append(batch)
            yield batch


def recording(data_iter):
    for x, y in data_iter:
        TRACE["inputs"].append((x.clone(), y.clone()))
        yield x, y


def traced_setup(cfg, *args):
    run = setup(cfg, *args)
    run.data_iter = recording(run.data_iter)
    return run


def traced_accumulate(run, *args, **kwargs):
    loss = accumulate(run, *args, **kwargs)
    TRACE["losses"].append(loss.item())
    return loss


def traced_finish(run, *args, **kwargs):
    model = {k: v.detach().cpu().clone() for k, v in run.model.state_dict().items()}
    torch.save({**TRACE, "model": model}, run.run_dir / f"trace_rank{run.accelerator.process_index}.pt")
    finish(run, *args, **kwargs)


setup, accumulate, finish = loop.setup, loop.accumulate_gradients, loop.finish

if __name__ == "__main__":
    loop.ResumableBatchSampler = RecordingBatchSampler
    loop.setup, loop.accumulate_gradients, loop.finish = traced_setup, traced_accumulate, traced_finish
    sys.argv = [str(REPO / "train.py"), *sys.argv[1:]]
    runpy.run_path(str(REPO / "train.py"), run_name="__main__")  # as `python train.py`: Hydra finds configs/
