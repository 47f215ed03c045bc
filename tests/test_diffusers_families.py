"""The family registry (tread_diffusers.families.FAMILIES) and the family checks' tiny models (tests/diffusers_tiny*.py):
every family has a tiny model and a row in each of docs/diffusers.md's family tables, and a family registered from a
test file alone (a transformer class defined here, its `Family` and its `Tiny` entry) is routed as the hand-built
reference says and benched."""
import math
import re
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

pytest.importorskip("diffusers")
from diffusers import ConfigMixin, ModelMixin  # noqa: E402
from diffusers.configuration_utils import register_to_config  # noqa: E402
from diffusers.loaders import PeftAdapterMixin  # noqa: E402

import test_diffusers_tread as shared  # noqa: E402
import test_diffusers_versions as versions  # noqa: E402
from diffusers_tiny import TINY, B, build, one_per_family  # noqa: E402
from diffusers_tiny_entry import Tiny, per_sample  # noqa: E402
from lab import bench_diffusers  # noqa: E402
from tread_diffusers import apply_tread  # noqa: E402
from tread_diffusers.families import FAMILIES, Example, Family, family_of, latent_grid  # noqa: E402
from tread_diffusers.image_families import image_latents  # noqa: E402
from tread_utils.errors import UserError  # noqa: E402

DOCS = Path(__file__).resolve().parent.parent / "docs" / "diffusers.md"


def test_every_family_has_a_tiny_model_of_its_class():
    assert {tiny.family for tiny in TINY.values()} == set(FAMILIES), "a family without a tiny model, or one unknown"
    for name in one_per_family(TINY):
        model, _, _ = build(name)
        assert type(model).__name__ == TINY[name].family and family_of(model) is FAMILIES[TINY[name].family], name


def test_the_docs_tables_have_a_row_per_family():
    """docs/diffusers.md's routing rules name every class of FAMILIES, its table of masks every family's name."""
    docs = DOCS.read_text()
    rules = docs.split("## Routing rules per family\n\n")[1].split("\n\n")[1]  # the table after the lead
    assert sorted(re.findall(r"^\| `(\w+)`", rules, re.MULTILINE)) == sorted(FAMILIES)
    masks = docs.split("## Masks, attention masks, reference tokens and the kept count, per family\n\n")[1]
    rows = re.findall(r"^\| ([^|]+?) \|", masks.split("\n\n")[0], re.MULTILINE)[1:]  # after the header
    assert sorted(rows) == sorted(family.name for family in FAMILIES.values())


# -- a family registered from this file alone --------------------------------------------------------------------
def rotate(x, cos, sin):
    """Rotary embedding, rotate-half form; cos, sin [N, head_dim] shared by the batch or [B, N, head_dim] per sample."""
    cos, sin = (t[:, None] if t.ndim == 3 else t for t in (cos, sin))
    x1, x2 = x.chunk(2, -1)
    return x * cos + torch.cat([-x2, x1], -1) * sin


def rope_table(rows, columns, head_dim):
    """(cos, sin) [rows * columns, head_dim]: half the angles from each token's row, half from its column."""
    freqs = 1.0 / 100 ** (torch.arange(head_dim // 4) / (head_dim // 4))
    r, c = torch.meshgrid(torch.arange(rows), torch.arange(columns), indexing="ij")
    angles = torch.cat([r.flatten()[:, None] * freqs, c.flatten()[:, None] * freqs], -1)
    angles = torch.cat([angles, angles], -1)
    return angles.cos(), angles.sin()


class RopeAttention(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.to_q, self.to_k, self.to_v, self.to_out = (nn.Linear(dim, dim) for _ in range(4))

    def forward(self, x, image_rotary_emb):
        b, n, d = x.shape
        q, k, v = (f(x).view(b, n, self.heads, -1).transpose(1, 2) for f in (self.to_q, self.to_k, self.to_v))
        q, k = (rotate(t, *image_rotary_emb) for t in (q, k))
        return self.to_out(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, d))


class RopeBlock(nn.Module):
    """Self-attention over the image tokens with their rotary rows, cross-attention to the text, an MLP, modulated by
    the timestep (one per sample)."""

    def __init__(self, dim, heads):
        super().__init__()
        self.attn = RopeAttention(dim, heads)
        self.cross = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
        self.modulation = nn.Linear(dim, 2 * dim)
        self.norm = nn.LayerNorm(dim, elementwise_affine=False)

    def forward(self, hidden_states, encoder_hidden_states, temb, rope):
        scale, shift = self.modulation(temb)[:, None].chunk(2, -1)
        x = hidden_states + self.attn(self.norm(hidden_states) * (1 + scale) + shift, image_rotary_emb=rope)
        x = x + self.cross(x, encoder_hidden_states, encoder_hidden_states, need_weights=False)[0]
        return x + self.mlp(self.norm(x))


class TinyRopeTransformer2DModel(ModelMixin, ConfigMixin, PeftAdapterMixin):
    """A diffusers-style transformer of no diffusers family: latents [B, C, H, W] in 2 x 2 patches, a batch-shared
    2-D RoPE table handed to every block, the text by cross-attention."""
    _supports_gradient_checkpointing = True

    @register_to_config
    def __init__(self, in_channels=4, dim=16, heads=2, num_layers=4, patch_size=2, text_dim=16):
        super().__init__()
        patch = in_channels * patch_size ** 2
        self.proj_in, self.proj_out = nn.Linear(patch, dim), nn.Linear(dim, patch)
        self.text_in = nn.Linear(text_dim, dim)
        self.time_in = nn.Sequential(nn.Linear(1, dim), nn.SiLU(), nn.Linear(dim, dim))
        self.blocks = nn.ModuleList(RopeBlock(dim, heads) for _ in range(num_layers))
        self.gradient_checkpointing = False

    def forward(self, hidden_states, encoder_hidden_states, timestep, return_dict=True):
        b, c, h, w = hidden_states.shape
        p = self.config.patch_size
        rows, columns = h // p, w // p
        x = hidden_states.view(b, c, rows, p, columns, p).permute(0, 2, 4, 1, 3, 5).reshape(b, rows * columns, -1)
        x, text = self.proj_in(x), self.text_in(encoder_hidden_states)
        temb = self.time_in(timestep[:, None].float())
        rope = rope_table(rows, columns, self.config.dim // self.config.heads)
        for block in self.blocks:
            if torch.is_grad_enabled() and self.gradient_checkpointing:
                x = self._gradient_checkpointing_func(block, x, text, temb, rope)
            else:
                x = block(x, encoder_hidden_states=text, temb=temb, rope=rope)
        out = self.proj_out(x).view(b, rows, columns, c, p, p).permute(0, 3, 1, 4, 2, 5).reshape(b, c, h, w)
        return (out,) if not return_dict else {"sample": out}


def narrow_rope(kw, keep):
    """Each sample's kept rows of the batch-shared RoPE table: [N, head_dim] -> [B, K, head_dim]."""
    kw["rope"] = tuple(table[keep.to(table.device)] for table in kw["rope"])


def tiny_rope():
    model = TinyRopeTransformer2DModel()
    inputs = dict(hidden_states=torch.randn(B, 4, 8, 12), encoder_hidden_states=torch.randn(B, 5, 16),
                  timestep=torch.rand(B), return_dict=False)
    return model, inputs, (4, 6)


def rope_example_model(channels, width, depth, text_dim, tokens_side):
    return TinyRopeTransformer2DModel(in_channels=channels, dim=width, heads=width // 32, num_layers=depth,
                                      text_dim=text_dim)


def rope_example_inputs(model, x_t, text, pooled, t):
    return dict(hidden_states=x_t, encoder_hidden_states=text, timestep=t)


def rope_by_hand(kw, keep, lead, tail):
    kw["rope"] = tuple(per_sample(keep, lambda b: table[keep[b]]) for table in kw["rope"])


def rope_angles(table, full, keep, text):
    return all(torch.equal(table[b], full[keep[b]]) for b in range(keep.shape[0]))


@pytest.fixture
def registered(monkeypatch):
    """The family and its tiny entry, registered for one test (the registries as they were after it)."""
    monkeypatch.setitem(FAMILIES, "TinyRopeTransformer2DModel", Family(
        ("blocks",), None, narrow=narrow_rope, grid=latent_grid("patch_size", 2), name="Tiny RoPE",
        example=Example("tiny_rope", rope_example_model, image_latents, rope_example_inputs),
        relies_on={"forward": ("hidden_states", "encoder_hidden_states"), "blocks": ("hidden_states", "rope")}))
    monkeypatch.setitem(TINY, "tiny_rope", Tiny("TinyRopeTransformer2DModel", tiny_rope, rope_by_hand, rope_angles))
    return "tiny_rope"


def test_an_unregistered_transformer_is_refused():
    with pytest.raises(UserError, match="does not support TinyRopeTransformer2DModel"):
        apply_tread(tiny_rope()[0], shared.ROUTE)


def test_a_family_registered_from_a_test_file_routes_as_the_reference(registered):
    name = registered
    model, inputs, grid = build(name)
    full = shared.block_lengths(model, inputs)
    handle = apply_tread(model, shared.ROUTE)
    routed, route = shared.block_lengths(model, inputs), handle.routes[0]
    assert (route.start_layer_idx, route.end_layer_idx) == (1, 2) and set(full.values()) == {math.prod(grid)}
    assert routed == {0: full[0], 1: full[1] // 2, 2: full[2] // 2, 3: full[3]}  # the kept half, in blocks 1 and 2
    handle.remove()
    shared.test_routed_forward_matches_hand_built_reference(name, None)
    shared.test_rope_each_kept_token_keeps_its_angles(name, None)
    shared.run_the_checks_every_family_gets(name)
    shared.test_negative_indices_count_from_the_last_block(name)
    with pytest.MonkeyPatch.context() as patch:  # it undoes its own patches, not the registration
        versions.test_each_block_parameter_the_family_reads_is_checked(patch, name)


def test_a_registered_family_with_an_example_is_benched(registered, monkeypatch):
    """The bench's architectures are the registered families' examples: the new one is an --archs of its own."""
    monkeypatch.setattr(bench_diffusers, "ARCHS", bench_diffusers.registered_archs())
    record = bench_diffusers.main(["--archs", "tiny_rope", "--width", "64", "--depth", "4", "--tokens-side", "4",
                                   "--batch-size", "2", "--rounds", "1", "--steps", "1",
                                   "--threads", str(torch.get_num_threads())])
    row, = record["rows"]
    assert (row["arch"], row["tokens"], row["blocks"]) == ("tiny_rope", 16, 4)
    assert row["flops_routed"] < row["flops_unrouted"] and row["flop_bound"] > 1.0
