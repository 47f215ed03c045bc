"""Parity of our LightningDiT backbone with the TREAD authors' LightningDiT code, unrouted and routed.

    python -m lab.lightningdit_parity --code ../LightningDiT_TREAD            # LightningDiT-T/2, qk_norm off and on
    TREAD_LIGHTNINGDIT_CODE=../LightningDiT_TREAD python -m pytest tests/test_lightningdit_parity.py

`--code`: a clone of github.com/stefan-baumann/LightningDiT_TREAD (checked at c4f5f97), a fork of hustvl/LightningDiT:
its `models/lightningdit_tread.py` (the model, its router, which hands each block the kept tokens' original indices
as `rope_ids`) and the files it imports (`models/pos_embed.py`, `models/rmsnorm.py`, `models/swiglu_ffn.py`, timm's
`PatchEmbed`). Nothing of it is copied here; it is imported from that folder for the comparison.

The same weights: every parameter of ours is loaded into their `LightningDiT(use_swiglu, use_rope, use_rmsnorm,
use_qknorm=qk_norm, wo_shift=False)` under its own name (the names are theirs: `blocks.i.norm1.weight`,
`blocks.i.attn.{qkv,proj}`, `blocks.i.attn.{q,k}_norm.weight`, `blocks.i.mlp.{w12,w3}`, `blocks.i.adaLN_modulation.1`,
`x_embedder.proj`, `t_embedder.mlp`, `y_embedder.embedding_table` (num_classes + 1 rows on both sides),
`final_layer.{norm_final,linear,adaLN_modulation.1}`); the keys only they hold are computed, not learned: their
frozen `pos_embed` (checked equal to our buffer) and their RoPE tables `feat_rope.freqs_{cos,sin}`. The same kept
tokens: both routers are handed the same indices, in an unsorted order as their router draws them. Their class
dropout (`y_embedder.dropout_prob`, a draw inside their forward; ours is in the loss) is set to 0. Their route is
fixed (blocks 2 -> depth-4 at 0.5, in training mode only), so ours is configured the same.

Three things stand between their files and this comparison, bridged without editing them:
- their `models/rmsnorm.py` imports fairscale at the top for LLaMA's model-parallel layers, which LightningDiT
  never builds (it uses only `RMSNorm`): fairscale's modules are stubbed while it loads, if it is not installed;
- their `lightningdit_tread.py` imports `VisionRotaryEmbeddingFast` from `models.pos_embed`, hustvl's, whose
  forward takes no `rope_ids`, so their routed forward fails (a TypeError); the class of the same name in their
  `models/pos_embed_tread.py` takes them, and it is the one their model is given when `models/pos_embed.py`'s lacks
  them;
- their blocks carry `@torch.compile`: they run eagerly here (`lab.paper_code.eager_context`).
einops (their RoPE's `rearrange`) is needed as it is: `pip install einops`.
"""
import argparse
import contextlib
import importlib
import importlib.machinery
import inspect
import sys
import types
from pathlib import Path

import torch

import routing_module
from dit import DiT_models, get_model
from lab.paper_code import eager_context
from lab.paper_parity import _max_rel, _same_kept_tokens, report_rows
from tread_utils.errors import UserError, report_user_errors

CODE_REPO = "https://github.com/stefan-baumann/LightningDiT_TREAD"
CHECKED_COMMIT = "c4f5f97"
NEEDED = ("models/lightningdit_tread.py", "models/pos_embed.py", "models/pos_embed_tread.py", "models/rmsnorm.py",
          "models/swiglu_ffn.py")
FAIRSCALE = ("fairscale", "fairscale.nn", "fairscale.nn.model_parallel", "fairscale.nn.model_parallel.initialize",
             "fairscale.nn.model_parallel.layers")
COMPUTED_KEYS = {"pos_embed", "feat_rope.freqs_cos", "feat_rope.freqs_sin"}  # theirs only, not learned
# Largest differences accepted (relative to the larger side), float32 on a CPU; 0 where the operations are the same.
TOLERANCE = {"output": 0.0, "input_grad": 0.0, "param_grad": 0.0}


@contextlib.contextmanager
def _their_imports(code_dir: Path):
    """Their folder first on sys.path, fairscale stubbed if absent; their `models` package and the stubs are
    dropped from sys.modules afterwards (the modules they imported from site-packages, torch's included, stay)."""
    stubs = []
    try:
        importlib.import_module("fairscale.nn.model_parallel.layers")
    except ImportError:
        for name in FAIRSCALE:
            stub = types.ModuleType(name)
            stub.__spec__ = importlib.machinery.ModuleSpec(name, None)
            stub.ColumnParallelLinear = stub.ParallelEmbedding = stub.RowParallelLinear = None
            sys.modules[name] = stub
            stubs.append(name)
    sys.path.insert(0, str(code_dir))
    try:
        yield
    finally:
        sys.path.remove(str(code_dir))
        for name in [n for n in sys.modules if n == "models" or n.startswith("models.")] + stubs:
            del sys.modules[name]


def load_their_lightningdit(code_dir):
    """Their `models.lightningdit_tread` module, given the RoPE class that takes `rope_ids` when theirs does not."""
    code_dir = Path(code_dir)
    missing = [name for name in NEEDED if not (code_dir / name).is_file()]
    if missing:
        raise UserError(f"--code {code_dir}: no {', '.join(missing)} there; pass a clone of {CODE_REPO}")
    if importlib.util.find_spec("einops") is None:
        raise UserError("their RoPE (models/pos_embed*.py) imports einops, which is not installed: pip install einops")
    with _their_imports(code_dir):
        try:
            module = importlib.import_module("models.lightningdit_tread")
            rope = importlib.import_module("models.pos_embed_tread").VisionRotaryEmbeddingFast
        except Exception as e:
            raise UserError(f"--code {code_dir}: importing their models failed ({type(e).__name__}: {e})") from None
    if "rope_ids" not in inspect.signature(module.VisionRotaryEmbeddingFast.forward).parameters:
        module.VisionRotaryEmbeddingFast = rope
    return module


def build_pair(module, backbone="LightningDiT-T/2", qk_norm=False, routed=True, input_size=16, in_channels=4,
               num_classes=10, seed=0):
    """(ours, theirs): ours seeded, its weights loaded into theirs by name (see the module's docstring)."""
    arch = DiT_models.get(backbone, {})
    if arch.get("block_type") != "lightningdit":
        raise UserError(f"--backbones {backbone}: not a LightningDiT backbone of dit.DiT_models "
                        f"(LightningDiT-T/2, LightningDiT-B/2, ...)")
    depth = arch["depth"]
    torch.manual_seed(seed)
    ours = get_model(backbone, dict(num_classes=num_classes, in_channels=in_channels, input_size=input_size,
                                    qk_norm=qk_norm, enable_routing=routed, init="adaln_zero",
                                    routes=[dict(selection_ratio=0.5, start_layer_idx=2, end_layer_idx=depth - 4)]))
    for name, p in ours.named_parameters():  # adaLN-Zero's zeros would hide every difference inside the blocks
        if "adaLN" in name or "final_layer" in name or "norm" in name:
            torch.nn.init.normal_(p, mean=1.0 if "norm" in name else 0.0, std=0.1)
    theirs = module.LightningDiT(input_size=input_size, patch_size=arch["patch_size"], in_channels=in_channels,
                                 hidden_size=arch["hidden_size"], depth=depth, num_heads=arch["num_heads"],
                                 num_classes=num_classes, class_dropout_prob=0.1, use_qknorm=qk_norm,
                                 use_swiglu=True, use_rope=True, use_rmsnorm=True, wo_shift=False)
    theirs.y_embedder.dropout_prob = 0.0
    missing, unexpected = theirs.load_state_dict(ours.state_dict(), strict=False)
    if set(missing) != COMPUTED_KEYS or unexpected:
        raise UserError(f"their parameter names differ from ours: missing {sorted(set(missing) - COMPUTED_KEYS)}, "
                        f"unexpected {sorted(unexpected)}; the comparison needs {CODE_REPO} at {CHECKED_COMMIT}")
    if not torch.equal(theirs.pos_embed, ours.pos_embed):
        raise UserError("their sine-cosine pos_embed differs from ours; the comparison needs the published code")
    return ours, theirs


def unsorted_kept_indices(batch, tokens, generator) -> torch.Tensor:
    """[B, K] indices of a 0.5 route's kept tokens in a random order, as their router draws them."""
    return torch.rand(batch, tokens, generator=generator).argsort(1)[:, :routing_module.num_kept(tokens, 0.5)]


def _differences(ours, theirs, x, t, y, weight) -> dict:
    """Output, input-gradient and parameter-gradient differences of one forward + backward on each side."""
    grads = {}
    for side, model in (("ours", ours), ("theirs", theirs)):
        model.zero_grad()
        xi = x.clone().requires_grad_(True)
        out = model(xi, t, y)
        (out * weight).sum().backward()
        grads[side] = (out.detach(), xi.grad, {n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    (a, ax, ap), (b, bx, bp) = grads["ours"], grads["theirs"]
    if set(ap) != set(bp):
        raise UserError(f"gradients reach different parameters: {sorted(set(ap) ^ set(bp))[:4]}")
    return {"output": _max_rel(a, b), "input_grad": _max_rel(ax, bx),
            "param_grad": max(_max_rel(ap[n], bp[n]) for n in ap), "output_tensor": a}


def parity(code_dir, backbone="LightningDiT-T/2", qk_norm=False, batch=4, input_size=16, num_classes=10,
           seed=0) -> dict:
    """One row: unrouted (evaluation mode: their model never routes there) and routed (training mode, the same kept
    tokens) differences; `routing_effect`: how far the routed output is from the unrouted one (the route ran),
    `kept_token_draws`: [ours, theirs], routed forwards that asked for kept tokens."""
    module = load_their_lightningdit(code_dir)
    ours, theirs = build_pair(module, backbone, qk_norm, True, input_size, 4, num_classes, seed)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(batch, 4, input_size, input_size, generator=g)
    t = torch.rand(batch, generator=g)
    y = torch.randint(0, num_classes + 1, (batch,), generator=g)
    weight = torch.randn(batch, 4, input_size, input_size, generator=g)
    keep_idx = unsorted_kept_indices(batch, (input_size // ours.patch_size) ** 2, g)
    row = {"backbone": backbone, "qk_norm": qk_norm}
    with eager_context(True):
        ours.eval(), theirs.eval()
        dense = _differences(ours, theirs, x, t, y, weight)
        ours.train(), theirs.train()
        with _same_kept_tokens(theirs, keep_idx) as draws:
            routed = _differences(ours, theirs, x, t, y, weight)
    for mode, d in (("unrouted", dense), ("routed", routed)):
        row.update({f"{mode}_{k}": v for k, v in d.items() if k != "output_tensor"})
    row["routing_effect"] = _max_rel(routed["output_tensor"], dense["output_tensor"])
    row["kept_token_draws"] = [draws["ours"], draws["theirs"]]
    return row


def failures(rows) -> list:
    return [f"{r['backbone']} qk_norm={r['qk_norm']}: {mode}_{key} differs by {r[f'{mode}_{key}']:.3g} "
            f"(tolerance {tol:g})" for r in rows for mode in ("unrouted", "routed")
            for key, tol in TOLERANCE.items() if not r[f"{mode}_{key}"] <= tol]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--code", required=True, help=f"a clone of {CODE_REPO}")
    p.add_argument("--backbones", nargs="+", default=["LightningDiT-T/2"])
    p.add_argument("--out", help="write the rows as JSON here")
    return p


@report_user_errors
def main(argv=None):
    args = build_parser().parse_args(argv)
    rows = [parity(args.code, b, qk_norm) for b in args.backbones for qk_norm in (False, True)]
    report_rows(rows, args.out, failures(rows),
                "parity: outputs, input gradients and parameter gradients match their LightningDiT, unrouted and routed")


if __name__ == "__main__":
    main()
