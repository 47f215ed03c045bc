"""SimpleTuner's own transformer files beside `apply_tread`, fed the same kept tokens: outputs, input gradients and
which blocks each side routes, per family and route layout.

SimpleTuner's `simpletuner/helpers/models/<family>/transformer.py` are diffusers transformers with its TREAD router
called inside their forward. Each family (lab/simpletuner_families.py) is built as a tiny random diffusers model;
SimpleTuner's class is built from the same config and loaded with the same state dict, strictly (so it is the same
architecture). Our side routes by `apply_tread(..., kept_count="simpletuner")`; every kept-token choice it makes is
recorded and replayed into SimpleTuner's router (its `get_mask` answers with those indices, placed in its sequence
where that holds tokens we never route, after its own count and choice are read), so both run the same tokens and
what remains to differ is the routing itself: gathering, per-token inputs (RoPE rows, masks), block numbering,
rejoining.
SimpleTuner is imported from the directory the user gives, never copied (AGPL).
"""
import contextlib
import importlib
import importlib.machinery
import importlib.util
import inspect
import sys
import types
from pathlib import Path

import torch

from lab.simpletuner_families import (B, CAUSES, FAMILIES, LEAVES, REPLAY, image_first, routed_argument,
                                      source_file)
from tread_diffusers import apply_tread, tread

# Modules SimpleTuner's transformer files import at the top but never call on the path run here (SDPA attention,
# no FlashAttention-3 processor); they are stubbed only when not installed, and a stub raises if it is ever used.
STUBS = {"einops": ("rearrange",),  # flux/attention.py: its FlashAttention-3 processors rearrange heads
         "ftfy": ("fix_text",)}  # wan/pipeline.py, imported by wan/model.py: prompt cleaning


def _stub(module: str, names: tuple) -> None:
    def unused(*args, **kwargs):
        raise RuntimeError(f"{module} is stubbed by lab.simpletuner_models: install it to run this path")
    stub = types.ModuleType(module)
    stub.__spec__ = importlib.machinery.ModuleSpec(module, None)  # libraries that probe for it get an answer
    for name in names:
        setattr(stub, name, unused)
    sys.modules[module] = stub


def import_simpletuner(code_dir, family_file: str):
    """SimpleTuner's `helpers/models/<family_file>.py` (e.g. flux/transformer), imported from a checkout
    (DIR/simpletuner) or an installed package directory (DIR itself is `simpletuner`)."""
    code_dir = Path(code_dir).resolve()
    root = code_dir if (code_dir / "simpletuner").is_dir() else code_dir.parent
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    for module, names in STUBS.items():
        if module not in sys.modules and importlib.util.find_spec(module) is None:
            _stub(module, names)
    return importlib.import_module(f"simpletuner.helpers.models.{family_file.replace('/', '.')}")


def build_pair(name: str, module, seed: int = 0):
    """(our diffusers model, SimpleTuner's model with the same weights, inputs, unused config keys)."""
    folder, cls_name, _, build = FAMILIES[name]
    torch.manual_seed(seed)
    ours, inputs = build()
    cls = getattr(module, cls_name)
    accepted = inspect.signature(cls.__init__).parameters
    config = {k: v for k, v in ours.config.items() if not k.startswith("_")}
    dropped = {k: v for k, v in config.items() if k not in accepted}
    theirs = cls(**{k: v for k, v in config.items() if k in accepted})
    result = theirs.load_state_dict(ours.state_dict(), strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    return ours.train(), theirs.train(), inputs, dropped


@contextlib.contextmanager
def recorded_selection():
    """Every kept-token choice apply_tread makes, in order, with the count it chose from (the list fills while the
    context is open)."""
    chosen, select = [], tread.select_kept_tokens

    def record(x, *args, **kwargs):
        chosen.append((select(x, *args, **kwargs), x.shape[1]))  # (kept indices, tokens chosen from)
        return chosen[-1][0]
    tread.select_kept_tokens = record
    try:
        yield chosen
    finally:
        tread.select_kept_tokens = select


def replaying_router(module, chosen: list, counts: list, replay=None):
    """SimpleTuner's TREADRouter whose get_mask keeps `chosen`'s indices in turn, placed in its sequence by
    `replay(keep, S, N)` where its sequence holds more than our N routed tokens (lab/simpletuner_families.py), after
    recording its own count and choice (the rest of its router, start_route and end_route, runs as it is)."""
    router = importlib.import_module("simpletuner.helpers.training.tread").TREADRouter(seed=0)  # FLUX.2's file
    own = router.get_mask  # does not import it

    def get_mask(x, mask_ratio=0.0, *args, force_keep=None, **kwargs):
        info = own(x, mask_ratio, *args, force_keep=force_keep, **kwargs)
        keep, n = chosen.pop(0)
        whole = torch.arange(0) if replay is None else replay(keep[:, :0], x.shape[1], n)[0]  # we never route them
        keep = keep.to(x.device) if replay is None else replay(keep, x.shape[1], n).to(x.device)
        own_kept = torch.zeros(x.shape[:2], dtype=torch.bool, device=x.device).scatter(1, info.ids_keep, True)
        # its own count, the replayed one, and how many of the tokens we pass whole its own choice drops
        counts.append((info.ids_keep.shape[1], keep.shape[1], int((~own_kept[:, whole.to(x.device)]).sum())))
        kept = torch.zeros(x.shape[:2], dtype=torch.bool, device=x.device).scatter(1, keep, True)
        rest = torch.argsort(kept.int(), dim=1, stable=True)[:, :x.shape[1] - keep.shape[1]]
        shuffle = torch.cat([keep, rest], 1)
        return type(info)(~kept, keep, rest, shuffle, torch.argsort(shuffle, dim=1))
    router.get_mask = get_mask
    return router


def block_lengths(model, block_lists, key: str = "hidden_states") -> tuple:
    """A hook per block recording the length of the tokens (`key`) it is given (in numbering order)."""
    seen, hooks = {}, []
    blocks = [block for name in block_lists for block in getattr(model, name)]
    for i, block in enumerate(blocks):
        # SimpleTuner's SD3 runs a block's parts without calling the block: watch its first norm there
        watched = block.norm1 if type(block).__name__ == "JointTransformerBlock" else block

        def record(module, args, kwargs, i=i):
            seen[i] = (kwargs[key] if key in kwargs else args[0]).shape[1]
        hooks.append(watched.register_forward_pre_hook(record, with_kwargs=True))
    return seen, hooks


def run(model, inputs: dict, leaves: tuple = ("hidden_states", "encoder_hidden_states"), weight_seed: int = 1):
    """Output and the input gradients of a fixed random projection of it."""
    leaves = {k: inputs[k].clone().requires_grad_() for k in leaves}
    taken = inspect.signature(model.forward).parameters
    if not any(p.kind == p.VAR_KEYWORD for p in taken.values()):  # SimpleTuner's Z-Image takes no return_dict
        inputs = {k: v for k, v in inputs.items() if k in taken}
    out = model(**{**inputs, **leaves})[0]
    out = torch.stack(out) if isinstance(out, list) else out  # Z-Image: one tensor per sample
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(weight_seed))
    (out * weight).sum().backward()
    model.zero_grad(set_to_none=True)
    return out.detach(), {k: v.grad for k, v in leaves.items()}


def difference(a, b) -> tuple:
    """(output, gradient) max abs differences of two `run` results."""
    return (a[0] - b[0]).abs().max().item(), max((a[1][k] - b[1][k]).abs().max().item() for k in a[1])


def unrouted(name: str, model, inputs: dict) -> tuple:
    """The unrouted training-mode result and each block's hidden_states length."""
    seen, hooks = block_lengths(model, FAMILIES[name][2], routed_argument(name))
    try:
        return run(model, inputs, LEAVES.get(name, ("hidden_states", "encoder_hidden_states"))), dict(seen)
    finally:
        for hook in hooks:
            hook.remove()


def compare_layout(name: str, ours, theirs, module, inputs: dict, routes: list, full: tuple, extra: dict = None) -> dict:
    """One route layout: each side's result, the kept counts, and which blocks each side shortened (against
    `full`, each side's unrouted block lengths)."""
    block_lists, extra = FAMILIES[name][2], extra or {}
    inputs = {**inputs, **extra.get("inputs", {})}
    key, leaves = routed_argument(name), LEAVES.get(name, ("hidden_states", "encoder_hidden_states"))
    counts, their_len = [], block_lengths(theirs, block_lists, key)
    ours_len = ({}, [])
    try:
        with recorded_selection() as chosen:
            handle = apply_tread(ours, {"routes": routes}, kept_count="simpletuner")
            ours_len = block_lengths(ours, block_lists, key)  # after the routing hooks: it sees what the blocks get
            try:
                torch.manual_seed(0)
                mine = run(ours, {**inputs, **({"tread_mask": extra["mask"]} if "mask" in extra else {})}, leaves)
            finally:
                handle.remove()
        theirs.set_router(replaying_router(module, list(chosen), counts, extra.get("replay", REPLAY.get(name))),
                          routes)
        their_mask = extra.get("their_mask", extra.get("mask"))
        try:
            other = run(theirs, {**inputs, **({"force_keep_mask": their_mask} if their_mask is not None else {})},
                        leaves)
            error = None
        except Exception as err:  # SimpleTuner's own failure on this layout is a finding, not ours
            other, error = None, f"{type(err).__name__}: {str(err).splitlines()[0][:120]}"
        finally:
            theirs.set_router(None, [])
    finally:
        for hook in ours_len[1] + their_len[1]:
            hook.remove()
    routed = lambda seen, lengths: [i for i in sorted(seen) if seen[i] < lengths[i]]  # noqa: E731
    return dict(ours=mine, theirs=other, error=error, counts=counts,
                blocks=(routed(ours_len[0], full[0]), routed(their_len[0], full[1]) if error is None else None))


def _route(start, end, ratio=0.5):
    return {"selection_ratio": ratio, "start_layer_idx": start, "end_layer_idx": end}


# Route layouts over four blocks (two lists of two for FLUX, Chroma and AuraFlow: blocks 0-1, then 2-3).
LAYOUTS = {
    "across lists 1..2": [_route(1, 2)],
    "first list 0..1": [_route(0, 1)],
    "second list 2..3": [_route(2, 3)],
    "negative -3..-2": [_route(-3, -2)],
    "to the last 1..-1": [_route(1, -1, 0.75)],
    "start == end 2..2": [_route(2, 2)],
    "two routes 0..0, 2..3": [_route(0, 0, 0.25), _route(2, 3)],
}


def force_keep_mask(inputs: dict, tokens: int, seed: int = 2) -> torch.Tensor:
    """A [B, N] token mask, a different set per sample (a quarter of the tokens)."""
    return torch.rand(B, tokens, generator=torch.Generator().manual_seed(seed)) < 0.25


REFERENCES = (2, 3)  # FLUX Kontext's reference image: 2 x 3 tokens after the target's


def kontext_cases(inputs: dict, mask: torch.Tensor, layouts: dict) -> dict:
    """FLUX Kontext layouts: a reference image's tokens appended to hidden_states, img_ids' first coordinate 1 (as
    diffusers' FluxKontextPipeline builds them). We route the target's tokens only; SimpleTuner's router is handed
    our kept target tokens followed by every reference token, so both run the same sequence. With a force-keep
    mask over the target (as SimpleTuner's model_predict builds it from the target's latents), and with that mask
    padded with True for the references (SimpleTuner then keeps them too)."""
    rows, cols = REFERENCES
    ids = torch.zeros(rows, cols, 3)
    ids[..., 0], ids[..., 1], ids[..., 2] = 1, torch.arange(rows)[:, None], torch.arange(cols)[None]
    refs = rows * cols
    reference = torch.randn(B, refs, inputs["hidden_states"].shape[2], generator=torch.Generator().manual_seed(4))
    extra = {"inputs": {"img_ids": torch.cat([inputs["img_ids"], ids.reshape(-1, 3)]),
                        "hidden_states": torch.cat([inputs["hidden_states"], reference], 1)},
             "references": refs, "replay": image_first}
    padded = torch.cat([mask, torch.ones(B, refs, dtype=torch.bool)], 1)
    cases = {}
    for k in ("across lists 1..2", "first list 0..1", "second list 2..3"):
        cases[f"{k}, Kontext"] = (layouts[k], extra)
        cases[f"{k}, Kontext, target mask"] = (layouts[k], {**extra, "mask": mask})
        if k != "second list 2..3":  # SimpleTuner's single-stream start slices the mask (see WHY_IT_FAILS)
            cases[f"{k}, Kontext, mask padded"] = (layouts[k], {**extra, "mask": mask, "their_mask": padded})
    return cases


def compare_family(name: str, code_dir, layouts: dict = LAYOUTS) -> dict:
    """Every layout (and, for FLUX, per-sample masks) for one family: max abs differences against the tolerance
    (ten times each quantity's unrouted difference, at least 1e-6), kept counts and routed blocks of both sides."""
    module = import_simpletuner(code_dir, source_file(FAMILIES[name][0]))
    ours, theirs, inputs, dropped = build_pair(name, module)
    (base_ours, full_ours), (base_theirs, full_theirs) = unrouted(name, ours, inputs), unrouted(name, theirs, inputs)
    base = difference(base_ours, base_theirs)
    tolerance = tuple(max(10 * d, 1e-6) for d in base)
    cases = dict(layouts)
    if name == "wan":  # Wan 2.2's per-token timesteps, [B, N]
        tokens = inputs["hidden_states"][0, 0].numel() // 4  # patch (1, 2, 2)
        timestep = torch.randint(0, 1000, (B, tokens), generator=torch.Generator().manual_seed(3))
        cases["across lists 1..2, per-token timesteps"] = (layouts["across lists 1..2"],
                                                           {"inputs": {"timestep": timestep}})
    if name == "flux":  # per-sample force-keep masks, starting in each block list; FLUX Kontext's references
        tokens = inputs["hidden_states"].shape[1]
        mask = force_keep_mask(inputs, tokens)
        cases.update({f"{k}, per-sample mask": (v, {"mask": mask}) for k, v in layouts.items()
                      if k in ("first list 0..1", "across lists 1..2", "second list 2..3")})
        cases.update(kontext_cases(inputs, mask, layouts))
    for label, change in CAUSES.get(name, {}).items():
        cases[f"across lists 1..2, {label}"] = (layouts["across lists 1..2"], {"inputs": change(inputs)})
    rows = []
    for label, case in cases.items():
        routes, extra = case if isinstance(case, tuple) else (case, None)
        full = (full_ours, full_theirs)
        if extra and "inputs" in extra:  # other inputs: their own unrouted block lengths
            full = (unrouted(name, ours, {**inputs, **extra["inputs"]})[1],
                    unrouted(name, theirs, {**inputs, **extra["inputs"]})[1])
        result = compare_layout(name, ours, theirs, module, inputs, routes, full, extra)
        diff = None if result["error"] else difference(result["ours"], result["theirs"])
        rows.append(dict(layout=label, diff=diff, error=result["error"], counts=result["counts"],
                         blocks=result["blocks"],
                         same=result["error"] is None and diff[0] <= tolerance[0] and diff[1] <= tolerance[1]
                         and result["blocks"][0] == result["blocks"][1]
                         and (bool(extra and "replay" in extra) or name in REPLAY
                              or all(c[0] == c[1] for c in result["counts"]))))
    return dict(family=name, baseline=base, tolerance=tolerance, dropped=dropped, rows=rows,
                file=f"simpletuner/helpers/models/{source_file(FAMILIES[name][0])}.py")


# SimpleTuner's --tread_config strings (it reads one starting with `{` by ast.literal_eval and hands the routes to the
# transformer's set_router): whether we accept each, and which FLUX blocks their transformer routes with it.
CONFIGS = ('{"routes": [{"selection_ratio": 0.5, "start_layer_idx": 1, "end_layer_idx": -2}]}',
           '{"routes": [{"selection_ratio": 0.5, "start_layer_idx": 2.5, "end_layer_idx": 3}]}',
           '{"routes": [{"selection_ratio": False, "start_layer_idx": 1, "end_layer_idx": 2}]}',
           '{"routes": [{"selection_ratio": 0.5, "start_layer_idx": 0, "end_layer_idx": 0}, '
           '{"selection_ratio": 0.25, "start_layer_idx": -2, "end_layer_idx": -1}]}')


def compare_configs(code_dir) -> list:
    """Per config string: our routes_from_config's blocks (or its refusal) and the blocks SimpleTuner's FLUX routes."""
    import ast

    from routing_module import RouteError
    from tread_diffusers.tread import routes_from_config

    module = import_simpletuner(code_dir, "flux/transformer")
    ours, theirs, inputs, _ = build_pair("flux", module)
    _, full = unrouted("flux", theirs, inputs)
    rows = []
    for text in CONFIGS:
        try:
            mine = [list(range(r.start_layer_idx, r.end_layer_idx + 1))
                    for r in routes_from_config(text, len(full)) if r.selection_ratio > 0]
            mine = sorted(set(i for blocks in mine for i in blocks))
        except RouteError as err:
            mine = f"refused: {err}"
        seen, hooks = block_lengths(theirs, FAMILIES["flux"][2])
        theirs.set_router(module.TREADRouter(seed=0), ast.literal_eval(text)["routes"])
        try:
            run(theirs, inputs)
        finally:
            theirs.set_router(None, [])
            for hook in hooks:
                hook.remove()
        rows.append(dict(config=text, ours=mine, theirs=[i for i in sorted(seen) if seen[i] < full[i]]))
    return rows
