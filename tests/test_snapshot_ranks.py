"""What each rank does with a run's state, two ranks played in one process: one checkpoint file per snapshot, written
and pruned by the main process alone (under FSDP2 every rank gathers, still one writes), and a rank's random streams
after a resume under another process count, seeded from (global_seed, rank, step) as docs/runs.md says."""
import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from training import checkpoint as ckpt
from training import run_state


class FakeAccelerator:
    scaler = None

    def __init__(self, rank, world):
        self.process_index, self.num_processes, self.is_main_process = rank, world, rank == 0

    def wait_for_everyone(self):
        pass


def fake_run(rank, world, distributed, ckpt_dir):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    cfg = OmegaConf.create({"train": {"distributed": distributed, "keep_checkpoints": {"newest": 1}}})
    return SimpleNamespace(accelerator=FakeAccelerator(rank, world), model=model, ema=torch.nn.Linear(3, 2),
                           optimizer=torch.optim.AdamW(model.parameters()), projector=None, cfg=cfg, ckpt_dir=ckpt_dir)


@pytest.mark.parametrize("distributed", ["ddp", "fsdp2"])
def test_one_rank_writes_and_prunes_each_checkpoint(tmp_path, monkeypatch, distributed):
    rank_now, writes, prunes, gathers = [None], [], [], []
    save = ckpt.save_checkpoint
    monkeypatch.setattr(ckpt, "save_checkpoint",
                        lambda state, folder, step: writes.append((rank_now[0], step)) or save(state, folder, step))
    prune = run_state.prune_checkpoints
    monkeypatch.setattr(run_state, "prune_checkpoints",
                        lambda folder, policy: prunes.append(rank_now[0]) or prune(folder, policy))
    monkeypatch.setattr(run_state, "gather_object", lambda objects: objects * 2)  # both ranks' RNG states
    monkeypatch.setattr(run_state.fsdp, "full_checkpoint_states", lambda run: gathers.append(rank_now[0]) or {
        "model": run.model.state_dict(), "ema": run.ema.state_dict(), "optimizer": run.optimizer.state_dict()})
    for step in (10, 20):
        for rank in (0, 1):
            rank_now[0] = rank
            run_state.save_snapshot(fake_run(rank, 2, distributed, tmp_path), step)
    assert writes == [(0, 10), (0, 20)] and prunes == [0, 0]
    assert gathers == ([0, 1, 0, 1] if distributed == "fsdp2" else [])  # every rank takes part in the gather
    assert sorted(p.name for p in tmp_path.glob("*.pt")) == ["ckpt_00000020.pt"]  # newest=1 pruned step 10
    assert len(torch.load(tmp_path / "ckpt_00000020.pt", weights_only=False)["rng"]) == 2


def streams():
    """The next draws of torch's, numpy's and Python's streams."""
    return torch.rand(3).tolist(), np.random.rand(3).tolist(), [random.random() for _ in range(3)]


def seeded(seed):
    torch.manual_seed(seed), np.random.seed(seed % 2 ** 32), random.seed(seed)
    return streams()


def test_after_a_resume_under_another_process_count_each_rank_starts_from_seed_rank_and_step():
    cfg = OmegaConf.create({"global_seed": 7})
    written_by_two = {"rng": [ckpt.capture_rng_state(), ckpt.capture_rng_state()]}
    got = {}
    for rank in range(3):
        for step in (500, 501):
            run_state.seed_random_streams(cfg, FakeAccelerator(rank, 3), written_by_two, step)
            got[rank, step] = streams()
            assert got[rank, step] == seeded(7 * 1_000_003 + rank + step), (rank, step)
    for step in (500, 501):  # the ranks of one resume draw apart
        assert len({str(got[rank, step]) for rank in range(3)}) == 3
    assert got[0, 500] != got[0, 501]
    run_state.seed_random_streams(OmegaConf.create({"global_seed": 8}), FakeAccelerator(1, 3), written_by_two, 500)
    assert streams() != got[1, 500]


def test_under_the_same_process_count_each_rank_continues_its_own_streams():
    states, after = [], []
    for rank in range(2):
        seeded(100 + rank)
        states.append(ckpt.capture_rng_state())
        after.append(streams())  # what the stream draws next from the captured state
    for rank in range(2):
        run_state.seed_random_streams(OmegaConf.create({"global_seed": 7}), FakeAccelerator(rank, 2),
                                      {"rng": states}, 500)
        assert streams() == after[rank]
