"""Which block runs outside autocast: the one right after a route that dropped tokens (it sees tokens from two
depths at once), and no other. A SPRINT route in eval mode runs at ratio 0 (its fusion still applies, nothing is
dropped): the block after it follows autocast like the rest."""
import torch

from test_sprint import sprint_model


def block_dtypes(model):
    """Each block's qkv output dtype in one forward under CPU autocast (bfloat16)."""
    dtypes = {}
    for i, block in enumerate(model.blocks):
        block.attn.qkv.register_forward_hook(lambda m, a, out, i=i: dtypes.__setitem__(i, out.dtype))
    g = torch.Generator().manual_seed(1)
    x, t, y = torch.randn(3, 1, 16, 16, generator=g), torch.rand(3, generator=g), torch.randint(0, 10, (3,), generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(x, t, y)
    return dtypes


def test_after_a_sprint_route_in_training_the_next_block_is_float32():
    dtypes = block_dtypes(sprint_model().train())  # the route 2 -> 3 at 0.75 drops tokens
    assert dtypes[4] == torch.float32 and {dtypes[i] for i in (0, 1, 2, 3, 5)} == {torch.bfloat16}


def test_after_a_sprint_route_in_eval_mode_every_block_follows_autocast():
    model = sprint_model().eval()
    fused = []
    model.fusions["0"].proj.register_forward_hook(lambda m, a, out: fused.append(out.shape))
    dtypes = block_dtypes(model)
    assert fused, "the fusion runs in eval mode (ratio 0)"
    assert set(dtypes.values()) == {torch.bfloat16}, dtypes
