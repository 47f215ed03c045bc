"""The training objective named by the `diffuser` config group: the network wrapper and its loss.

Both wrappers are EDM-convention denoisers `net(x, sigma, labels)`, so samplers and guidance wrappers
work unchanged for either objective."""
from errors import UserError

DIFFUSERS = ("edm", "rf")


def _name(diffuser_cfg) -> str:
    name = diffuser_cfg.get("name", "edm")
    if name not in DIFFUSERS:
        raise UserError(f"unknown diffuser {name!r}; use diffuser=edm or diffuser=rf")
    return name


def build_denoiser(diffuser_cfg, model):
    if _name(diffuser_cfg) == "edm":
        from edm import EDMPrecond

        return EDMPrecond(model, sigma_data=diffuser_cfg.get("sigma_data", 0.5))
    from flow import FlowPrecond

    return FlowPrecond(model)


def build_loss(diffuser_cfg):
    """`loss_fn(net, images, labels)` -> per-element losses."""
    d = diffuser_cfg
    if _name(d) == "edm":
        from edm import EDMLoss

        return EDMLoss(P_mean=d.P_mean, P_std=d.P_std, sigma_data=d.sigma_data)
    from flow import RFLoss

    return RFLoss(P_mean=d.P_mean, P_std=d.P_std)


def build_objective(diffuser_cfg, model):
    return build_denoiser(diffuser_cfg, model), build_loss(diffuser_cfg)
