"""Block families beside DiT's attention block (`dit.py` builds every model and holds the registry):
`ssm` (diffusion state-space blocks, "DiS"); `sprint`, the fusion module (mask token, 2C -> C projection) of a
route with `fusion: sprint`. Here: what every block family shares, `modulate` (the adaLN conditioning) and `Mlp`.
TREAD on diffusers transformers is the package `tread_diffusers`."""
import torch.nn as nn

# User code imports `apply_tread` and the adapters' modules from here too (`from backbones import apply_tread`):
# they come from tread_diffusers on first use, so `import dit`, which imports this package, loads none of them.
ADAPTERS = {"apply_tread": "apply_tread", "diffusers_tread": "tread", "diffusers_families": "families",
            "diffusers_image_families": "image_families", "diffusers_video_families": "video_families",
            "diffusers_sequence_families": "sequence_families", "diffusers_masks": "masks"}


def __getattr__(name):
    if name not in ADAPTERS:
        raise AttributeError(f"module 'backbones' has no attribute {name!r}")
    import tread_diffusers

    return getattr(tread_diffusers, ADAPTERS[name])


def modulate(x, shift, scale):
    """adaLN: x * (1 + scale) + shift, per sample (x [B, N, C]; shift, scale [B, C])."""
    return x * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1)


class Mlp(nn.Module):
    """The block's two-layer MLP with tanh GELU, as DiT builds it with timm's `Mlp`: the same parameter names
    (`fc1`, `fc2`) and the same initialisation order, so checkpoints and seeded models match the authors'. Written
    here because importing timm costs every command about two seconds (it loads torchvision's model zoo)."""

    def __init__(self, dim, hidden):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.act = nn.GELU(approximate="tanh")
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))
