"""ResumableBatchSampler (data/batch_sampler.py): ranks split each step's global batch, an epoch is covered
once, a resumed sampler continues exactly, and a resume under another process count keeps the global batches."""
from itertools import islice

import pytest

from data.batch_sampler import ResumableBatchSampler

N = 103  # not a multiple of any global batch below: the incomplete tail is dropped


def batches(num_steps, batch_size, world_size, start_step=0, seed=0):
    """[step][rank] -> that rank's batch, for `num_steps` steps from `start_step`."""
    ranks = [islice(ResumableBatchSampler(N, batch_size, rank, world_size, seed, start_step), num_steps)
             for rank in range(world_size)]
    return [list(step) for step in zip(*ranks)]


@pytest.mark.parametrize("world_size", [1, 3])
def test_ranks_are_disjoint_and_cover_each_epoch_once(world_size):
    """Within an epoch every sample is drawn at most once over all ranks and steps, all but the N mod G
    tail are drawn, indices are epoch * N + i, and each epoch has its own order."""
    batch_size = 4
    steps = ResumableBatchSampler(N, batch_size, 0, world_size).steps_per_epoch
    assert steps == N // (batch_size * world_size)
    per_step = batches(2 * steps, batch_size, world_size)
    epochs = []
    for e in range(2):
        drawn = [i for step in per_step[e * steps:(e + 1) * steps] for batch in step for i in batch]
        assert all(len(b) == batch_size for step in per_step for b in step)
        assert len(set(drawn)) == len(drawn) == steps * batch_size * world_size
        assert all(e * N <= i < (e + 1) * N for i in drawn)
        epochs.append([i - e * N for i in drawn])
    assert epochs[0] != epochs[1]


def test_resume_continues_where_the_run_stopped():
    """A sampler started at step s (here inside the second epoch) yields what an uninterrupted one yields
    from step s on; another seed gives another order."""
    straight = batches(40, 4, 2)
    for s in (0, 7, 30):
        assert batches(40 - s, 4, 2, start_step=s) == straight[s:]
    assert batches(5, 4, 2, seed=1) != straight[:5]


@pytest.mark.parametrize("old, new", [(1, 2), (4, 2), (2, 3)])
def test_resume_under_another_process_count_keeps_the_global_batches(old, new):
    """The contract: with the same global batch, step s draws the same set of samples whatever the number of
    processes; only which rank gets which of them changes."""
    global_batch = 12
    before = batches(30, global_batch // old, old)
    after = batches(20, global_batch // new, new, start_step=10)
    for s, step in enumerate(after, start=10):
        assert sorted(i for b in step for i in b) == sorted(i for b in before[s] for i in b), f"step {s}"
