"""Rectified-flow loss: t = sigmoid(n), n ~ N(P_mean, P_std^2) (logit-normal), x_t = (1 - t) x0 + t eps,
loss = ||v(x_t, t) - (eps - x0)||^2."""
import torch


class RFLoss:
    def __init__(self, P_mean: float = 0.0, P_std: float = 1.0):
        self.P_mean, self.P_std = float(P_mean), float(P_std)

    def __call__(self, net, images, labels=None, **model_kwargs):
        """Per-element squared error, shape of `images`; `net` is a FlowPrecond (or wraps one)."""
        t = torch.sigmoid(torch.randn(images.shape[0], device=images.device) * self.P_std + self.P_mean)
        noise = torch.randn_like(images)
        t4 = t.view(-1, 1, 1, 1)
        x_t = (1 - t4) * images + t4 * noise
        return (net(x_t, None, labels, t=t, **model_kwargs) - (noise - images)) ** 2
