"""A second, non-attention backbone: diffusion state-space blocks ("DiS"), to show that TREAD's router
is architecture-agnostic (the paper reports Mamba and RWKV rows; its public code has none).

Each block mixes tokens with a bidirectional diagonal linear state-space model (S4D-style, real
negative eigenvalues, zero-order-hold discretisation) instead of attention. The SSM is applied in
its convolution form, K[d, l] = dt_d * sum_s C[d, s] exp(dt_d A[d, s])^l, as a Toeplitz matrix
product: any sequence length works (routed blocks see fewer tokens), and the FLOPs are counted by
torch.utils.flop_counter. Conditioning is adaLN-Zero as in DiT, so the embedders and the final layer
are DiT's and the model is built by `dit.get_model` with `block_type="ssm"`.
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from backbones import Mlp, modulate


class BidirectionalSSM(nn.Module):
    def __init__(self, dim, state_size=16, dt_min=1e-3, dt_max=1e-1):
        super().__init__()
        log_dt = torch.rand(dim) * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min)
        self.log_dt = nn.Parameter(log_dt)
        self.log_neg_A = nn.Parameter(torch.log(torch.arange(1, state_size + 1).float()).repeat(dim, 1))
        self.C = nn.Parameter(torch.randn(2, dim, state_size) * state_size ** -0.5)  # forward, backward
        self.D = nn.Parameter(torch.ones(dim))

    def kernels(self, length):
        """Causal kernels [2, dim, length] for the forward and the backward scan."""
        dt = self.log_dt.exp()[:, None]                                   # [D, 1]
        log_decay = -dt * self.log_neg_A.exp()                            # [D, S], log of exp(dt A)
        steps = torch.arange(length, device=dt.device, dtype=dt.dtype)
        powers = torch.exp(log_decay[:, :, None] * steps)                 # [D, S, L]
        return dt * torch.einsum("kds,dsl->kdl", self.C, powers)

    def forward(self, u):
        """u [B, N, D] -> [B, N, D]."""
        n = u.shape[1]
        k = self.kernels(n).to(u.dtype)
        lag = torch.arange(n, device=u.device)
        diff = lag[:, None] - lag[None, :]                                # n - m
        fwd = k[0][:, diff.clamp(min=0)] * (diff >= 0)                    # [D, N, M], causal part
        bwd = k[1][:, (-diff).clamp(min=0)] * (diff < 0)                  # anti-causal part
        toeplitz = fwd + bwd
        return torch.einsum("bmd,dnm->bnd", u, toeplitz) + u * self.D


class SSMBlock(nn.Module):
    """adaLN-Zero block: gated bidirectional SSM token mixer, then an MLP; `block(x, c) -> x` like DiT's."""

    def __init__(self, hidden_size, num_heads=None, mlp_ratio=4.0, qk_norm=False, state_size=16):
        super().__init__()  # num_heads / qk_norm: accepted for a DiT-compatible signature, unused
        self.norm1 = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.in_proj = nn.Linear(hidden_size, 2 * hidden_size)
        self.ssm = BidirectionalSSM(hidden_size, state_size)
        self.out_proj = nn.Linear(hidden_size, hidden_size)
        self.norm2 = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.mlp = Mlp(hidden_size, int(hidden_size * mlp_ratio))
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden_size, 6 * hidden_size))

    def forward(self, x, c):
        shift1, scale1, gate1, shift2, scale2, gate2 = self.adaLN_modulation(c).chunk(6, dim=1)
        h = modulate(self.norm1(x), shift1, scale1)
        u, z = self.in_proj(h).chunk(2, dim=-1)
        x = x + gate1.unsqueeze(1) * self.out_proj(self.ssm(u) * F.silu(z))
        h = modulate(self.norm2(x), shift2, scale2)
        return x + gate2.unsqueeze(1) * self.mlp(h)
