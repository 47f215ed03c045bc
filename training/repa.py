"""REPA, representation alignment (Yu et al., ICLR 2025; sihyun-yu/REPA), on routed tokens.

total loss = diffusion loss + weight * mean over tokens of -cos(projector(h), teacher features of the clean image)

* h: the hidden tokens after block `repa.block` (0-based; REPA's `encoder_depth` d is block d - 1);
* projector: REPA's MLP, Linear(hidden, projector_dim) - SiLU - Linear(projector_dim, projector_dim) - SiLU -
  Linear(projector_dim, teacher dim), projector_dim 2048 as theirs, xavier-uniform weights and zero biases
  (their model's init applies to it);
* teacher: frozen, eval mode, no gradient, run on the clean input: the training image itself on the digits,
  the image stored beside the latents on shards (`extract_latents --images`), computed online
  (`training/repa_teachers.py`; the storage against the compute: `python -m lab.repa_cost`). If its patch
  grid differs from the DiT token grid, its features are resized to the token grid (bilinear, antialiased when
  shrinking);
* under routing: if the block lies inside a route (start <= block <= end; routes here include their end
  block, whose output still holds the kept tokens only), the projector sees the routed tokens and each is
  compared with the teacher's feature at its position; the dropped tokens do not count (as PRX does).

The projector trains with the model (same optimizer, saved in the checkpoint under `repa`) but is not part of
the backbone: sampling never uses it, so the EMA (the sampling weights) leaves it out, and checkpoints with
and without REPA have the same model and EMA entries. It lives in `RepaNet`, the module accelerate prepares,
so DDP all-reduces its gradients with the backbone's.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

from training.repa_teachers import build_teacher
from tread_utils.errors import UserError


class Tap:
    """Filled during one forward pass: the model's block loop calls it after block `block` with the tokens
    [B, K, C] and their positions [B, K] (None: all tokens); then `projected`, the projector's output. A plain
    object, so DDP passes it through."""

    def __init__(self, block: int):
        self.block = block
        self.hidden = self.keep_idx = self.projected = None

    def __call__(self, hidden: torch.Tensor, keep_idx):
        self.hidden, self.keep_idx = hidden, keep_idx


def build_projector(hidden_size: int, projector_dim: int, teacher_dim: int) -> nn.Sequential:
    projector = nn.Sequential(nn.Linear(hidden_size, projector_dim), nn.SiLU(),
                              nn.Linear(projector_dim, projector_dim), nn.SiLU(),
                              nn.Linear(projector_dim, teacher_dim))
    for layer in projector:
        if isinstance(layer, nn.Linear):
            nn.init.xavier_uniform_(layer.weight)
            nn.init.zeros_(layer.bias)
    return projector


def projector_training_flops(hidden_size: int, projector_dim: int, teacher_dim: int, tokens: int) -> int:
    """Forward + backward FLOPs of the projector over `tokens` tokens: backward costs twice the forward (the
    weight gradient and the gradient into the block's tokens)."""
    macs = hidden_size * projector_dim + projector_dim * projector_dim + projector_dim * teacher_dim
    return 3 * 2 * tokens * macs


def to_token_grid(features: torch.Tensor, grid, token_grid) -> torch.Tensor:
    """Teacher features [B, h*w, D] on `grid` resized to `token_grid` (REPA resizes the image instead where it
    can; a grid that still differs, e.g. DINOv2's 16 x 16 against DiT-*/4's 8 x 8, is resized here)."""
    grid, token_grid = tuple(grid), tuple(token_grid)
    if grid == token_grid:
        return features
    B, _, D = features.shape
    x = features.transpose(1, 2).reshape(B, D, *grid)
    x = F.interpolate(x, size=token_grid, mode="bilinear", align_corners=False, antialias=token_grid[0] < grid[0])
    return x.flatten(2).transpose(1, 2)


def alignment_loss(projected: torch.Tensor, target: torch.Tensor, keep_idx=None) -> torch.Tensor:
    """Per sample [B]: the mean over the projected tokens of -cos(projected, target at their positions).
    projected [B, K, D]; target [B, N, D] on the token grid; keep_idx [B, K] or None (K = N)."""
    if keep_idx is not None:
        target = torch.gather(target, 1, keep_idx.unsqueeze(-1).expand(-1, -1, target.shape[-1]))
    cos = (F.normalize(projected.float(), dim=-1) * F.normalize(target.float(), dim=-1)).sum(-1)
    return -cos.mean(1)


class RepaNet(nn.Module):
    """The denoiser plus REPA's projector: one module for accelerate/DDP. Without a tap it is the denoiser."""

    def __init__(self, net: nn.Module, projector: nn.Module):
        super().__init__()
        self.net, self.projector = net, projector

    def forward(self, *args, repa_tap=None, **kwargs):
        if repa_tap is None:
            return self.net(*args, **kwargs)
        out = self.net(*args, repa_tap=repa_tap, **kwargs)
        repa_tap.projected = self.projector(repa_tap.hidden)
        return out


class RepaLoss:
    """The diffusion loss plus the weighted alignment term, per element (the caller's `.mean()` gives
    mean diffusion loss + weight * mean alignment). `last`: the newest call's alignment term, detached."""

    def __init__(self, base, teacher: nn.Module, weight: float, block: int, token_grid):
        self.base, self.teacher, self.weight, self.block = base, teacher, float(weight), int(block)
        self.token_grid = tuple(token_grid)
        self.last = None

    def target(self, images: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            features, grid = self.teacher(images)
            return to_token_grid(features, grid, self.token_grid)

    def __call__(self, net, images, labels=None, teacher_images=None, **kwargs):
        """`teacher_images`: the clean images in [-1, 1] when `images` are latents (None: `images` themselves)."""
        tap = Tap(self.block)
        loss = self.base(net, images, labels, repa_tap=tap, **kwargs)
        if tap.projected is None:
            raise RuntimeError(f"REPA: block {self.block} was not reached; is the network a RepaNet?")
        clean = images if teacher_images is None else teacher_images
        align = alignment_loss(tap.projected, self.target(clean), tap.keep_idx)
        self.last = align.detach().mean()
        return loss + self.weight * align.view(-1, *[1] * (loss.dim() - 1)).to(loss.dtype)


def build_repa(repa_cfg, model: nn.Module, net: nn.Module, loss_fn, load_teacher: bool = True):
    """(net, loss_fn, projector): unchanged with (net, loss_fn, None) when repa.enabled is false."""
    if not repa_cfg.enabled:
        return net, loss_fn, None
    assert 0 <= repa_cfg.block < len(model.blocks), "repa.block (training.config_check.check_repa)"
    teacher = build_teacher(repa_cfg.encoder, repa_cfg.get("encoder_weights"), load=load_teacher)
    hidden = model.pos_embed.shape[-1]
    projector = build_projector(hidden, repa_cfg.projector_dim, teacher.dim)
    grid = tuple(model.x_embedder.grid_size)
    return RepaNet(net, projector), RepaLoss(loss_fn, teacher, repa_cfg.weight, repa_cfg.block, grid), projector


def fit_optimizer_state(saved: dict, optimizer, n_model: int, saved_has_repa: bool) -> dict:
    """An optimizer state saved with or without REPA's projector made to fit this run's optimizer (one group:
    the model's parameters, then the projector's): turning REPA on adds fresh projector entries, turning it off
    drops them. Otherwise the state is returned as it is."""
    group = optimizer.state_dict()["param_groups"][0]
    now_has_repa = len(group["params"]) > n_model
    if saved_has_repa == now_has_repa or len(saved["param_groups"]) != 1:
        return saved
    saved_group = dict(saved["param_groups"][0])
    saved_group["params"] = list(group["params"])
    state = {k: v for k, v in saved["state"].items() if int(k) < n_model}
    return {"state": state, "param_groups": [saved_group]}


def load_projector(projector, state: dict, source, is_main: bool = True):
    """REPA's projector from a checkpoint (resume or init_from). A checkpoint written without REPA leaves it
    fresh (REPA turned on for a run that trained without it); one of another shape is refused in one line."""
    if projector is None:
        return
    if "repa" not in state:
        if is_main:
            print(f"note: {source} holds no REPA projector (written without repa.enabled); it starts fresh")
        return
    own = projector.state_dict()
    saved = state["repa"]
    if set(saved) != set(own) or any(saved[k].shape != own[k].shape for k in own):
        shapes = {k: tuple(v.shape) for k, v in saved.items()}
        raise UserError(f"checkpoint {source} has a REPA projector of another shape ({shapes}); keep the run's "
                        f"repa.projector_dim and repa.encoder, or use another run_name")
    projector.load_state_dict(saved)
