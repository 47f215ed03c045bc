"""The sampling progress bar. It counts images, but moves per sampler step and per decoded image rather than
per batch: a batch of a large model, or on a CPU, or through the SD-VAE decoder, takes minutes, and a bar
that waits for the whole batch shows nothing (and no ETA) until then. Where stderr is not a terminal (a job's
log file) there is no bar, whose updates would pile up there, but a plain line at each tenth of the images:

    sample 150/500 images  12.31 img/s  ETA 0:00:28
"""
import sys
import time

import numpy as np
import torch
from tqdm import tqdm

from tread_utils.cli import format_duration


class _Ticking:
    """The sampler's net, calling `tick()` after each network evaluation (every attribute is the net's)."""

    def __init__(self, net, tick):
        self.net, self._tick = net, tick

    def __getattr__(self, name):
        return getattr(self.net, name)

    def __call__(self, *args, **kwargs):
        out = self.net(*args, **kwargs)
        self._tick()
        return out


class SamplingProgress:
    """Images done, shown by the main process. Batches run in rounds (one batch per process); within a
    round the main process's own batch stands for the round: its `nfe` network evaluations and its decoding
    (one more share, spread over its images) move the bar across the round's images, and the count is set
    exactly when the round's images have arrived. Disabled, it changes nothing: the net and the decoding
    are the same either way."""

    def __init__(self, total: int, nfe: int, enabled: bool, desc: str = "sample", live=None):
        """`enabled`: this is the main process; `live`: the bar (default: when stderr is a terminal)."""
        self.enabled, self.nfe, self.total, self.desc = enabled, max(int(nfe), 1), total, desc
        self.live = sys.stderr.isatty() if live is None else live
        self.bar = tqdm(total=total, disable=not (enabled and self.live), desc=desc, unit="img", dynamic_ncols=True,
                        bar_format="{l_bar}{bar}| {n:.0f}/{total_fmt} [{elapsed}<{remaining}]")
        self.base, self.span, self.done_steps = 0, 0, 0.0
        self.started, self.next_line = time.monotonic(), total / 10

    def start_round(self, done: int, round_images: int):
        self.base, self.span, self.done_steps = done, round_images, 0.0
        self._show()

    def _show(self):
        target = self.base + self.span * min(self.done_steps / (self.nfe + 1), 1.0)
        if target > self.bar.n:
            self.bar.update(target - self.bar.n)  # update() keeps tqdm's refresh rate limit

    def _advance(self, steps: float):
        self.done_steps += steps
        self._show()

    def watch(self, net):
        """The net to hand to the sampler: the bar moves one step per evaluation."""
        return _Ticking(net, lambda: self._advance(1.0)) if self.enabled else net

    def decode(self, decoder, latents: torch.Tensor, per_image: bool) -> np.ndarray:
        """decoder(latents) as uint8 numpy [N, H, W, 3]; `per_image`: one image per call, the bar moving
        after each (the caller decides it from the device alone, so it never depends on the bar)."""
        parts = latents.split(1) if per_image and len(latents) > 1 else [latents]
        images = []
        for part in parts:
            out = decoder.decode(part)
            images.append(out.numpy() if isinstance(out, torch.Tensor) else np.asarray(out))
            self._advance(len(part) / len(latents))
        return np.concatenate(images) if len(images) > 1 else images[0]

    def end_round(self, done: int):
        self.base, self.span = done, 0
        if done != self.bar.n:
            self.bar.n = done
            self.bar.refresh()
        if self.enabled and not self.live and (done >= self.next_line or done == self.total):
            rate = done / max(time.monotonic() - self.started, 1e-9)
            print(f"{self.desc} {done}/{self.total} images  {rate:.2f} img/s  ETA "
                  f"{format_duration((self.total - done) / rate)}", file=sys.stderr, flush=True)
            self.next_line = done + self.total / 10

    def close(self):
        self.bar.close()
