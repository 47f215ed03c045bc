"""EDM training loss (Karras et al. 2022, Section 5): ln(sigma) ~ N(P_mean, P_std^2),
weight(sigma) = (sigma^2 + sigma_data^2) / (sigma * sigma_data)^2, loss = weight * ||D(y + n; sigma) - y||^2."""
import torch


class EDMLoss:
    def __init__(self, P_mean: float = -1.2, P_std: float = 1.2, sigma_data: float = 0.5):
        self.P_mean = float(P_mean)
        self.P_std = float(P_std)
        self.sigma_data = float(sigma_data)

    def __call__(self, net, images, labels=None, **model_kwargs):
        """Per-element weighted squared error, shape of `images`; the caller reduces it."""
        rnd_normal = torch.randn([images.shape[0], 1, 1, 1], device=images.device)
        sigma = (rnd_normal * self.P_std + self.P_mean).exp()
        weight = (sigma ** 2 + self.sigma_data ** 2) / (sigma * self.sigma_data) ** 2
        noise = torch.randn_like(images) * sigma
        denoised = net(images + noise, sigma.flatten(), labels, **model_kwargs)
        return weight * (denoised - images) ** 2
