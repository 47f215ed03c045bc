"""train.general.num_workers is capped at the cores this process may use, with a note: torch's DataLoader
warns above that."""
import os
import warnings

import torch

from data import loader_workers


def test_workers_capped_at_the_cores(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    assert loader_workers(2) == (2, "")
    assert loader_workers(0) == (0, "")
    workers, note = loader_workers(4)
    assert workers == 2 and "2 worker(s)" in note and "train.general.num_workers=4" in note


def test_capped_loader_does_not_warn():
    workers, _ = loader_workers(64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loader = torch.utils.data.DataLoader(list(range(4)), batch_size=2, num_workers=workers)
        assert sorted(int(x) for batch in loader for x in batch) == [0, 1, 2, 3]
