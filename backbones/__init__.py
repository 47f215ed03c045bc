"""Block families beside DiT's attention block (`dit.py` builds every model and holds the registry):
`ssm` (diffusion state-space blocks, "DiS"); `sprint`, the fusion module (mask token, 2C -> C projection) of a
route with `fusion: sprint`; `diffusers_tread`, TREAD routes on diffusers transformers
(`from backbones import apply_tread`). Here: `modulate`, the adaLN conditioning every block family shares."""
from backbones.diffusers_tread import apply_tread  # noqa: F401


def modulate(x, shift, scale):
    """adaLN: x * (1 + scale) + shift, per sample (x [B, N, C]; shift, scale [B, C])."""
    return x * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1)
