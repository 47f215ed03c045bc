"""EDM samplers (Karras et al. 2022): Algorithm 2 (Heun, optional churn), its first-order variant, the
generalised "ablation" sampler of EDM's generate.py, and per-seed random generators.

The `net` contract
------------------
Every sampler here takes a `net` that is any callable ``net(x, sigma, class_labels, **kw) -> D(x; sigma)``
with the attributes ``sigma_min``, ``sigma_max`` (floats) and ``round_sigma(sigma)``. `EDMPrecond`, the
guidance wrappers of `edm.guidance` and small analytic denoisers all fit.

* Arithmetic between network calls is float64. Before each call the state is cast to float32 (what the
  network runs in; `EDMPrecond` would cast it anyway) and the denoised output is cast back to float64.
* ``sigma`` is passed as a Python float (the same noise level for the whole batch). A net that needs it on
  the device should fill it in there (`edm.precond.sigma_column`), not copy it from the host.
* Extra keyword arguments of the sampler (``**net_kwargs``) are forwarded unchanged to every call.
* The samplers return float64 latents; the caller casts.

No host-device synchronisation in the step loop: the noise levels, the churn decisions and every
coefficient are Python floats computed before the loop, so on a GPU the host queues step after step
without waiting (``float(t)`` of a CUDA tensor would wait once per step). `tests/test_sampler_syncs.py`
runs the samplers on the meta device, where any such read raises.

Network evaluations (NFE) per sample, N = num_steps:
  ``edm_sampler`` (Heun)        2N - 1 (no correction on the last step, which lands on sigma = 0)
  ``euler_sampler``             N
  ``ablation_sampler``          2N - 1 with solver='heun', N with solver='euler'
A guidance wrapper multiplies these by its own cost per call (see `edm.guidance`).

Randomness: the latents and the churn noise should come from a `StackedRandomGenerator` (one generator per
seed) so that every sample depends only on its own seed, not on batch composition or the number of GPUs.
With churn on (S_churn > 0) the samplers draw ``randn_like`` once per step, like EDM, even on steps whose
churn factor is 0, so the random stream (and hence the samples) match EDM's for the same generators.
Without churn they draw nothing: the noise would be multiplied by 0, and B per-seed draws per step cost B
small kernel launches each.
"""
import functools
import inspect
import math
from typing import Callable, Optional, Sequence

import torch

from tread_utils.errors import UserError

__all__ = [
    "edm_sampler",
    "euler_sampler",
    "ablation_sampler",
    "StackedRandomGenerator",
    "SAMPLERS",
    "edm_time_steps",
]


# ----------------------------------------------------------------------------------------------------
# Shared helpers

def _denoise(net, x: torch.Tensor, sigma: float, class_labels, net_kwargs: dict) -> torch.Tensor:
    """One network evaluation: float32 in, float64 out, sigma as a Python float."""
    out = net(x.to(torch.float32), sigma, class_labels, **net_kwargs)
    return out.to(torch.float64)


def _as_f64(value, device) -> torch.Tensor:
    return torch.as_tensor(value).to(dtype=torch.float64, device=device)


def _check_num_steps(num_steps) -> int:
    if int(num_steps) != num_steps or num_steps < 1:
        raise ValueError(f"num_steps must be a positive integer, got {num_steps!r}")
    return int(num_steps)


def _step_fractions(num_steps: int, device) -> torch.Tensor:
    """i / (N - 1) for i = 0..N-1 in float64 (a single step starts at the top of the range)."""
    idx = torch.arange(num_steps, dtype=torch.float64, device=device)
    return idx / (num_steps - 1) if num_steps > 1 else idx


def edm_time_steps(net, num_steps: int = 18, sigma_min: float = 0.002, sigma_max: float = 80.0,
                   rho: float = 7.0, device=None) -> torch.Tensor:
    """EDM's noise levels t_0 > ... > t_{N-1} > t_N = 0 (float64, length N + 1).

    t_i = (smax^(1/rho) + i/(N-1) (smin^(1/rho) - smax^(1/rho)))^rho with the range first clamped to what
    the network supports ([net.sigma_min, net.sigma_max]); t_0..t_{N-1} are passed through
    ``net.round_sigma``.
    """
    num_steps = _check_num_steps(num_steps)
    lo = max(float(sigma_min), float(getattr(net, "sigma_min", 0.0)))
    hi = min(float(sigma_max), float(getattr(net, "sigma_max", math.inf)))
    frac = _step_fractions(num_steps, device)
    a, b = hi ** (1.0 / rho), lo ** (1.0 / rho)
    steps = (a + frac * (b - a)) ** rho
    steps = _as_f64(net.round_sigma(steps), device)
    return torch.cat([steps, torch.zeros(1, dtype=torch.float64, device=device)])


# ----------------------------------------------------------------------------------------------------
# Algorithm 2 and its first-order variant

def _host_sigma(net, value: float) -> float:
    """net.round_sigma(value) as a Python float, computed on the host."""
    return float(net.round_sigma(torch.tensor(value, dtype=torch.float64)))


def _edm_loop(net, latents, class_labels, *, num_steps, sigma_min, sigma_max, rho, S_churn, S_min, S_max,
              S_noise, randn_like, second_order: bool, net_kwargs: dict) -> torch.Tensor:
    num_steps = _check_num_steps(num_steps)
    t = edm_time_steps(net, num_steps, sigma_min, sigma_max, rho).tolist()  # host floats: no device reads
    churn = min(S_churn / num_steps, math.sqrt(2.0) - 1.0)

    x = latents.to(torch.float64) * t[0]
    for i in range(num_steps):
        t_cur, t_next = t[i], t[i + 1]

        # Churn: raise the noise level from t_cur to t_hat by adding fresh noise.
        gamma = churn if S_min <= t_cur <= S_max else 0.0
        t_hat = _host_sigma(net, t_cur + gamma * t_cur)
        x_hat = x
        if churn > 0:
            extra_std = math.sqrt(max(t_hat ** 2 - t_cur ** 2, 0.0))
            x_hat = x + extra_std * S_noise * randn_like(x)

        # Euler step from t_hat to t_next.
        d_cur = (x_hat - _denoise(net, x_hat, t_hat, class_labels, net_kwargs)) / t_hat
        x = x_hat + (t_next - t_hat) * d_cur

        # Heun (trapezoidal) correction, skipped on the last step where t_next = 0.
        if second_order and i < num_steps - 1:
            d_next = (x - _denoise(net, x, t_next, class_labels, net_kwargs)) / t_next
            x = x_hat + (t_next - t_hat) * (0.5 * d_cur + 0.5 * d_next)
    return x


def edm_sampler(net, latents: torch.Tensor, class_labels=None, *, num_steps: int = 18,
                sigma_min: float = 0.002, sigma_max: float = 80.0, rho: float = 7.0, S_churn: float = 0.0,
                S_min: float = 0.0, S_max: float = float("inf"), S_noise: float = 1.0,
                randn_like: Callable = torch.randn_like, **net_kwargs) -> torch.Tensor:
    """EDM Algorithm 2: deterministic Heun sampler with optional stochastic churn. NFE = 2N - 1.

    `latents` are unit-variance noise (scaled here by t_0); returns float64 samples at sigma = 0.
    Churn: gamma_i = min(S_churn / N, sqrt(2) - 1) when S_min <= t_i <= S_max, else 0.
    """
    return _edm_loop(net, latents, class_labels, num_steps=num_steps, sigma_min=sigma_min,
                     sigma_max=sigma_max, rho=rho, S_churn=S_churn, S_min=S_min, S_max=S_max,
                     S_noise=S_noise, randn_like=randn_like, second_order=True, net_kwargs=net_kwargs)


def euler_sampler(net, latents: torch.Tensor, class_labels=None, *, num_steps: int = 18,
                  sigma_min: float = 0.002, sigma_max: float = 80.0, rho: float = 7.0, S_churn: float = 0.0,
                  S_min: float = 0.0, S_max: float = float("inf"), S_noise: float = 1.0,
                  randn_like: Callable = torch.randn_like, **net_kwargs) -> torch.Tensor:
    """First-order version of `edm_sampler` (same time steps and churn, no Heun correction). NFE = N."""
    return _edm_loop(net, latents, class_labels, num_steps=num_steps, sigma_min=sigma_min,
                     sigma_max=sigma_max, rho=rho, S_churn=S_churn, S_min=S_min, S_max=S_max,
                     S_noise=S_noise, randn_like=randn_like, second_order=False, net_kwargs=net_kwargs)


# ----------------------------------------------------------------------------------------------------
# Generalised sampler of EDM's generate.py (Table 1 / Section 3 ablations)

# The VP schedule that defines the default VP noise range (Song et al. 2021): beta_d 19.9, beta_min 0.1.
VP_BETA_D = 19.9
VP_BETA_MIN = 0.1


class _VPSchedule:
    """sigma(t) = sqrt(exp(beta_d t^2 / 2 + beta_min t) - 1), its derivative and inverse."""

    def __init__(self, beta_d: float, beta_min: float):
        self.beta_d, self.beta_min = float(beta_d), float(beta_min)

    def sigma(self, t):
        t = torch.as_tensor(t, dtype=torch.float64)
        return torch.expm1(0.5 * self.beta_d * t ** 2 + self.beta_min * t).sqrt()

    def deriv(self, t):
        t = torch.as_tensor(t, dtype=torch.float64)
        s = self.sigma(t)
        return 0.5 * (self.beta_min + self.beta_d * t) * (s + 1.0 / s)

    def inv(self, sigma):
        sigma = torch.as_tensor(sigma, dtype=torch.float64)
        log_term = torch.log1p(sigma ** 2)
        return ((self.beta_min ** 2 + 2.0 * self.beta_d * log_term).sqrt() - self.beta_min) / self.beta_d


class _VESchedule:
    """sigma(t) = sqrt(t)."""

    @staticmethod
    def sigma(t):
        return torch.as_tensor(t, dtype=torch.float64).sqrt()

    @staticmethod
    def deriv(t):
        return 0.5 / torch.as_tensor(t, dtype=torch.float64).sqrt()

    @staticmethod
    def inv(sigma):
        return torch.as_tensor(sigma, dtype=torch.float64) ** 2


class _LinearSchedule:
    """sigma(t) = t (EDM's choice)."""

    @staticmethod
    def sigma(t):
        return torch.as_tensor(t, dtype=torch.float64)

    @staticmethod
    def deriv(t):
        return torch.ones_like(torch.as_tensor(t, dtype=torch.float64))

    @staticmethod
    def inv(sigma):
        return torch.as_tensor(sigma, dtype=torch.float64)


def _iddpm_sigmas(M: int, C_1: float, C_2: float) -> list:
    """The M + 1 noise levels u_0 > u_1 > ... > u_M = 0 of improved DDPM's cosine schedule."""
    def alpha_bar(j):
        return math.sin(0.5 * math.pi * j / M / (C_2 + 1.0)) ** 2

    u = [0.0] * (M + 1)
    for j in range(M, 0, -1):
        ratio = max(alpha_bar(j - 1) / alpha_bar(j), C_1)
        u[j - 1] = math.sqrt((u[j] ** 2 + 1.0) / ratio - 1.0)
    return u


def ablation_sampler(net, latents: torch.Tensor, class_labels=None, *, num_steps: int = 18,
                     sigma_min: Optional[float] = None, sigma_max: Optional[float] = None, rho: float = 7.0,
                     solver: str = "heun", discretization: str = "edm", schedule: str = "linear",
                     scaling: str = "none", epsilon_s: float = 1e-3, C_1: float = 0.001, C_2: float = 0.008,
                     M: int = 1000, alpha: float = 1.0, S_churn: float = 0.0, S_min: float = 0.0,
                     S_max: float = float("inf"), S_noise: float = 1.0, randn_like: Callable = torch.randn_like,
                     **net_kwargs) -> torch.Tensor:
    """EDM's generalised sampler: any of the time-step discretizations, noise schedules and scalings of
    VP, VE, iDDPM and EDM, with an Euler or a (generalised, parameter `alpha`) Heun solver.

    Default noise range when sigma_min / sigma_max are None (then clamped to the network's range):
      vp:    sigma_vp(epsilon_s) .. sigma_vp(1), VP schedule with beta_d 19.9, beta_min 0.1 (~0.0105 .. ~152)
      ve:    0.02 .. 100
      iddpm: 0.002 .. 81 (cosine schedule with C_1, C_2, M)
      edm:   0.002 .. 80 (with rho)
    With discretization='edm', solver='heun', schedule='linear', scaling='none' this is `edm_sampler`.
    NFE = 2N - 1 (heun) or N (euler). Noise levels are host floats and the state is float64; the net sees
    float32 x, sigma as a Python float, and `net_kwargs` on every call.
    """
    for setting, value, choices in (("solver", solver, ("euler", "heun")), ("scaling", scaling, ("vp", "none")),
                                    ("discretization", discretization, ("vp", "ve", "iddpm", "edm")),
                                    ("schedule", schedule, ("vp", "ve", "linear"))):
        if value not in choices:
            raise ValueError(f"{setting} must be one of {', '.join(choices)}, got {value!r}")
    num_steps = _check_num_steps(num_steps)

    # Noise range: per-discretization defaults, then clamped to what the network supports.
    ref_vp = _VPSchedule(VP_BETA_D, VP_BETA_MIN)
    if sigma_min is None:
        sigma_min = {"vp": float(ref_vp.sigma(epsilon_s)), "ve": 0.02, "iddpm": 0.002, "edm": 0.002}[discretization]
    if sigma_max is None:
        sigma_max = {"vp": float(ref_vp.sigma(1.0)), "ve": 100.0, "iddpm": 81.0, "edm": 80.0}[discretization]
    sigma_min = max(float(sigma_min), float(getattr(net, "sigma_min", 0.0)))
    sigma_max = min(float(sigma_max), float(getattr(net, "sigma_max", math.inf)))

    # VP parameters that make sigma_vp(epsilon_s) = sigma_min and sigma_vp(1) = sigma_max.
    log_hi = math.log1p(sigma_max ** 2)
    log_lo = math.log1p(sigma_min ** 2)
    vp_beta_d = 2.0 * (log_lo / epsilon_s - log_hi) / (epsilon_s - 1.0)
    vp_beta_min = log_hi - 0.5 * vp_beta_d
    vp = _VPSchedule(vp_beta_d, vp_beta_min)

    # Noise levels of the N steps, on the host (see "No host-device synchronisation" above).
    frac = _step_fractions(num_steps, None)
    if discretization == "vp":
        sigma_steps = vp.sigma(1.0 + frac * (epsilon_s - 1.0))
    elif discretization == "ve":
        sigma_steps = _VESchedule.sigma(sigma_max ** 2 * (sigma_min ** 2 / sigma_max ** 2) ** frac)
    elif discretization == "iddpm":
        u = torch.tensor(_iddpm_sigmas(int(M), C_1, C_2), dtype=torch.float64)
        kept = u[(u >= sigma_min) & (u <= sigma_max)]
        if kept.numel() == 0:
            raise ValueError(f"no iDDPM noise level lies in [{sigma_min}, {sigma_max}]")
        pick = ((kept.numel() - 1) * frac).round().to(torch.int64)
        sigma_steps = kept[pick]
    else:
        a, b = sigma_max ** (1.0 / rho), sigma_min ** (1.0 / rho)
        sigma_steps = (a + frac * (b - a)) ** rho

    # Noise schedule sigma(t) and scaling s(t), as functions of a host float returning a host float.
    sched = {"vp": vp, "ve": _VESchedule, "linear": _LinearSchedule}[schedule]

    def sig(t):
        return float(sched.sigma(t))

    def sig_d(t):
        return float(sched.deriv(t))

    def sig_inv_rounded(sigma):
        return float(sched.inv(net.round_sigma(torch.tensor(sigma, dtype=torch.float64))))

    if scaling == "vp":
        def s(t):
            return 1.0 / math.sqrt(1.0 + sig(t) ** 2)

        def s_d(t):
            return -sig(t) * sig_d(t) * s(t) ** 3
    else:
        def s(t):
            return 1.0

        def s_d(t):
            return 0.0

    def derivative(x, t):
        """dx/dt of the probability-flow ODE at (x, t) in the (sigma, s) parameterisation."""
        sg, sd, st = sig(t), sig_d(t), s(t)
        denoised = _denoise(net, x / st, sg, class_labels, net_kwargs)
        return (sd / sg + s_d(t) / st) * x - sd * st / sg * denoised

    t_steps = _as_f64(sched.inv(_as_f64(net.round_sigma(sigma_steps), None)), None).tolist() + [0.0]

    churn = min(S_churn / num_steps, math.sqrt(2.0) - 1.0)
    x = latents.to(torch.float64) * (sig(t_steps[0]) * s(t_steps[0]))
    for i in range(num_steps):
        t_cur, t_next = t_steps[i], t_steps[i + 1]
        sig_cur = sig(t_cur)

        gamma = churn if S_min <= sig_cur <= S_max else 0.0
        t_hat = sig_inv_rounded(sig_cur + gamma * sig_cur)
        x_hat = s(t_hat) / s(t_cur) * x
        if churn > 0:  # one draw per step, as in `_edm_loop`
            extra_std = math.sqrt(max(sig(t_hat) ** 2 - sig_cur ** 2, 0.0))
            x_hat = x_hat + extra_std * s(t_hat) * S_noise * randn_like(x)

        h = t_next - t_hat
        d_cur = derivative(x_hat, t_hat)
        if solver == "euler" or i == num_steps - 1:
            x = x_hat + h * d_cur
        else:
            # Generalised second-order step: evaluate at t_hat + alpha h (alpha = 1: Heun).
            t_prime = t_hat + alpha * h
            x_prime = x_hat + alpha * h * d_cur
            d_prime = derivative(x_prime, t_prime)
            w = 1.0 / (2.0 * alpha)
            x = x_hat + h * ((1.0 - w) * d_cur + w * d_prime)
    return x


# ----------------------------------------------------------------------------------------------------
# Per-seed random numbers

class StackedRandomGenerator:
    """One `torch.Generator` per sample: row k of every draw comes from the generator of seeds[k] alone.

    A sample's latents and churn noise therefore depend only on its seed, not on which other seeds share
    its batch or how seeds are spread over GPUs. Drop-in for ``torch.randn_like`` (``randn_like=gen.randn_like``).
    They do depend on the device type: a CPU and a CUDA generator with the same seed give different streams,
    so a seed's image on a GPU differs from its image on the CPU (both are reproducible). Each draw costs one
    small kernel per seed; the samplers draw per step only when churn is on.
    """

    def __init__(self, device, seeds: Sequence[int]):
        self.device = torch.device(device)
        self.seeds = [int(seed) for seed in seeds]
        self.generators = [torch.Generator(self.device).manual_seed(seed % (1 << 32)) for seed in self.seeds]

    def __len__(self):
        return len(self.generators)

    def _check(self, size):
        size = tuple(size)
        if not size or size[0] != len(self.generators):
            raise ValueError(f"first dimension of size {size} must equal the number of seeds ({len(self.generators)})")
        return size

    def randn(self, size, *, dtype=None, device=None, **kwargs) -> torch.Tensor:
        size = self._check(size)
        device = self.device if device is None else device
        rows = [torch.randn(size[1:], generator=g, dtype=dtype, device=device, **kwargs) for g in self.generators]
        return torch.stack(rows)

    def randn_like(self, x: torch.Tensor) -> torch.Tensor:
        return self.randn(x.shape, dtype=x.dtype, device=x.device, layout=x.layout)

    def randint(self, *args, size, dtype=None, device=None, **kwargs) -> torch.Tensor:
        size = self._check(size)
        device = self.device if device is None else device
        kw = dict(kwargs)
        if dtype is not None:
            kw["dtype"] = dtype
        rows = [torch.randint(*args, size=size[1:], generator=g, device=device, **kw) for g in self.generators]
        return torch.stack(rows)


# ----------------------------------------------------------------------------------------------------
# Lookup for the CLI

SAMPLERS = {
    "edm": edm_sampler,        # Heun, Algorithm 2
    "heun": edm_sampler,
    "euler": euler_sampler,
    "ablation": ablation_sampler,
}


def bind_sampler(name: str, fn: Callable, **kwargs) -> Callable:
    """`fn` with its settings bound. Only the sampler's own keyword-only parameters are accepted (e.g.
    num_steps, S_churn, solver); a misspelt one raises `UserError` instead of silently reaching the network
    as a keyword argument. Pass network keyword arguments at call time."""
    params = inspect.signature(fn).parameters
    allowed = [p for p, v in params.items() if v.kind == inspect.Parameter.KEYWORD_ONLY]
    unknown = sorted(set(kwargs) - set(allowed))
    if unknown:
        raise UserError(f"sampler {name!r} has no setting {', '.join(unknown)}; valid settings: {', '.join(allowed)}")
    return functools.partial(fn, **kwargs)
