"""A block that takes positions (RoPE) registered from outside the model file: `dit.BLOCK_TYPES` and a class
attribute are all it needs. Inside a route each kept token carries its own grid position, so its rotary angles
are those of where it sits in the image, not of its index among the kept tokens."""
import pytest
import torch
import torch.nn as nn

import dit
import routing_module
from backbones import modulate

GRID = 4  # input 8, patch 2: a 4 x 4 grid of tokens


def rotate(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Axial 2-D RoPE of x [B, H, N, d] at positions [B, N, 2]: the first half of each head by the row, the second
    by the column, each half rotated in pairs at frequencies 100^(-2i / (d / 2))."""
    half = x.shape[-1] // 2
    freqs = 100.0 ** (-torch.arange(0, half, 2, dtype=torch.float32) / half)
    out = []
    for axis, part in enumerate(x.split(half, -1)):
        angle = positions[..., axis, None] * freqs  # [B, N, half / 2]
        cos, sin = angle.cos()[:, None], angle.sin()[:, None]
        even, odd = part[..., 0::2], part[..., 1::2]
        out.append(torch.stack([even * cos - odd * sin, even * sin + odd * cos], -1).flatten(-2))
    return torch.cat(out, -1)


class RopeBlock(dit.DiTBlock):
    """DiT's block with 2-D RoPE on queries and keys; it records the positions it was called with."""
    takes_positions = True
    seen: list = []

    def forward(self, x, c, positions):
        RopeBlock.seen.append(positions)
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.adaLN_modulation(c).chunk(6, dim=1)
        h = modulate(self.norm1(x), shift_msa, scale_msa)
        B, N, C = h.shape
        heads = self.attn.num_heads
        q, k, v = self.attn.qkv(h).reshape(B, N, 3, heads, C // heads).permute(2, 0, 3, 1, 4)
        a = nn.functional.scaled_dot_product_attention(rotate(q, positions), rotate(k, positions), v)
        x = x + gate_msa.unsqueeze(1) * self.attn.proj(a.transpose(1, 2).reshape(B, N, C))
        return x + gate_mlp.unsqueeze(1) * self.mlp(modulate(self.norm2(x), shift_mlp, scale_mlp))


@pytest.fixture
def rope_model(monkeypatch):
    monkeypatch.setitem(dit.BLOCK_TYPES, "rope2d", RopeBlock)
    RopeBlock.seen = []
    torch.manual_seed(0)
    return dit.get_model("DiT-S/2", {"input_size": 8, "depth": 4, "hidden_size": 32, "num_heads": 2,
                                     "num_classes": 10, "enable_routing": True, "block_type": "rope2d",
                                     "routes": [{"selection_ratio": 0.5, "start_layer_idx": 1, "end_layer_idx": 2}]})


def test_kept_tokens_carry_their_own_positions_through_a_route(rope_model, monkeypatch):
    kept = []
    select = routing_module.select_kept_tokens
    monkeypatch.setattr(routing_module, "select_kept_tokens", lambda *a, **k: kept.append(select(*a, **k)) or kept[-1])
    x, t, y = torch.randn(3, 4, 8, 8), torch.rand(3), torch.randint(0, 10, (3,))
    rope_model.train()
    out = rope_model(x, t, y)
    keep, = kept
    rows, columns = keep // GRID, keep % GRID  # by hand: where each kept token sits on the grid
    by_hand = torch.stack([rows, columns], -1).float()
    everywhere = torch.tensor([[r, c] for r in range(GRID) for c in range(GRID)]).float().expand(3, -1, -1)
    assert [p.shape[1] for p in RopeBlock.seen] == [16, 8, 8, 16]
    assert torch.equal(RopeBlock.seen[0], everywhere) and torch.equal(RopeBlock.seen[3], everywhere)
    assert torch.equal(RopeBlock.seen[1], by_hand) and torch.equal(RopeBlock.seen[2], by_hand)
    assert not torch.equal(by_hand, everywhere[:, :8])  # a random half: not the first 8 positions
    out.square().mean().backward()  # trains routed: every block's weights get a gradient
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in rope_model.blocks.parameters()
               if p.requires_grad and p.dim() > 1)


def test_positions_reach_a_checkpointed_block_and_the_unrouted_model(rope_model):
    rope_model.grad_checkpointing = True
    rope_model.eval()
    with torch.no_grad():
        rope_model(torch.randn(2, 4, 8, 8), torch.rand(2), torch.randint(0, 10, (2,)))
    assert [p.shape for p in RopeBlock.seen] == [torch.Size([2, 16, 2])] * 4  # no route at evaluation
    RopeBlock.seen = []
    rope_model.train()
    rope_model(torch.randn(2, 4, 8, 8), torch.rand(2), torch.randint(0, 10, (2,))).mean().backward()
    assert [p.shape[1] for p in RopeBlock.seen] == [16, 8, 8, 16] * 2  # forward, then recomputed in backward
    assert "grid_positions" not in rope_model.state_dict()  # computed, not stored: checkpoints are unchanged
