"""The backbone as a velocity field v(x_t, t, y), and the same model seen as an EDM denoiser."""
import torch
import torch.nn as nn

from edm.precond import sigma_column


class FlowPrecond(nn.Module):
    def __init__(self, model: nn.Module, sigma_min: float = 0.0, sigma_max: float = float("inf")):
        super().__init__()
        self.model = model
        self.sigma_min, self.sigma_max = float(sigma_min), float(sigma_max)

    @property
    def num_classes(self):
        return getattr(self.model, "num_classes", 0)

    def velocity(self, x_t, t, class_labels=None, **model_kwargs):
        """v(x_t, t): t in [0, 1] as a scalar, 0-d or [B] tensor."""
        x_t = x_t.to(torch.float32)
        t = sigma_column(t, x_t).reshape(-1)
        return self.model(x_t, t, class_labels, **model_kwargs).to(torch.float32)

    def forward(self, x, sigma=None, class_labels=None, t=None, **model_kwargs):
        """EDM view: x = x0 + sigma * eps  ->  D(x; sigma) = x0 estimate. With `t=` instead of sigma it
        returns the velocity at x_t = x (the training path goes through forward, as DDP requires)."""
        if t is not None:
            return self.velocity(x, t, class_labels, **model_kwargs)
        x = x.to(torch.float32)
        sigma = sigma_column(sigma, x)
        t = sigma / (1 + sigma)
        x_t = x / (1 + sigma)
        return x_t - t * self.velocity(x_t, t.flatten(), class_labels, **model_kwargs)

    def round_sigma(self, sigma):
        return torch.as_tensor(sigma)
