"""ODE samplers for the velocity field: dx/dt = v(x, t), integrated from t = 1 (noise) to t = 0."""
import torch


def flow_time_steps(num_steps: int, t_max: float = 1.0, t_min: float = 0.0, shift: float = 1.0, device=None):
    """num_steps + 1 times from t_max down to t_min, uniform, optionally shifted towards noise
    (SD3's t' = shift t / (1 + (shift - 1) t))."""
    t = torch.linspace(t_max, t_min, num_steps + 1, dtype=torch.float64, device=device)
    return shift * t / (1 + (shift - 1) * t)


@torch.no_grad()
def flow_sampler(net, latents, class_labels=None, *, num_steps=40, solver="heun", t_max=1.0, t_min=0.0,
                 shift=1.0, **net_kwargs):
    """`net` has `velocity(x, t, labels, **kw)`. `latents` are standard normal noise. Unlike EDM's
    denoiser, the velocity is defined at t = 0, so Heun corrects every step (NFE = 2N); Euler: NFE = N."""
    if solver not in ("euler", "heun"):
        raise ValueError(f"solver must be 'euler' or 'heun', got {solver!r}")
    steps = flow_time_steps(num_steps, t_max, t_min, shift, device=latents.device)
    x = latents.to(torch.float64)
    for t_cur, t_next in zip(steps[:-1], steps[1:]):
        v = net.velocity(x.to(torch.float32), t_cur, class_labels, **net_kwargs).to(torch.float64)
        x_next = x + (t_next - t_cur) * v
        if solver == "heun":
            v_next = net.velocity(x_next.to(torch.float32), t_next, class_labels, **net_kwargs).to(torch.float64)
            x_next = x + (t_next - t_cur) * 0.5 * (v + v_next)
        x = x_next
    return x
