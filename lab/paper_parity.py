"""Parity with the authors' code (CompVis/tread): one full training step, routed forwards, one sampling run.

    python -m lab.paper_parity --paper-code ../tread                 # DiT-S/2, dit and tread
    TREAD_PAPER_CODE=../tread python -m pytest tests/test_paper_parity.py

With the same weights, the same batch, the same sigma and noise draws and the same kept tokens, our code and
theirs must give the same loss, the same gradients, the same parameters after AdamW and the same EMA, and the
same routed forward in training and with routing forced at inference; our EDM sampler and theirs must give
the same samples from the same model and noise; compiled as they compile theirs, ours must keep no more for backward.
Their files are loaded from a clone outside this repo
(`lab.paper_code`), never copied. Their EDM code imports deepspeed and transformers for helpers, and their
SD-VAE wrapper, that none of these functions use; those modules are stubbed while it loads.

How the draws are made equal: each side's loss runs with the global stream seeded identically, and both
draw sigma [B,1,1,1] and then the noise like the batch; class dropout is applied before (their
`class_drop_prob=0` draws nothing), and both routers are handed the same kept-token indices.
"""
import argparse
import contextlib
import copy
import importlib.machinery
import json
import sys
import types
from pathlib import Path

import torch

import routing_module
from dit import get_model
from edm import EDMLoss, EDMPrecond, edm_sampler
from lab.paper_code import exec_module, build_paper_model, eager_context, load_our_weights, load_paper_dit
from training.loop import build_adamw
from tread_utils.errors import UserError, report_user_errors

# Largest differences accepted in float32 on a CPU (relative for the loss and the gradients, absolute for
# weights, whose update is lr-sized: 1e-4 per step).
TOLERANCE = {"loss": 1e-5, "grad": 1e-4, "params_after_adamw": 1e-6, "ema_after_update": 1e-6, "samples": 1e-4,
             "routed_train_forward": 1e-5, "routed_forced_forward": 1e-5, "saved_bytes_over_theirs": 0}
STUBBED = ("deepspeed", "deepspeed.runtime", "deepspeed.runtime.zero", "deepspeed.runtime.zero.partition_parameters",
           "transformers", "transformers.optimization", "autoencoder")


@contextlib.contextmanager
def _their_imports(code_dir: Path):
    """Their folder first on sys.path and the unused heavy imports stubbed; sys.modules restored afterwards."""
    before = set(sys.modules)
    for name in STUBBED:
        stub = types.ModuleType(name)
        stub.__spec__ = importlib.machinery.ModuleSpec(name, None)
        stub.ZeroParamStatus = stub.get_scheduler = stub.SchedulerType = stub.SDVAE_EMA = None
        sys.modules.setdefault(name, stub)
    sys.path.insert(0, str(code_dir))
    try:
        yield
    finally:
        sys.path.remove(str(code_dir))
        for name in set(sys.modules) - before:  # their `utils`, `autoencoder`, the stubs
            if not name.startswith("tread_paper_"):
                del sys.modules[name]


def load_paper_edm(code_dir):
    """(their edm module, their utils/train_helper module)."""
    code_dir = Path(code_dir)
    for name in ("edm.py", "utils/train_helper.py"):
        if not (code_dir / name).is_file():
            raise UserError(f"--paper-code {code_dir}: no {name} there; pass a clone of CompVis/tread")
    with _their_imports(code_dir):
        edm = exec_module("tread_paper_edm", code_dir / "edm.py")
        helper = exec_module("tread_paper_train_helper", code_dir / "utils" / "train_helper.py")
    return edm, helper


def _models(dit_module, backbone, routed, input_size, num_classes, seed):
    torch.manual_seed(seed)
    depth = len(get_model(backbone, dict(num_classes=num_classes, in_channels=4, input_size=input_size)).blocks)
    routes = [dict(selection_ratio=0.5, start_layer_idx=2, end_layer_idx=depth - 4)]
    ours = get_model(backbone, dict(num_classes=num_classes, in_channels=4, input_size=input_size,
                                    enable_routing=routed, routes=routes))
    theirs = build_paper_model(dit_module, backbone, depth, routed, input_size=input_size, in_channels=4,
                               num_classes=num_classes)
    load_our_weights(theirs, ours)
    return ours, theirs


@contextlib.contextmanager
def _same_kept_tokens(their_model, keep_idx):
    """Both routers keep `keep_idx` [B, K] (sorted) instead of drawing; yields {"ours": n, "theirs": n}, how
    many times each side asked for kept tokens (a route that did not run asks none)."""
    ours_before, calls = routing_module.select_kept_tokens, {"ours": 0, "theirs": 0}

    def handing(side):
        def kept_tokens(x, *args, **kwargs):
            calls[side] += 1
            return keep_idx
        return kept_tokens

    routing_module.select_kept_tokens = handing("ours")
    router = getattr(their_model, "router", None)
    if router is not None:
        router.get_mask = handing("theirs")
    try:
        yield calls
    finally:
        routing_module.select_kept_tokens = ours_before


def _max_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


def training_step_parity(code_dir, backbone="DiT-S/2", routed=True, batch=4, input_size=16, num_classes=10,
                         seed=0) -> dict:
    """Largest differences (see TOLERANCE) after one EDM training step with AdamW and EMA on both codes."""
    dit_module = load_paper_dit(code_dir)
    their_edm, their_helper = load_paper_edm(code_dir)
    ours, theirs = _models(dit_module, backbone, routed, input_size, num_classes, seed)
    ours.train(), theirs.train()
    our_net = EDMPrecond(ours, sigma_data=0.5)
    their_net = their_edm.EDMPrecond(input_size, 4, num_classes, sigma_data=0.5, model=theirs)
    our_ema, their_ema = copy.deepcopy(our_net).requires_grad_(False), copy.deepcopy(their_net).requires_grad_(False)

    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(batch, 4, input_size, input_size, generator=g)
    y = torch.randint(0, num_classes, (batch,), generator=g)
    y[0] = num_classes  # one dropped label: the null class, as class dropout leaves it
    keep_idx = _kept_indices(ours, batch, input_size, g)

    with _same_kept_tokens(theirs, keep_idx) as draws, eager_context(True):  # their @torch.compile: eager here
        torch.manual_seed(seed + 2)
        our_loss = EDMLoss(P_mean=-1.2, P_std=1.2, sigma_data=0.5)(our_net, x, y).mean()
        torch.manual_seed(seed + 2)
        their_loss = their_edm.EDMDiffusion().get_training_loss(their_net, x, y, class_drop_prob=0.0).mean()
        our_loss.backward(), their_loss.backward()
    their_params = dict(theirs.named_parameters())
    grads = [_max_rel(p.grad, their_params[n].grad) for n, p in ours.named_parameters()]

    our_opt = build_adamw(ours.parameters(), lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    their_opt = torch.optim.AdamW(theirs.parameters(), lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    our_opt.step(), their_opt.step()
    params = [(p - their_params[n]).abs().max().item() for n, p in ours.named_parameters()]

    with torch.no_grad():  # ours: the trainer's foreach lerp; theirs: their update_ema
        torch._foreach_lerp_(list(our_ema.parameters()), list(our_net.parameters()), 1 - 0.9999)
    their_helper.update_ema(their_ema, their_net, decay=0.9999)
    their_ema_params = dict(their_ema.named_parameters())
    ema = [(p - their_ema_params[n]).abs().max().item() for n, p in our_ema.named_parameters()]
    return {"loss": abs(our_loss.item() - their_loss.item()) / abs(their_loss.item()), "grad": max(grads),
            "params_after_adamw": max(params), "ema_after_update": max(ema),
            "loss_value": our_loss.item(), "kept_token_draws": [draws["ours"], draws["theirs"]]}


def _kept_indices(model, batch, input_size, generator):
    """Sorted indices [B, K] of the tokens a 0.5 route keeps, drawn from `generator`."""
    tokens = (input_size // model.patch_size) ** 2
    keep = routing_module.num_kept(tokens, 0.5)
    return torch.rand(batch, tokens, generator=generator).argsort(1)[:, :keep].sort(1).values


def routed_forward_parity(code_dir, backbone="DiT-S/2", batch=4, input_size=16, num_classes=10, seed=0) -> dict:
    """Largest relative differences between our routed DiT forward and theirs with the same kept tokens: in
    training mode, and at inference with routing forced (ours `force_routing_ratio`, theirs `force_routing`
    with `overwrite_selection_ratio`). `routing_effect`: how far the routed output is from the dense one, so a
    match cannot come from both sides skipping the route; `kept_token_draws`: [ours, theirs] per forward."""
    ours, theirs = _models(load_paper_dit(code_dir), backbone, True, input_size, num_classes, seed)
    g = torch.Generator().manual_seed(seed + 4)
    x = torch.randn(batch, 4, input_size, input_size, generator=g)
    t = torch.rand(batch, generator=g)
    y = torch.randint(0, num_classes + 1, (batch,), generator=g)
    keep_idx = _kept_indices(ours, batch, input_size, g)
    row = {}
    with torch.no_grad(), _same_kept_tokens(theirs, keep_idx) as draws, eager_context(True):
        ours.train(), theirs.train()
        routed = ours(x, t, y)
        row["routed_train_forward"] = _max_rel(routed, theirs(x, t, y))
        ours.eval(), theirs.eval()
        forced = ours(x, t, y, force_routing_ratio=0.5)
        row["routed_forced_forward"] = _max_rel(forced, theirs(x, t, y, force_routing=True,
                                                                overwrite_selection_ratio=0.5))
        row["routing_effect"] = min(_max_rel(routed, ours(x, t, y)), _max_rel(forced, ours(x, t, y)))
    return {**row, "kept_token_draws": [draws["ours"], draws["theirs"]]}


def sampler_parity(code_dir, backbone="DiT-S/2", batch=4, input_size=16, num_classes=10, num_steps=8,
                   seed=0) -> dict:
    """Largest relative difference between our EDM Heun samples and theirs, same model, noise and labels."""
    dit_module = load_paper_dit(code_dir)
    their_edm, _ = load_paper_edm(code_dir)
    ours, theirs = _models(dit_module, backbone, False, input_size, num_classes, seed)
    our_net = EDMPrecond(ours.eval(), sigma_data=0.5)
    their_net = their_edm.EDMPrecond(input_size, 4, num_classes, sigma_data=0.5, model=theirs.eval())
    g = torch.Generator().manual_seed(seed + 3)
    latents = torch.randn(batch, 4, input_size, input_size, generator=g)
    labels = torch.randint(0, num_classes, (batch,), generator=g)
    with torch.no_grad(), eager_context(True):
        a = edm_sampler(our_net, latents, labels, num_steps=num_steps)
        b = their_edm.edm_sampler(their_net, latents, labels.float(), num_steps=num_steps)
    return {"samples": _max_rel(a, b)}


def saved_for_backward(code_dir, backbone="DiT-S/2", batch=2, input_size=16, num_classes=10, seed=0) -> dict:
    """What one bf16 EDM training forward keeps for backward, both models compiled as the paper code compiles
    (ours with train.compile_scope=blocks, theirs as published; inductor), on the CPU: distinct storages and
    their bytes. Memory parity of the compiled step short of a GPU: what the partitioner keeps is the same there."""
    from training.compile import compile_backbone

    dit_module = load_paper_dit(code_dir)
    their_edm, _ = load_paper_edm(code_dir)
    ours, theirs = _models(dit_module, backbone, False, input_size, num_classes, seed)
    compile_backbone(ours.train(), "blocks")
    nets = {"ours": EDMPrecond(ours, sigma_data=0.5),
            "theirs": their_edm.EDMPrecond(input_size, 4, num_classes, sigma_data=0.5, model=theirs.train())}
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(batch, 4, input_size, input_size, generator=g)
    y = torch.randint(0, num_classes, (batch,), generator=g)
    kept = {}
    for side, net in nets.items():
        storages = {}

        def pack(t):
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t
        for _ in range(2):  # the first call compiles; the second is the step as it runs from then on
            storages.clear()
            torch.manual_seed(seed + 2)
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
                    torch.autocast("cpu", dtype=torch.bfloat16):
                loss = EDMLoss(P_mean=-1.2, P_std=1.2, sigma_data=0.5)(net, x, y).mean()
            loss.backward()
        kept[side] = (len(storages), sum(storages.values()))
    return {"saved_tensors": [kept["ours"][0], kept["theirs"][0]], "saved_bytes": [kept["ours"][1], kept["theirs"][1]],
            "saved_bytes_over_theirs": kept["ours"][1] - kept["theirs"][1]}


def run_all(code_dir, backbones=("DiT-S/2",)) -> list:
    rows = []
    for backbone in backbones:
        for routed in (False, True):
            rows.append({"backbone": backbone, "model": "tread" if routed else "dit",
                         **training_step_parity(code_dir, backbone, routed)})
        rows.append({"backbone": backbone, "model": "tread forward", **routed_forward_parity(code_dir, backbone)})
        rows.append({"backbone": backbone, "model": "sampler", **sampler_parity(code_dir, backbone)})
        rows.append({"backbone": backbone, "model": "dit compiled per block", **saved_for_backward(code_dir, backbone)})
    return rows


def failures(rows) -> list:
    return [f"{r['backbone']} {r['model']}: {key} differs by {r[key]:.3g} (tolerance {tol:g})"
            for r in rows for key, tol in TOLERANCE.items() if key in r and not r[key] <= tol]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--paper-code", required=True, help="a clone of https://github.com/CompVis/tread")
    p.add_argument("--backbones", nargs="+", default=["DiT-S/2"])
    p.add_argument("--out", help="write the rows as JSON here")
    return p


@report_user_errors
def main(argv=None):
    args = build_parser().parse_args(argv)
    rows = run_all(args.paper_code, args.backbones)
    report_rows(rows, args.out, failures(rows),
                "parity: loss, gradients, AdamW and EMA updates, routed forwards and EDM samples match the paper's "
                "code, and compiled per block our step keeps no more for backward")


def report_rows(rows, out, bad, done: str):
    """Prints the rows, writes them as JSON to `out` (when given), then fails in one line naming `bad` (the
    differences over their tolerance), or prints `done`."""
    for r in rows:
        print(" ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()))
    if out:
        Path(out).write_text(json.dumps(rows, indent=2) + "\n")
    if bad:
        raise UserError("parity failed: " + "; ".join(bad))
    print(done)


if __name__ == "__main__":
    main()
