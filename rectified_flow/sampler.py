"""ODE samplers for the velocity field: dx/dt = v(x, t), integrated from t = 1 (noise) to t = 0."""
import torch


def flow_time_steps(num_steps: int, t_max: float = 1.0, t_min: float = 0.0, shift: float = 1.0, device=None):
    """num_steps + 1 times from t_max down to t_min, uniform, optionally shifted towards noise
    (SD3's t' = shift t / (1 + (shift - 1) t))."""
    t = torch.linspace(t_max, t_min, num_steps + 1, dtype=torch.float64, device=device)
    return shift * t / (1 + (shift - 1) * t)


DENOISER_T_MAX = 1 - 1e-3  # t = 1 is sigma = inf in the denoiser view


def velocity_function(net):
    """(velocity(x_t, t, labels, **kw), the largest usable t) for `net`: its own `velocity` (a FlowPrecond),
    or, for any EDM-convention denoiser (e.g. a guidance wrapper around one), v = (x_t - D(x_t / (1 - t);
    t / (1 - t))) / t, exact since D = x_t - t v in that view."""
    if hasattr(net, "velocity"):
        return net.velocity, 1.0

    def velocity(x_t, t, class_labels=None, **kw):
        if torch.is_tensor(t):  # per-row times; the sampler passes a host float (no copy to the device)
            t = t.to(dtype=torch.float64, device=x_t.device)
        x_t = x_t.to(torch.float64)
        denoised = net((x_t / (1 - t)).to(torch.float32), t / (1 - t), class_labels, **kw)
        return (x_t - denoised.to(torch.float64)) / t

    return velocity, DENOISER_T_MAX


@torch.no_grad()
def flow_sampler(net, latents, class_labels=None, *, num_steps=40, solver="heun", t_max=1.0, t_min=0.0,
                 shift=1.0, randn_like=None, **net_kwargs):
    """`latents` are standard normal noise; `net` has `velocity(x, t, labels, **kw)` or is an EDM-convention
    denoiser of a flow model (see `velocity_function`). The ODE is deterministic (`randn_like` is accepted
    for the samplers' common signature and unused). Unlike EDM's denoiser, the velocity is defined at
    t = 0, so Heun corrects every step (NFE = 2N; through the denoiser view the last step is Euler's, as
    in EDM: 2N - 1); Euler: NFE = N."""
    if solver not in ("euler", "heun"):
        raise ValueError(f"solver must be 'euler' or 'heun', got {solver!r}")
    velocity, usable_t_max = velocity_function(net)
    # Host floats: the `t_next > 0` test and the step sizes never wait for the device.
    steps = flow_time_steps(num_steps, min(t_max, usable_t_max), t_min, shift).tolist()
    x = latents.to(torch.float64)
    for t_cur, t_next in zip(steps[:-1], steps[1:]):
        v = velocity(x.to(torch.float32), t_cur, class_labels, **net_kwargs).to(torch.float64)
        x_next = x + (t_next - t_cur) * v
        if solver == "heun" and (t_next > 0 or usable_t_max == 1.0):  # the denoiser view has no v at t = 0
            v_next = velocity(x_next.to(torch.float32), t_next, class_labels, **net_kwargs).to(torch.float64)
            x_next = x + (t_next - t_cur) * 0.5 * (v + v_next)
        x = x_next
    return x
