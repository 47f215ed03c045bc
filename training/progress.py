"""Training progress on the main process, readable on a terminal and in a log file.

On a terminal (stdout and stderr both TTYs) tqdm draws its live bar. Otherwise, e.g. a cluster job whose
output goes to a file, the bar's carriage-return updates would pile up into one huge line, so there is no
bar and each log interval prints one plain line instead:

    step 200/800  loss 0.0712  5.31 it/s  ETA 0:01:53
"""
import sys

from tqdm import tqdm

from tread_utils.cli import format_duration


class Progress:
    def __init__(self, total: int, initial: int, enabled: bool, live=None):
        """`enabled`: this is the main process; `live`: the bar (default: when stdout and stderr are TTYs)."""
        self.total, self.enabled = total, enabled
        self.live = sys.stdout.isatty() and sys.stderr.isatty() if live is None else live
        self.bar = tqdm(total=total, initial=initial, disable=not (enabled and self.live), dynamic_ncols=True,
                        desc="train")

    def update(self, n: int = 1):
        self.bar.update(n)

    def interval(self, step: int, loss: float, steps_per_sec: float):
        """One log interval's numbers: the bar's postfix, or a plain line."""
        if self.live:
            self.bar.set_postfix(loss=f"{loss:.4f}", it_s=f"{steps_per_sec:.2f}")
        elif self.enabled:
            eta = format_duration((self.total - step) / steps_per_sec) if steps_per_sec > 0 else "?"
            print(f"step {step}/{self.total}  loss {loss:.4f}  {steps_per_sec:.2f} it/s  ETA {eta}", flush=True)

    @staticmethod
    def write(message: str):
        """A message between bar updates (the bar is redrawn below it)."""
        tqdm.write(message)
        sys.stdout.flush()

    def close(self):
        self.bar.close()
