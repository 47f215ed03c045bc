"""EDM preconditioning (Karras et al. 2022, Table 1): D(x; sigma) = c_skip x + c_out F(c_in x; c_noise)."""
import torch
import torch.nn as nn


class EDMPrecond(nn.Module):
    """Wraps a backbone F(x, t, y, **kw) -> [B, C, H, W] into the denoiser D(x; sigma, y).

    Follows EDM's sampler convention: `sigma_min`, `sigma_max` and `round_sigma` are attributes, and
    `forward(x, sigma, class_labels)` accepts sigma as a scalar, a 0-d tensor or a [B] tensor.
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
        sigma = torch.as_tensor(sigma, dtype=torch.float32, device=x.device).reshape(-1, 1, 1, 1)
        sigma = sigma.expand(x.shape[0], 1, 1, 1)
        sd = self.sigma_data
        c_skip = sd ** 2 / (sigma ** 2 + sd ** 2)
        c_out = sigma * sd / (sigma ** 2 + sd ** 2).sqrt()
        c_in = 1 / (sd ** 2 + sigma ** 2).sqrt()
        c_noise = sigma.log() / 4
        F_x = self.model(c_in * x, c_noise.flatten(), class_labels, **model_kwargs)
        return c_skip * x + c_out * F_x.to(torch.float32)

    def round_sigma(self, sigma):
        return torch.as_tensor(sigma)
