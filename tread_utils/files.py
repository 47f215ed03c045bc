"""File helpers shared by every command: atomic writes and output-path checks."""
import os
import tempfile
from pathlib import Path

from tread_utils.errors import UserError


def atomic_write(path, write, mode: str = "wb", exclusive: bool = False) -> Path:
    """`write(file)` into a hidden temporary file beside `path`, fsync, then rename it onto `path`:
    a reader sees the old file or the new one, never half of one, and a crash leaves `path` untouched.
    `exclusive`: link instead of rename, so that FileExistsError is raised if `path` exists (a lock)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, mode) as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        (os.link if exclusive else os.replace)(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return path


def atomic_write_text(path, text: str, exclusive: bool = False) -> Path:
    return atomic_write(path, lambda f: f.write(text), mode="w", exclusive=exclusive)


def check_output_path(path, suffix: str, what: str) -> Path:
    """Refuse, before any work, an output path that cannot be written: wrong suffix, a directory, a missing
    or unwritable parent directory (probed by creating and removing a temporary file there)."""
    p = Path(str(path)).expanduser()
    if p.suffix.lower() != suffix:
        raise UserError(f"{what}={path} must end in {suffix}")
    if p.is_dir():
        raise UserError(f"{what}={path} is a directory; give a file name ending in {suffix}")
    parent = p.parent
    if not parent.is_dir():
        problem = "is not a directory" if parent.exists() else "does not exist"
        raise UserError(f"cannot write {what}={path}: {parent} {problem}")
    try:
        with tempfile.NamedTemporaryFile(dir=parent, prefix=f".{p.name}.probe"):
            pass
    except OSError as e:
        raise UserError(f"cannot write {what}={path}: directory {parent} is not writable ({e.strerror})") from None
    return p
