"""SPRINT fusion for a route (Park et al., ICLR 2026; snap-research/Sprint, `src/models/sit.py`).

A route with `fusion: sprint` is SPRINT's sparse deep path: the blocks before it are the dense encoder,
its blocks see the kept tokens only, and at its end the deep output is restored to the full sequence with
a mask token at every dropped position, concatenated with the route's input (the dense shallow features
of all tokens) and projected back to the width by a Linear 2C -> C (their `concat_linear` residual).
During training a fraction `path_drop_prob` of the samples has its whole deep output replaced by mask
tokens (their `cfg_mask_prob`), which trains path-drop guidance: a weak branch that skips the deep blocks.

Their defaults, each a switch: the mask token starts normal(std 0.02) and is frozen
(`mask_token_trainable: false`, `mask_token_init: normal`); the projection starts xavier-uniform with a
zero bias (`fusion_init: xavier`; `deep` starts it as [I | 0], the restored deep output alone).
"""
from typing import Optional

import torch
import torch.nn as nn

from routing_module import Restore


class SprintFusion(nn.Module):
    """The mask token and the 2C -> C projection of one route; the model calls it where the route ends."""
    drops_deep_path = True  # path-drop guidance's weak branch: mask tokens in place of the route's blocks

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
        """Called by the model's initialize_weights too, after its blanket xavier pass over every Linear."""
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
        """x_deep [B, K, C] at positions keep_idx [B, K] (None: all N tokens); x_shallow [B, N, C], the route's
        input. `drop_all`: the deep path was not run (path-drop guidance's weak branch), mask tokens only."""
        B, N, C = x_shallow.shape
        dtype = x_shallow.dtype if x_deep is None else x_deep.dtype
        mask = self.mask_token.to(dtype).expand(B, N, C)
        if drop_all:
            deep = mask
        elif keep_idx is None:
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


SPRINT = Restore(build=lambda hidden_size, route: SprintFusion(hidden_size, route.path_drop_prob,
                                                               route.mask_token_trainable, route.mask_token_init,
                                                               route.fusion_init),
                 flops=sprint_flops)
