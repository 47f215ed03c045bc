"""SPRINT fusion for a route (Park et al., ICLR 2026; snap-research/Sprint, `src/models/sit.py`).

A route with `fusion: sprint` (docs/extensions.md, "SPRINT fusion") is SPRINT's sparse deep path: the blocks before it are the dense encoder,
its blocks see the kept tokens only, and at its end the deep output is restored to the full sequence with
a mask token at every dropped position, concatenated with the route's input (the dense shallow features
of all tokens) and projected back to the width by a Linear 2C -> C (their `concat_linear` residual).
During training a fraction `path_drop_prob` of the samples has its whole deep output replaced by mask
tokens (their `cfg_mask_prob`), which trains path-drop guidance: a weak branch that skips the deep blocks.

Their defaults, each a switch (the route's `fusion_options`, `build_sprint`'s keyword options): the mask token
starts normal(std 0.02) and is frozen (`mask_token_trainable: false`, `mask_token_init: normal`); the projection
starts xavier-uniform with a zero bias (`fusion_init: xavier`; `deep` starts it as [I | 0], the restored deep
output alone).
"""
from typing import Annotated, Literal, Optional

import torch
import torch.nn as nn

from routing_module import Fusion


class SprintFusion(nn.Module):
    """The mask token and the 2C -> C projection of one route; the model calls it where the route ends."""
    def __init__(self, hidden_size: int, path_drop_prob: float = 0.1, mask_token_trainable: bool = False,
                 mask_token_init: str = "normal", fusion_init: str = "xavier"):
        super().__init__()
        self.mask_token = nn.Parameter(torch.zeros(hidden_size), requires_grad=mask_token_trainable)
        self.proj = nn.Linear(2 * hidden_size, hidden_size)
        self.path_drop_prob = path_drop_prob
        self.mask_token_init, self.fusion_init = mask_token_init, fusion_init
        self.reset_parameters()

    def extra_repr(self):
        return f"path_drop_prob={self.path_drop_prob}, mask_token_init={self.mask_token_init}, " \
               f"fusion_init={self.fusion_init}"

    def reset_parameters(self):
        """SPRINT's initialisation (the model's blanket init leaves a fusion's parameters alone)."""
        with torch.no_grad():
            if self.mask_token_init == "normal":
                nn.init.normal_(self.mask_token, std=0.02)
            else:
                nn.init.zeros_(self.mask_token)
            nn.init.zeros_(self.proj.bias)
            if self.fusion_init == "xavier":
                nn.init.xavier_uniform_(self.proj.weight)
            else:
                C = self.proj.out_features
                self.proj.weight.zero_()
                self.proj.weight[:, :C].copy_(torch.eye(C))

    def forward(self, x_deep: Optional[torch.Tensor], x_shallow: torch.Tensor, keep_idx: Optional[torch.Tensor],
                drop_all: bool = False) -> torch.Tensor:
        """x_deep [B, K, C] at positions keep_idx [B, K] (K = N when no token was dropped); x_shallow [B, N, C], the
        route's input. `drop_all`: the deep path was not run (path-drop guidance's weak branch), mask tokens only."""
        B, N, C = x_shallow.shape
        dtype = x_shallow.dtype if x_deep is None else x_deep.dtype
        mask = self.mask_token.to(dtype).expand(B, N, C)
        if drop_all:
            deep = mask
        elif keep_idx.shape[1] == N:  # every token went through the route, in order
            deep = x_deep
        else:
            deep = mask.scatter(1, keep_idx.unsqueeze(-1).expand(-1, -1, C), x_deep)
        if self.training and self.path_drop_prob > 0 and not drop_all:
            dropped = torch.rand(B, 1, 1, device=deep.device) < self.path_drop_prob
            deep = torch.where(dropped, mask, deep)
        return self.proj(torch.cat([deep, x_shallow.to(dtype)], dim=-1))


def sprint_flops(hidden_size: int, num_tokens: int) -> int:
    """The 2C -> C projection's forward FLOPs per sample (the mask token's scatter counts none)."""
    return 2 * num_tokens * 2 * hidden_size * hidden_size


def build_sprint(hidden_size: int, route, *, path_drop_prob: Annotated[float, "[0, 1)"] = 0.1,
                 mask_token_trainable: bool = False, mask_token_init: Literal["normal", "zeros"] = "normal",
                 fusion_init: Literal["xavier", "deep"] = "xavier") -> SprintFusion:
    """SPRINT's sparse deep path: mask tokens where tokens were dropped, [deep, route input] projected 2C -> C;
    path drop in training makes path-drop guidance's weak branch.

    path_drop_prob: training samples whose deep output is all mask tokens (their cfg_mask_prob);
    mask_token_trainable: train the mask token (theirs is frozen); mask_token_init: normal (std 0.02, theirs) or
    zeros; fusion_init: the 2C -> C projection's start, xavier (theirs) or deep ([I | 0])."""
    return SprintFusion(hidden_size, path_drop_prob, mask_token_trainable, mask_token_init, fusion_init)


SPRINT = Fusion(build=build_sprint, flops=sprint_flops, drops_deep_path=True)
