"""One launch owns a run directory: a second is refused naming the owner; a dead owner's lock is taken over."""
import json
import os
import socket
import subprocess
import sys
import time

import pytest

from conftest import REPO, assert_one_line_error, subprocess_env, tiny_overrides
from training.checkpoint import list_checkpoints
from training.run_lock import LOCK_NAME, RunLock
from tread_utils.errors import UserError


def write_lock(run_dir, host, pid, age_s=0.0):
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / LOCK_NAME
    path.write_text(json.dumps({"host": host, "pid": pid, "started": time.time() - age_s}) + "\n")
    os.utime(path, (time.time() - age_s, time.time() - age_s))
    return path


def dead_pid():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_live_owner_is_refused_and_its_lock_kept(tmp_path):
    lock = RunLock(tmp_path / "run").acquire()
    text = (tmp_path / "run" / LOCK_NAME).read_text()
    with pytest.raises(UserError, match=f"in use by another launch .*pid {os.getpid()}"):
        RunLock(tmp_path / "run").acquire()
    assert (tmp_path / "run" / LOCK_NAME).read_text() == text
    lock.release()
    assert not (tmp_path / "run" / LOCK_NAME).exists()


def test_stale_locks_are_taken_over(tmp_path, capsys):
    write_lock(tmp_path / "a", socket.gethostname(), dead_pid())
    RunLock(tmp_path / "a").acquire()
    assert "its process is gone" in capsys.readouterr().out
    write_lock(tmp_path / "b", "elsewhere", 1, age_s=3600)
    RunLock(tmp_path / "b", stale_minutes=30).acquire()
    assert "not refreshed for 60 minutes" in capsys.readouterr().out
    assert json.loads((tmp_path / "b" / LOCK_NAME).read_text())["pid"] == os.getpid()


def test_a_refreshed_lock_on_another_host_is_kept(tmp_path):
    write_lock(tmp_path / "c", "elsewhere", 1, age_s=60)
    with pytest.raises(UserError, match="host elsewhere, pid 1"):
        RunLock(tmp_path / "c", stale_minutes=30).acquire()


def test_release_leaves_a_lock_taken_over_by_another_launch(tmp_path):
    lock = RunLock(tmp_path / "d").acquire()
    theirs = write_lock(tmp_path / "d", "elsewhere", 2)
    lock.release()
    assert theirs.exists()


def test_second_launch_is_refused_then_a_killed_owners_run_is_taken_over(tmp_path):
    args = [sys.executable, str(REPO / "train.py"), f"results_dir={tmp_path}", "run_name=owned",
            *tiny_overrides("dit"), "train.ckpt_every=2", "train.logging.log_interval=2"]
    run_dir = tmp_path / "owned"
    with open(tmp_path / "first.log", "w") as log:
        first = subprocess.Popen([*args, "train.max_steps=100000"], cwd=REPO, env=subprocess_env(), stdout=log,
                                 stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 240
        while not list_checkpoints(run_dir / "checkpoints") and first.poll() is None and time.time() < deadline:
            time.sleep(0.1)
        assert first.poll() is None, (tmp_path / "first.log").read_text()[-2000:]
        second = subprocess.run([*args, "train.max_steps=100000"], cwd=REPO, env=subprocess_env(),
                                capture_output=True, text=True, timeout=120)
        assert second.returncode == 2
        assert_one_line_error(second, "in use by another launch", f"pid {first.pid}")
    finally:
        first.kill()  # SIGKILL: no handler runs, the lock stays behind
        first.wait()
    assert (run_dir / LOCK_NAME).exists()
    step = list_checkpoints(run_dir / "checkpoints")[-1][0]
    third = subprocess.run([*args, f"train.max_steps={step + 1}"], cwd=REPO, env=subprocess_env(),
                           capture_output=True, text=True, timeout=300)
    assert third.returncode == 0, third.stderr[-2000:]
    assert "took over the stale lock" in third.stdout and f"pid {first.pid}" in third.stdout
    assert f"at step {step}" in third.stdout
    assert not (run_dir / LOCK_NAME).exists(), "a run that ends releases its lock"
