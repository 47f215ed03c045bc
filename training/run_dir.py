"""The run directory beside its checkpoints: moving an old run aside, keeping metrics.jsonl consistent
with a resumed step, and status.json (read by tools/report.py)."""
import json
import os
import time
from pathlib import Path

from training.checkpoint import list_checkpoints
from tread_utils.files import atomic_write_text


def prepare_run_dir(run_dir: Path, resume: bool, is_main: bool, keep=("run.lock",)):
    """With resume=false, an earlier run under the same name is moved aside, never deleted. The launch's
    run lock (`keep`) stays, so the directory is never unowned."""
    if resume or not list_checkpoints(run_dir / "checkpoints") or not is_main:
        return
    backup = run_dir.with_name(f"{run_dir.name}.replaced-{time.strftime('%Y%m%d-%H%M%S')}")
    backup.mkdir()
    for entry in run_dir.iterdir():
        if entry.name not in keep:
            entry.rename(backup / entry.name)
    print(f"resume=false: moved the earlier run to {backup}")


def drop_redone_records(metrics_file: Path, step: int):
    """Records past the resumed step describe steps that run again; keep the file consistent."""
    if not metrics_file.exists():
        return
    lines = metrics_file.read_text().splitlines()
    kept = [line for line in lines if line.strip() and json.loads(line).get("step", 0) <= step]
    if len(kept) != len(lines):
        atomic_write_text(metrics_file, "".join(line + "\n" for line in kept))


def write_status(run_dir: Path, status: str, **info):
    """status.json: running / completed / stopped / failed. Written by the main process only."""
    if int(os.environ.get("RANK", 0)) != 0:
        return
    run_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(run_dir / "status.json", json.dumps({"status": status, "time": time.time(), **info}) + "\n")
