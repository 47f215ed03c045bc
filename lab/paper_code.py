"""Load the paper's own DiT (github.com/CompVis/tread: dit.py + routing_module.py) from a folder outside
this repo, so lab/bench.py can time it next to ours in the same run. Nothing of it is copied here.

Two things stand between the published files and a training step, and both are bridged without
editing them:
- their dit.py does `from routing_module import Router`, a name this repo also uses: their files
  are loaded under private module names, with `routing_module` pointing at theirs only while their
  dit.py executes;
- before their commit 43a15dc, their DiT.forward called `router.get_mask(x, mask_ratio=...)` while their
  Router.get_mask takes `selection_rate=` (a TypeError): for such a clone, the Router their DiT builds is
  swapped for a subclass that accepts `mask_ratio` and forwards it as `selection_rate`. Their HEAD needs none.
Their blocks carry `@torch.compile`; run them "as published" or eagerly (`eager_context`).
"""
import contextlib
import importlib.util
import inspect
import sys
from pathlib import Path

import torch

from tread_utils.errors import UserError

PAPER_REPO = "https://github.com/CompVis/tread"


def exec_module(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[name]
        raise UserError(f"--paper-code: importing {path} failed ({type(e).__name__}: {e}); pass a clone of "
                        f"{PAPER_REPO}") from None
    return module


def load_paper_dit(code_dir):
    """Their dit module, with the Router shim installed when needed."""
    code_dir = Path(code_dir)
    for name in ("dit.py", "routing_module.py"):
        if not (code_dir / name).is_file():
            raise UserError(f"--paper-code {code_dir}: no {name} there; pass the folder of a clone of {PAPER_REPO}")
    routing = exec_module("tread_paper_routing_module", code_dir / "routing_module.py")
    ours = sys.modules.get("routing_module")
    sys.modules["routing_module"] = routing
    try:
        dit = exec_module("tread_paper_dit", code_dir / "dit.py")
    finally:
        if ours is None:
            sys.modules.pop("routing_module", None)
        else:
            sys.modules["routing_module"] = ours
    for attr in ("DiT_models", "Router"):
        if not hasattr(dit, attr):
            raise UserError(f"--paper-code {code_dir}: dit.py has no {attr}; is this a clone of {PAPER_REPO}?")
    calls_mask_ratio = "mask_ratio=" in (code_dir / "dit.py").read_text()
    if calls_mask_ratio and "mask_ratio" not in inspect.signature(dit.Router.get_mask).parameters:
        published = dit.Router

        class RouterAcceptingMaskRatio(published):
            def get_mask(self, x, mask_ratio=None, **kwargs):
                if mask_ratio is not None:
                    kwargs["selection_rate"] = mask_ratio
                return super().get_mask(x, **kwargs)

        dit.Router = RouterAcceptingMaskRatio
    return dit


def build_paper_model(dit, backbone, depth, routed, ratio=0.5, **data_kwargs):
    """Their model for `backbone` with the same route as ours (2 -> depth-4 at `ratio`); their route
    indices must be non-negative."""
    if backbone not in dit.DiT_models:
        raise UserError(f"--paper-code: their DiT_models has no {backbone!r} (it has {', '.join(dit.DiT_models)})")
    routes = [dict(selection_ratio=ratio, start_layer_idx=2, end_layer_idx=depth - 4)]
    return dit.DiT_models[backbone](enable_routing=routed, routes=routes, **data_kwargs)


def load_our_weights(theirs, ours):
    """Copy our parameters into their model: the names match (both follow DiT's layout); their
    pos_embed is a frozen parameter they compute exactly as we do, so it is the one key we skip."""
    how = "the comparison needs the published dit.py"
    try:
        missing, unexpected = theirs.load_state_dict(ours.state_dict(), strict=False)
    except RuntimeError as e:  # shapes differ
        raise UserError(f"--paper-code: their parameters differ from ours ({str(e).splitlines()[1].strip()}); "
                        f"{how}") from None
    if set(missing) - {"pos_embed"} or unexpected:
        raise UserError(f"--paper-code: their parameter names differ from ours (missing {sorted(missing)[:3]}, "
                        f"unexpected {sorted(unexpected)[:3]}); {how}")


def eager_context(eager: bool):
    """Runs their `@torch.compile`d blocks eagerly when `eager`, as published otherwise."""
    if not eager:
        return contextlib.nullcontext()
    if not hasattr(torch.compiler, "set_stance"):
        raise UserError(f"running the paper's code eagerly needs torch >= 2.6 (torch.compiler.set_stance), this "
                        f"is {torch.__version__}; pass --paper-modes published")
    return torch.compiler.set_stance("force_eager")
