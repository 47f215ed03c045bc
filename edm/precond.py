"""EDM preconditioning (Karras et al. 2022, Table 1): D(x; sigma) = c_skip x + c_out F(c_in x; c_noise)."""
import numbers

import torch
import torch.nn as nn


def sigma_column(sigma, x: torch.Tensor) -> torch.Tensor:
    """sigma (a number, a 0-d or a [B] tensor) as float32 [B, 1, 1, 1] on x's device. A number (what the
    samplers pass) is filled in on the device: torch.as_tensor(number, device="cuda") would copy it from the
    host and make the host wait for the GPU, once per network call."""
    if isinstance(sigma, numbers.Real) and not torch.is_tensor(sigma):
        return torch.full((x.shape[0], 1, 1, 1), float(sigma), dtype=torch.float32, device=x.device)
    sigma = torch.as_tensor(sigma, dtype=torch.float32, device=x.device).reshape(-1, 1, 1, 1)
    return sigma.expand(x.shape[0], 1, 1, 1)


class EDMPrecond(nn.Module):
    """Wraps a backbone F(x, t, y, **kw) -> [B, C, H, W] into the denoiser D(x; sigma, y).

    Follows EDM's sampler convention: `sigma_min`, `sigma_max` and `round_sigma` are attributes, and
    `forward(x, sigma, class_labels)` accepts sigma as a number, a 0-d tensor or a [B] tensor.
    Extra keyword arguments (e.g. `force_routing_ratio`) pass through to the backbone.
    """

    def __init__(self, model: nn.Module, sigma_data: float = 0.5, sigma_min: float = 0.0,
                 sigma_max: float = float("inf")):
        super().__init__()
        self.model = model
        self.sigma_data = float(sigma_data)
        self.sigma_min = float(sigma_min)
        self.sigma_max = float(sigma_max)

    @property
    def num_classes(self):
        return getattr(self.model, "num_classes", 0)

    def forward(self, x, sigma, class_labels=None, **model_kwargs):
        x = x.to(torch.float32)
        sigma = sigma_column(sigma, x)
        sd = self.sigma_data
        c_skip = sd ** 2 / (sigma ** 2 + sd ** 2)
        c_out = sigma * sd / (sigma ** 2 + sd ** 2).sqrt()
        c_in = 1 / (sd ** 2 + sigma ** 2).sqrt()
        c_noise = sigma.log() / 4
        F_x = self.model(c_in * x, c_noise.flatten(), class_labels, **model_kwargs)
        return c_skip * x + c_out * F_x.to(torch.float32)

    def round_sigma(self, sigma):
        return torch.as_tensor(sigma)
