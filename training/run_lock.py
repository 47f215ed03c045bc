"""One launch owns a run directory: `run.lock` in it holds the owner's host, pid and start time.

The lock is created atomically and exclusively (written beside, then hard-linked into place), so of two
launches of one run exactly one gets it; the other is refused in one line that names the owner. A lock
is stale, and taken over with a note, when its pid is gone on this host, or when on another host it was
not refreshed for `lock_stale_minutes` (the owner refreshes it every log step, checkpoint and evaluation).
Only rank 0 of a launch takes the lock: the other ranks share it.
"""
import json
import os
import socket
import time
from pathlib import Path

from tread_utils.errors import UserError
from tread_utils.files import atomic_write_text

LOCK_NAME = "run.lock"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def _read(path: Path):
    try:
        return path.read_text()
    except FileNotFoundError:
        return None


def _describe(owner: dict) -> str:
    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(owner.get("started", 0)))
    return f"host {owner.get('host')}, pid {owner.get('pid')}, started {started}"


class RunLock:
    def __init__(self, run_dir, stale_minutes: float = 60.0):
        self.path = Path(run_dir) / LOCK_NAME
        self.stale_seconds = float(stale_minutes) * 60.0
        self.text = None  # our lock's content while we hold it

    def stale_reason(self, owner: dict):
        """Why a lock whose content is `owner` is stale, or None while its owner may still run."""
        if owner.get("host") == socket.gethostname():
            return None if _pid_alive(int(owner.get("pid", -1))) else "its process is gone"
        try:
            age = time.time() - self.path.stat().st_mtime
        except FileNotFoundError:
            return "it is gone"
        if age > self.stale_seconds:
            return f"not refreshed for {age / 60:.0f} minutes (lock_stale_minutes={self.stale_seconds / 60:g})"
        return None

    def acquire(self):
        self.path.parent.mkdir(parents=True, exist_ok=True)
        mine = json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "started": time.time()}) + "\n"
        for _ in range(5):  # each retry follows a lost race with another launch
            try:
                atomic_write_text(self.path, mine, exclusive=True)
                self.text = mine
                return self
            except FileExistsError:
                pass
            seen = _read(self.path)
            if seen is None:
                continue
            try:
                owner = json.loads(seen)
            except ValueError:
                owner = {}
            reason = self.stale_reason(owner) if owner else "it is unreadable"
            if reason is None:
                raise UserError(f"run {self.path.parent} is in use by another launch ({_describe(owner)}; lock "
                                f"{self.path}); wait for it to end or stop it, or choose another run_name")
            self._take_over(seen)
            print(f"note: took over the stale lock {self.path} ({_describe(owner)}): {reason}", flush=True)
        raise UserError(f"could not take the lock {self.path}: other launches keep taking it; try again")

    def _take_over(self, seen: str):
        """Move the stale lock aside; if it changed meanwhile (another launch took over first), put it back."""
        aside = self.path.with_name(f".{LOCK_NAME}.stale{os.getpid()}")
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return
        if _read(aside) != seen:
            try:
                os.link(aside, self.path)
            except FileExistsError:
                pass
        aside.unlink()

    def refresh(self):
        """Tell launches on other hosts that the owner is alive."""
        if self.text is not None:
            try:
                os.utime(self.path)
            except FileNotFoundError:
                pass

    def release(self):
        """Remove the lock if it is still ours (a stale takeover by another launch is left alone)."""
        if self.text is not None and _read(self.path) == self.text:
            self.path.unlink()
        self.text = None
