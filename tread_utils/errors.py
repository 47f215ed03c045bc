"""User-facing errors: one clear line naming the problem and the fix, a non-zero exit, no traceback."""
import functools
import sys


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


def exit_with(message: str, code: int = EXIT_USER_ERROR):
    print(f"error: {one_line(message)}", file=sys.stderr, flush=True)
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
