"""The training objective named by the `diffuser` config group: the network wrapper and its loss."""
from errors import UserError


def build_objective(diffuser_cfg, model):
    """(net, loss_fn): `net(x, sigma, labels)` is an EDM-convention denoiser in both cases, so samplers
    and guidance wrappers work unchanged; `loss_fn(net, images, labels)` returns per-element losses."""
    name = diffuser_cfg.name
    if name == "edm":
        from edm import EDMLoss, EDMPrecond

        d = diffuser_cfg
        return (EDMPrecond(model, sigma_data=d.sigma_data),
                EDMLoss(P_mean=d.P_mean, P_std=d.P_std, sigma_data=d.sigma_data))
    if name == "rf":
        from flow import FlowPrecond, RFLoss

        return FlowPrecond(model), RFLoss(P_mean=diffuser_cfg.P_mean, P_std=diffuser_cfg.P_std)
    raise UserError(f"unknown diffuser {name!r}; use diffuser=edm or diffuser=rf")
