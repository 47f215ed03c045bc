"""Command-line helpers. For the argparse commands (fid.py, tools/, data/extract_latents.py, the evaluator):
a parser whose errors are one line, and integer types with a range. For the Hydra commands (train.py,
sample.py): an unknown --flag refused in one line instead of Hydra's usage text."""
import argparse
import sys

from tread_utils.errors import EXIT_USER_ERROR


def format_duration(seconds: float) -> str:
    """H:MM:SS, for the plain progress lines of a log file."""
    minutes, secs = divmod(int(round(max(seconds, 0))), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}"


def _int_at_least(value, minimum: int, what: str) -> int:
    try:
        number = int(value)
    except (TypeError, ValueError):
        number = None
    if number is None or number < minimum:
        raise argparse.ArgumentTypeError(f"must be {what}, got {value!r}")
    return number


def positive_int(value) -> int:
    """argparse type: an integer >= 1."""
    return _int_at_least(value, 1, "a positive integer")


def non_negative_int(value) -> int:
    """argparse type: an integer >= 0."""
    return _int_at_least(value, 0, "an integer >= 0")


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose errors follow the project's convention: one `error:` line on stderr, exit code 2."""

    def error(self, message):
        print(f"error: {self.prog}: {message} (see --help)", file=sys.stderr, flush=True)
        sys.exit(EXIT_USER_ERROR)


def unknown_hydra_flag(argv, example: str):
    """The first argument of `argv` that Hydra's own command line does not accept, as a one-line message
    naming the key=value form (`example`), or None."""
    from hydra._internal.utils import get_args_parser

    _, unknown = get_args_parser().parse_known_args(list(argv))
    flags = [a for a in unknown if a.startswith("-")]
    if flags:
        return f"unknown flag {flags[0]}; options are key=value overrides, e.g. {example} (see --help)"
    return None
