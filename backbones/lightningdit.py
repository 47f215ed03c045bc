"""LightningDiT's block (Yao et al., 2025, github.com/hustvl/LightningDiT), as its released config builds it:
RMSNorm instead of LayerNorm, axial 2-D rotary position embedding (RoPE) on queries and keys, a SwiGLU MLP and
adaLN-Zero conditioning with shifts; queries and keys RMS-normalised with `qk_norm` (off in their release).
LightningDiT keeps DiT's absolute sine-cosine `pos_embed` as well, and its final layer normalises with RMSNorm:
`final_norm` tells `dit.DiT` to build it so. The embedders are DiT's, and the model is built by `dit.get_model`
with `block_type="lightningdit"` (`LightningDiT-*` in `dit.DiT_models`).

The rotary angles come from the positions the block is called with (`takes_positions`), the (row, column) of each
token on the patch grid: inside a route, the kept tokens' own, so a kept token is rotated as where it sits in the
image, whatever its index among the kept tokens. The parameter names are those of the authors' code (the TREAD
version of LightningDiT, stefan-baumann/LightningDiT_TREAD), so their model loads our weights by name
(lab/lightningdit_parity.py).
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

from backbones import modulate
from tread_utils.attention import attention
from tread_utils.errors import UserError

ROPE_THETA = 10000.0


class RMSNorm(nn.Module):
    """x / rms(x) * weight over the last dimension, normalised in float32 (as LLaMA's, which LightningDiT uses)."""

    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        h = x.float()
        return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


def rope_cos_sin(positions: torch.Tensor, head_dim: int):
    """(cos, sin) [B, 1, N, head_dim] of axial 2-D RoPE at positions [B, N, 2] (row, column): the first half of a
    head turns with the row, the second with the column; inside each half, channels (2i, 2i+1) are one pair
    turning at ROPE_THETA^(-2i / half) (EVA-02's layout, LightningDiT's)."""
    half = head_dim // 2
    freqs = 1.0 / ROPE_THETA ** (torch.arange(0, half, 2, device=positions.device).float() / half)
    freqs = freqs.repeat_interleave(2)  # one frequency per channel of a pair
    angles = torch.cat([positions[..., 0:1].float() * freqs, positions[..., 1:2].float() * freqs], -1)
    return angles.cos().unsqueeze(1), angles.sin().unsqueeze(1)


def rotate_pairs(x: torch.Tensor) -> torch.Tensor:
    """(x0, x1) -> (-x1, x0) for each pair of channels."""
    first, second = x.unflatten(-1, (-1, 2)).unbind(-1)
    return torch.stack((-second, first), -1).flatten(-2)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return x * cos + rotate_pairs(x) * sin


class RotaryAttention(nn.Module):
    """Multi-head self-attention with 2-D RoPE on queries and keys, through tread_utils.attention's selected backend."""

    def __init__(self, dim, num_heads, qk_norm=False):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.qkv = nn.Linear(dim, dim * 3)
        self.q_norm = RMSNorm(self.head_dim) if qk_norm else nn.Identity()
        self.k_norm = RMSNorm(self.head_dim) if qk_norm else nn.Identity()
        self.proj = nn.Linear(dim, dim)

    def forward(self, x, positions):
        B, N, C = x.shape
        q, k, v = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        cos, sin = rope_cos_sin(positions, self.head_dim)
        q, k = apply_rope(self.q_norm(q), cos, sin), apply_rope(self.k_norm(k), cos, sin)
        x = attention(q, k, v)
        return self.proj(x.transpose(1, 2).reshape(B, N, C))


class SwiGLU(nn.Module):
    """w3(silu(a) * b) with [a, b] = w12(x); 2/3 of the MLP width, so its matmuls cost what a GELU MLP's do."""

    def __init__(self, dim, hidden):
        super().__init__()
        self.w12 = nn.Linear(dim, 2 * hidden)
        self.w3 = nn.Linear(hidden, dim)

    def forward(self, x):
        a, b = self.w12(x).chunk(2, dim=-1)
        return self.w3(F.silu(a) * b)


def swiglu_width(hidden_size, mlp_ratio) -> int:
    return int(2 / 3 * int(hidden_size * mlp_ratio))  # LightningDiT's rounding: 170 for width 64, ratio 4


class LightningDiTBlock(nn.Module):
    """adaLN-Zero block: RMSNorm, rotary attention, RMSNorm, SwiGLU; `block(x, c, positions) -> x`."""
    takes_positions = True
    final_norm = RMSNorm  # dit.DiT's final layer normalises with this instead of LayerNorm

    def __init__(self, hidden_size, num_heads, mlp_ratio=4.0, qk_norm=False):
        super().__init__()
        head_dim = hidden_size // num_heads
        if head_dim * num_heads != hidden_size or head_dim % 4:
            raise UserError(f"a LightningDiT block needs a head width (hidden_size / num_heads) that is a multiple "
                            f"of 4 (2-D RoPE turns pairs of channels on each of two axes), got hidden_size "
                            f"{hidden_size} with {num_heads} heads; change model.params.num_heads")
        self.norm1 = RMSNorm(hidden_size)
        self.attn = RotaryAttention(hidden_size, num_heads, qk_norm=qk_norm)
        self.norm2 = RMSNorm(hidden_size)
        self.mlp = SwiGLU(hidden_size, swiglu_width(hidden_size, mlp_ratio))
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden_size, 6 * hidden_size))

    def forward(self, x, c, positions):
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.adaLN_modulation(c).chunk(6, dim=1)
        x = x + gate_msa.unsqueeze(1) * self.attn(modulate(self.norm1(x), shift_msa, scale_msa), positions)
        return x + gate_mlp.unsqueeze(1) * self.mlp(modulate(self.norm2(x), shift_mlp, scale_mlp))

    @staticmethod
    def forward_flops(hidden_size, mlp_ratio, n) -> int:
        """Forward FLOPs of one block over n tokens, one sample: its matmuls (qkv, attention, projection, SwiGLU's
        two, adaLN); the norms and rotations are elementwise, as torch's FLOP counter counts them (not at all)."""
        D, H = hidden_size, swiglu_width(hidden_size, mlp_ratio)
        return 2 * n * D * 3 * D + 2 * 2 * n * n * D + 2 * n * D * D + 2 * n * D * 3 * H + 2 * D * 6 * D
