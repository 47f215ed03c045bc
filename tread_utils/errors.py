"""User-facing errors: one clear line naming the problem and the fix, a non-zero exit, no traceback."""
import functools
import json
import os
import sys
import time


class UserError(Exception):
    """Bad input from the user (config, paths, files). The message is printed alone on one line."""


EXIT_USER_ERROR = 2


def one_line(message: str) -> str:
    """A UserError re-raised from a DataLoader worker carries the worker's traceback: keep its last line."""
    lines = [line.strip() for line in str(message).splitlines() if line.strip()]
    if len(lines) > 1 and any("Traceback" in line for line in lines):
        last = lines[-1]
        return last.split(": ", 1)[1] if last.split(": ", 1)[0].endswith("Error") else last
    return " ".join(lines)


def exit_with(message: str, code: int = EXIT_USER_ERROR, quiet: bool = False):
    """`error: <message>` on stderr (none if `quiet`: a launch's other processes) and exit with `code`.

    Under `accelerate launch` with several processes (torch.distributed.run), the launcher ends its failure
    report with each process's error file: the line is written there too, so that it closes the report."""
    line = f"error: {one_line(message)}"
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:
        try:
            with open(error_file, "w") as f:
                json.dump({"message": line, "timestamp": int(time.time())}, f)
        except OSError:
            pass  # the report then says "To enable traceback see ..."; the line above stays
    if not quiet:
        print(line, file=sys.stderr, flush=True)
    sys.exit(code)


def report_user_errors(fn):
    """Decorator for CLI entry points: a UserError becomes one line on stderr and exit code 2."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except UserError as e:
            exit_with(str(e))

    return wrapper
