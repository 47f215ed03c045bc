"""The training objective named by the `diffuser` config group: the network wrapper and its loss.

Both wrappers are EDM-convention denoisers `net(x, sigma, labels)`, so samplers and guidance wrappers
work unchanged for either objective."""
from edm import EDMLoss, EDMPrecond
from rectified_flow import FlowPrecond, RFLoss
from tread_utils.errors import UserError

# diffuser.name -> (denoiser(model, cfg), loss(cfg))
DIFFUSERS = {
    "edm": (lambda model, d: EDMPrecond(model, sigma_data=d.get("sigma_data", 0.5)),
            lambda d: EDMLoss(P_mean=d.P_mean, P_std=d.P_std, sigma_data=d.sigma_data)),
    "rf": (lambda model, d: FlowPrecond(model),
           lambda d: RFLoss(P_mean=d.P_mean, P_std=d.P_std)),
}


def _entry(diffuser_cfg):
    name = diffuser_cfg.get("name", "edm")
    if name not in DIFFUSERS:
        raise UserError(f"unknown diffuser {name!r}; choose one of {', '.join(DIFFUSERS)} (diffuser=...)")
    return DIFFUSERS[name]


def build_denoiser(diffuser_cfg, model):
    return _entry(diffuser_cfg)[0](model, diffuser_cfg)


def build_loss(diffuser_cfg):
    """`loss_fn(net, images, labels)` -> per-element losses."""
    return _entry(diffuser_cfg)[1](diffuser_cfg)


def build_objective(diffuser_cfg, model):
    return build_denoiser(diffuser_cfg, model), build_loss(diffuser_cfg)
