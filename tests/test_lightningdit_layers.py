"""LightningDiT's RMSNorm and SwiGLU against their definitions in the authors' code (hustvl/LightningDiT, models/
lightningdit.py and models/swiglu_ffn.py), written out here so that CI checks them without a checkout of it (the
whole-model parity test, tests/test_lightningdit_parity.py, needs one)."""
import torch
import torch.nn.functional as F

from backbones.lightningdit import LightningDiTBlock, RMSNorm, SwiGLU


def their_rms_norm(x, weight, eps=1e-6):
    """RMSNorm.forward: `self._norm(x.float()).type_as(x) * self.weight`, _norm = x * rsqrt(mean(x^2) + eps)."""
    h = x.float()
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).type_as(x) * weight


def their_swiglu(x, w12, w3):
    """SwiGLUFFN.forward: x1, x2 = w12(x).chunk(2, dim=-1); w3(silu(x1) * x2)."""
    x1, x2 = w12(x).chunk(2, dim=-1)
    return w3(F.silu(x1) * x2)


def test_rms_norm_is_theirs_weight_and_eps_included():
    torch.manual_seed(0)
    norm = RMSNorm(8)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(8))
    # small inputs: a mean square of ~1e-6 puts eps (theirs 1e-6) in the result; an eps of 1e-5 moves it by ~2x
    for scale in (1.0, 1e-3):
        x = torch.randn(2, 5, 8) * scale
        torch.testing.assert_close(norm(x), their_rms_norm(x, norm.weight), rtol=1e-6, atol=0)
    x = torch.randn(2, 5, 8, dtype=torch.bfloat16)
    torch.testing.assert_close(norm(x), their_rms_norm(x, norm.weight))  # normalised in float32, then cast back


def test_swiglu_is_theirs_gate_then_value():
    torch.manual_seed(0)
    mlp = SwiGLU(8, 12)
    x = torch.randn(2, 5, 8)
    torch.testing.assert_close(mlp(x), their_swiglu(x, mlp.w12, mlp.w3), rtol=1e-6, atol=1e-7)
    x1, x2 = mlp.w12(x).chunk(2, dim=-1)  # the gate's half and the value's half do not commute
    assert not torch.allclose(mlp(x), mlp.w3(F.silu(x2) * x1))


def test_the_block_uses_their_norms():
    block = LightningDiTBlock(32, 2)
    assert all(isinstance(n, RMSNorm) and n.eps == 1e-6 for n in (block.norm1, block.norm2))
