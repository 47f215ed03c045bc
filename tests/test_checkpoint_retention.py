"""train.keep_checkpoints: the newest N plus every M-th step stay, the rest go, and the run resumes from what
stays; by default every checkpoint stays."""
import pytest

from conftest import assert_one_line_error, run_script, tiny_overrides
from training.checkpoint import list_checkpoints
from training.checkpoint_retention import prune_checkpoints, steps_to_delete


@pytest.mark.parametrize("steps, newest, every, deleted", [
    ([10, 20, 30, 40, 50], None, None, []),         # the default: all kept
    ([10, 20, 30, 40, 50], 2, None, [10, 20, 30]),
    ([10, 20, 30, 40, 50], 1, 20, [10, 30]),        # 20 and 40 are multiples of 20, 50 is the newest
    ([10, 20, 37], 1, 10, []),                      # 37 (a stop signal's) is the newest: the one a resume reads
    ([40, 10, 30], 1, None, [10, 30]),
])
def test_steps_to_delete(steps, newest, every, deleted):
    assert steps_to_delete(steps, newest, every) == deleted


def test_prune_removes_files_and_keeps_the_newest(tmp_path):
    for step in (1, 2, 3, 4):
        (tmp_path / f"ckpt_{step:08d}.pt").write_bytes(b"x")
    removed = prune_checkpoints(tmp_path, {"newest": 1, "every": 2})
    assert [p.name for p in removed] == ["ckpt_00000001.pt", "ckpt_00000003.pt"]
    assert [s for s, _ in list_checkpoints(tmp_path)] == [2, 4]
    assert prune_checkpoints(tmp_path, {"newest": None, "every": None}) == []


def train(tmp_path, *extra):
    return run_script("train.py", f"results_dir={tmp_path}", "run_name=keep", *tiny_overrides(),
                      "train.general.num_workers=0", "train.ckpt_every=1", "train.logging.log_interval=1", *extra)


def test_a_run_keeps_what_it_is_told_and_resumes_from_the_newest(tmp_path):
    proc = train(tmp_path, "train.max_steps=3", "train.keep_checkpoints.newest=1", "train.keep_checkpoints.every=2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    ckpts = tmp_path / "keep" / "checkpoints"
    assert [s for s, _ in list_checkpoints(ckpts)] == [2, 3]
    proc = train(tmp_path, "train.max_steps=4", "train.keep_checkpoints.newest=1", "train.keep_checkpoints.every=2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resuming from" in proc.stdout and "ckpt_00000003.pt" in proc.stdout
    assert [s for s, _ in list_checkpoints(ckpts)] == [2, 4]


def test_every_without_newest_is_one_line(tmp_path):
    assert_one_line_error(train(tmp_path, "train.max_steps=1", "train.keep_checkpoints.every=2"),
                          "train.keep_checkpoints.every", "train.keep_checkpoints.newest=")
    assert not (tmp_path / "keep").exists()
