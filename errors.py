"""User-facing errors: one clear line naming the problem and the fix, a non-zero exit, no traceback."""
import functools
import sys


class UserError(Exception):
    """Bad input from the user (config, paths, files). The message is printed alone on one line."""


EXIT_USER_ERROR = 2


def exit_with(message: str, code: int = EXIT_USER_ERROR):
    print(f"error: {message}", file=sys.stderr, flush=True)
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
