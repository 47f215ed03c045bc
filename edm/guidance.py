"""Guidance wrappers. Each one is itself a sampler `net` (see `edm.sampler`): it is called as
``guided(x, sigma, class_labels, **kw)``, exposes ``sigma_min``, ``sigma_max``, ``round_sigma`` (and
``num_classes``) of the wrapped net, and forwards ``**kw`` to it. They therefore nest and plug into any sampler.

* `ClassifierFreeGuidance`: D = D_u + scale (D_c - D_u) on every channel, with both halves in one batched
  forward, and an optional guidance interval (Kynkaanniemi et al. 2024).
* `RoutingGuidance`: TREAD "sparse guidance" - the same model with routing forced at two selection ratios,
  D = D_weak + scale (D_strong - D_weak).
* `PathDropGuidance`: SPRINT's path-drop guidance - D = D_weak + scale (D - D_weak), D_weak from the same
  model with its sparse deep path dropped (``drop_deep_path=True``: mask tokens, the deep blocks skipped).
* `NFECounter`: counts calls and batch rows reaching a net (put it innermost for true backbone costs).

Evaluation counters (every wrapper, reset with ``reset_counters()``):
  ``num_calls``  forward calls the wrapper made to the net it wraps;
  ``num_rows``   batch rows (images) in those calls;
  ``nfe``        network evaluations in units of "one plain forward of the batch the wrapper was given",
                 i.e. the sum over calls of rows / rows requested. A CFG call inside its interval costs 2,
                 outside it (or at scale 1) 1; a routing-guidance call costs 2 (1 when it reduces to one
                 forward). So an N-step Heun run costs ``(2N - 1) * nfe_per_call``.
  Counters count calls to the *directly wrapped* net: for nested wrappers the true backbone cost is the
  product of the costs, or read it from an `NFECounter` wrapped around the backbone.
"""
import abc
import math
from typing import Optional, Sequence

import torch

__all__ = ["ClassifierFreeGuidance", "RoutingGuidance", "PathDropGuidance", "NFECounter", "null_labels"]


class NetWrapper(abc.ABC):
    """Delegates the sampler `net` contract to `self.net` and keeps evaluation counters."""

    def __init__(self, net):
        self.net = net
        self.reset_counters()

    @property
    def denoiser(self):
        """The denoiser under every wrapper (a guidance wrapper may wrap another)."""
        return self.net.denoiser if isinstance(self.net, NetWrapper) else self.net

    # -- the `net` contract
    @property
    def sigma_min(self) -> float:
        return float(getattr(self.net, "sigma_min", 0.0))

    @property
    def sigma_max(self) -> float:
        return float(getattr(self.net, "sigma_max", math.inf))

    @property
    def num_classes(self) -> int:
        return getattr(self.net, "num_classes", 0)

    def round_sigma(self, sigma):
        rounder = getattr(self.net, "round_sigma", None)
        return rounder(sigma) if rounder is not None else torch.as_tensor(sigma)

    def __call__(self, x, sigma, class_labels=None, **kwargs):
        return self.forward(x, sigma, class_labels, **kwargs)

    @abc.abstractmethod
    def forward(self, x, sigma, class_labels=None, **kwargs):
        """The guided denoiser output for x at noise level sigma."""

    # -- counters
    def reset_counters(self):
        self.num_calls = 0
        self.num_rows = 0
        self.nfe = 0.0

    def _call_net(self, x, sigma, class_labels, requested_rows: int, **kwargs):
        self.num_calls += 1
        self.num_rows += int(x.shape[0])
        self.nfe += x.shape[0] / max(int(requested_rows), 1)
        return self.net(x, sigma, class_labels, **kwargs)


class NFECounter(NetWrapper):
    """Transparent wrapper counting forward calls (`num_calls`, = `nfe`) and batch rows (`num_rows`)."""

    def forward(self, x, sigma, class_labels=None, **kwargs):
        return self._call_net(x, sigma, class_labels, x.shape[0], **kwargs)


def null_labels(class_labels: torch.Tensor, num_classes: int) -> torch.Tensor:
    """The unconditional ("null") labels matching `class_labels`.

    Integer labels [B]: the null class index `num_classes` (the label table has num_classes + 1 rows).
    One-hot labels [B, K]: a one-hot of column `num_classes` when K > num_classes, else all zeros.
    """
    if class_labels.ndim == 1 and not class_labels.is_floating_point():
        return torch.full_like(class_labels, int(num_classes))
    if class_labels.ndim == 2:
        out = torch.zeros_like(class_labels)
        if class_labels.shape[1] > num_classes:
            out[:, int(num_classes)] = 1
        return out
    raise ValueError(f"class labels must be integer [B] or one-hot [B, K], got {tuple(class_labels.shape)} "
                     f"{class_labels.dtype}")


def _sigma_rows(sigma, batch: int, device) -> torch.Tensor:
    """sigma as a [batch] float64 tensor (for per-row interval tests)."""
    s = torch.as_tensor(sigma).to(dtype=torch.float64, device=device).reshape(-1)
    if s.numel() == 1:
        return s.expand(batch)
    if s.numel() != batch:
        raise ValueError(f"sigma has {s.numel()} values for a batch of {batch}")
    return s


class ClassifierFreeGuidance(NetWrapper):
    """Classifier-free guidance: D = D_u + scale (D_c - D_u), over ALL latent channels.

    The conditional and unconditional passes run as ONE forward of the doubled batch
    ``cat([x, x])`` with labels ``cat([y, null])``, where null = `num_classes` (see `null_labels`).

    interval=(lo, hi): guide only where lo <= sigma <= hi (guidance interval, Kynkaanniemi et al. 2024).
    Outside it the output is the plain conditional D_c from a single, un-doubled forward. With a per-row
    sigma [B], only the rows inside the interval get their unconditional copy (one forward of B + k rows).
    scale == 1: plain conditional forward; scale == 0: plain unconditional forward.

    Keyword arguments (e.g. ``force_routing_ratio``, ``routing_seed``) are forwarded unchanged to the
    (batched) call, so they must not depend on the batch size.
    """

    def __init__(self, net, scale: float, num_classes: Optional[int] = None,
                 interval: Optional[Sequence[float]] = None):
        super().__init__(net)
        self.scale = float(scale)
        if num_classes is None:
            num_classes = getattr(net, "num_classes", None)
            if num_classes is None:
                raise ValueError("ClassifierFreeGuidance needs num_classes (the null label index)")
        self._num_classes = int(num_classes)
        if interval is not None:
            lo, hi = (float(v) for v in interval)
            assert lo <= hi, f"guidance interval ({lo}, {hi})"
            interval = (lo, hi)
        self.interval = interval

    @property
    def num_classes(self) -> int:
        return self._num_classes

    def in_interval(self, sigma, batch: int = 1, device=None) -> torch.Tensor:
        """[batch] bool: which rows get guidance at noise level `sigma`."""
        s = _sigma_rows(sigma, batch, device)
        if self.interval is None:
            return torch.ones(batch, dtype=torch.bool, device=s.device)
        lo, hi = self.interval
        return (s >= lo) & (s <= hi)

    def forward(self, x, sigma, class_labels=None, **kwargs):
        batch = x.shape[0]
        if self.scale == 1.0:
            return self._call_net(x, sigma, class_labels, batch, **kwargs)
        if class_labels is None:
            raise ValueError(f"classifier-free guidance (scale {self.scale}) needs class labels")
        uncond = null_labels(class_labels, self._num_classes)
        if self.scale == 0.0:
            return self._call_net(x, sigma, uncond, batch, **kwargs)

        if torch.is_tensor(sigma) and sigma.numel() > 1:
            return self._per_row(x, sigma, class_labels, uncond, **kwargs)
        # One noise level for the batch: the samplers pass a host float, so the interval test below never
        # waits for the device (a 0-d tensor from another caller is read once here).
        level = float(sigma)
        if self.interval is not None and not self.interval[0] <= level <= self.interval[1]:
            return self._call_net(x, sigma, class_labels, batch, **kwargs)
        out = self._call_net(torch.cat([x, x]), sigma, torch.cat([class_labels, uncond]), batch, **kwargs)
        return self._combine(out[:batch], out[batch:])

    def _combine(self, d_cond, d_uncond):
        return d_uncond + self.scale * (d_cond - d_uncond)

    def _per_row(self, x, sigma, class_labels, uncond, **kwargs):
        """A [B] sigma: only the rows inside the interval get their unconditional copy (reads the device)."""
        batch = x.shape[0]
        guided = self.in_interval(sigma, batch, x.device)
        n_guided = int(guided.sum())
        if n_guided == 0:
            return self._call_net(x, sigma, class_labels, batch, **kwargs)
        sigma_rows = torch.as_tensor(sigma, device=x.device).reshape(-1)
        if n_guided == batch:
            out = self._call_net(torch.cat([x, x]), torch.cat([sigma_rows] * 2), torch.cat([class_labels, uncond]),
                                 batch, **kwargs)
            return self._combine(out[:batch], out[batch:])

        # Rows straddling the interval: unconditional copies only for the guided rows.
        idx = guided.nonzero().flatten()
        x_in = torch.cat([x, x[idx]])
        y_in = torch.cat([class_labels, uncond[idx]])
        sigma_in = torch.cat([sigma_rows, sigma_rows[idx]])
        out = self._call_net(x_in, sigma_in, y_in, batch, **kwargs)
        d_cond, d_uncond = out[:batch], out[batch:]
        result = d_cond.clone()
        result[idx] = self._combine(d_cond[idx], d_uncond)
        return result


class RoutingGuidance(NetWrapper):
    """TREAD "sparse guidance": D = D_weak + scale (D_strong - D_weak).

    Both terms come from the same network with TREAD routing forced on (``force_routing_ratio=``):
    D_strong at `strong_ratio`, D_weak at `weak_ratio`. The selection ratio is the fraction of tokens that
    SKIP the route, so the *strong* (guiding) model is the denser one, i.e. the LOWER ratio, and the weak
    one skips more tokens - e.g. strong_ratio=0.3, weak_ratio=0.7 (the TREAD code sketch). scale > 1
    extrapolates away from the sparser model, like CFG away from the unconditional one. The ratios are
    not reordered: passing strong_ratio > weak_ratio guides towards the sparser model.

    Both calls of one evaluation use the SAME ``routing_seed``, derived from `seed` and a counter of
    evaluations (`step`, reset by `reset()`): the two ratios draw their tokens from the same random
    stream, and a fresh token selection is drawn at every evaluation of the sampler.
    A ``routing_seed`` passed by the caller overrides the derived one. With equal ratios (or scale == 0)
    the output is exactly ONE forward at weak_ratio with that seed; with scale == 1 exactly one at
    strong_ratio.

    Combining with CFG: both wrapping orders work (they are the same bilinear combination):
    ``RoutingGuidance(ClassifierFreeGuidance(net, w, C), ...)`` passes ``force_routing_ratio`` and
    ``routing_seed`` through CFG's single doubled forward (2 doubled forwards per evaluation);
    ``ClassifierFreeGuidance(RoutingGuidance(net, ...), w, C)`` runs routing guidance on the doubled batch.
    The seed is shared by the whole batch, so the token selection depends on the batch, not the sample.
    """

    def __init__(self, net, weak_ratio: float, strong_ratio: float, scale: float, seed: int = 0):
        super().__init__(net)
        assert 0.0 <= weak_ratio < 1.0 and 0.0 <= strong_ratio < 1.0, (weak_ratio, strong_ratio)
        self.weak_ratio = float(weak_ratio)
        self.strong_ratio = float(strong_ratio)
        self.scale = float(scale)
        self.seed = int(seed)
        self.step = 0

    def reset(self):
        """Restart the evaluation counter (same seeds again, e.g. at the start of each batch)."""
        self.step = 0

    @staticmethod
    def derive_seed(seed: int, step: int) -> int:
        """The routing seed of evaluation `step` (a fixed 63-bit mix of seed and step)."""
        mixed = (int(seed) * 0x9E3779B97F4A7C15 + int(step) * 0xBF58476D1CE4E5B9 + 0x94D049BB133111EB)
        mixed ^= mixed >> 31
        return mixed % (1 << 63)

    def forward(self, x, sigma, class_labels=None, **kwargs):
        kwargs.pop("force_routing_ratio", None)  # this wrapper decides the ratios
        routing_seed = kwargs.pop("routing_seed", None)
        if routing_seed is None:
            routing_seed = self.derive_seed(self.seed, self.step)
        self.step += 1
        batch = x.shape[0]

        def run(ratio):
            return self._call_net(x, sigma, class_labels, batch, force_routing_ratio=ratio,
                                  routing_seed=routing_seed, **kwargs)

        if self.weak_ratio == self.strong_ratio or self.scale == 0.0:
            return run(self.weak_ratio)
        if self.scale == 1.0:
            return run(self.strong_ratio)
        d_weak = run(self.weak_ratio)
        d_strong = run(self.strong_ratio)
        return d_weak + self.scale * (d_strong - d_weak)


class PathDropGuidance(NetWrapper):
    """SPRINT's path-drop guidance (PDG): D = D_weak + scale (D - D_weak).

    D is the plain call; D_weak the same call with ``drop_deep_path=True``: every SPRINT route (fusion:
    sprint) skips its deep blocks and feeds mask tokens to its fusion, as the model learnt from
    `path_drop_prob` in training. Both use the caller's labels; the weak pass costs less than a full
    forward (the deep blocks do not run). `interval=(lo, hi)`: guide only at noise levels inside it, one
    plain call elsewhere (per row for a [B] sigma: rows outside take D). scale == 1: one plain call;
    scale == 0: one weak call. Nests with the other wrappers (both receive the keyword arguments).
    """

    def __init__(self, net, scale: float, interval: Optional[Sequence[float]] = None):
        super().__init__(net)
        self.scale = float(scale)
        self.interval = None if interval is None else tuple(float(v) for v in interval)

    def forward(self, x, sigma, class_labels=None, **kwargs):
        batch = x.shape[0]
        kwargs.pop("drop_deep_path", None)  # this wrapper decides
        if self.scale == 1.0:
            return self._call_net(x, sigma, class_labels, batch, **kwargs)
        inside = None
        if self.interval is not None:
            lo, hi = self.interval
            if not (torch.is_tensor(sigma) and sigma.numel() > 1):
                if not lo <= float(sigma) <= hi:
                    return self._call_net(x, sigma, class_labels, batch, **kwargs)
            else:
                s = _sigma_rows(sigma, batch, x.device)
                inside = ((s >= lo) & (s <= hi)).reshape(-1, *([1] * (x.ndim - 1)))
        d_weak = self._call_net(x, sigma, class_labels, batch, drop_deep_path=True, **kwargs)
        if self.scale == 0.0:
            return d_weak
        d = self._call_net(x, sigma, class_labels, batch, **kwargs)
        guided = d_weak + self.scale * (d - d_weak)
        return guided if inside is None else torch.where(inside, guided.to(d.dtype), d)
