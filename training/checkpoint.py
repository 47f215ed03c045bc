"""Checkpoints: written atomically, loaded without arbitrary pickle, checked against the model; and the
objective a checkpoint's `diffuser` config names (the denoiser wrapper sampling rebuilds, and its loss).

A checkpoint is one file `checkpoints/ckpt_{step:08d}.pt` holding the model and EMA weights, the
optimizer (and grad scaler) state, the step, every rank's RNG states and the run's resolved config.
The data position is the step itself (see `data.ResumableBatchSampler`). `checkpoints/latest`
names the newest file. `load_sampling_net` turns a checkpoint into the EMA denoiser that sampling uses.
Wherever a run is accepted (sampling, init_from), a folder written by `python -m tools.export` is too: it
reads as a checkpoint holding only the EMA weights (training/exported.py; safetensors, nothing unpickled).
"""
import contextlib
import os
import random
import re
from pathlib import Path

import numpy as np
import torch
from omegaconf import OmegaConf

from dit import FUSIONS, dit_defaults, get_model, model_kwargs
from edm import EDMLoss, EDMPrecond
from rectified_flow import FlowPrecond, RFLoss
from routing_module import saved_routes
from training.exported import read_export
from tread_utils.errors import UserError
from tread_utils.hub import is_exported_folder
from tread_utils.user_imports import import_saved
from tread_utils.files import atomic_write, atomic_write_text

CKPT_RE = re.compile(r"^ckpt_(\d+)\.pt$")
PREFIXES = ("_orig_mod.", "module.")

# diffuser.name -> (denoiser(model, cfg), loss(cfg)). Both denoisers follow EDM's convention
# `net(x, sigma, labels)`, so samplers and guidance wrappers work unchanged for either objective.
DIFFUSERS = {
    "edm": (lambda model, d: EDMPrecond(model, sigma_data=d.get("sigma_data", 0.5)),
            lambda d: EDMLoss(P_mean=d.P_mean, P_std=d.P_std, sigma_data=d.sigma_data)),
    "rf": (lambda model, d: FlowPrecond(model),
           lambda d: RFLoss(P_mean=d.P_mean, P_std=d.P_std)),
}


def _diffuser(diffuser_cfg):
    name = diffuser_cfg.get("name", "edm")
    if name not in DIFFUSERS:
        raise UserError(f"unknown diffuser {name!r}; choose one of {', '.join(DIFFUSERS)} (diffuser=...)")
    return DIFFUSERS[name]


def build_denoiser(diffuser_cfg, model):
    return _diffuser(diffuser_cfg)[0](model, diffuser_cfg)


def build_objective(diffuser_cfg, model):
    """(the denoiser around `model`, `loss_fn(net, images, labels)` -> per-element losses)."""
    return build_denoiser(diffuser_cfg, model), _diffuser(diffuser_cfg)[1](diffuser_cfg)


def checkpoint_path(ckpt_dir, step: int) -> Path:
    return Path(ckpt_dir) / f"ckpt_{step:08d}.pt"


def list_checkpoints(ckpt_dir) -> list:
    """[(step, path)] of complete checkpoints, oldest first (temporary files are ignored)."""
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        return []
    found = [(int(m.group(1)), ckpt_dir / name) for name in os.listdir(ckpt_dir) if (m := CKPT_RE.match(name))]
    return sorted(found)


def save_checkpoint(state: dict, ckpt_dir, step: int) -> Path:
    """Write to a temporary file in the same folder, fsync, then rename: never a half-written checkpoint."""
    ckpt_dir = Path(ckpt_dir)
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    path = checkpoint_path(ckpt_dir, step)
    atomic_write(path, lambda f: torch.save(state, f))
    atomic_write_text(ckpt_dir / "latest", path.name + "\n")
    return path


def resolve_checkpoint(path) -> Path:
    """A checkpoint file, or a run directory (or its checkpoints/ folder) -> its newest checkpoint; an exported
    model folder -> itself."""
    path = Path(str(path)).expanduser()
    if path.is_file() or is_exported_folder(path):
        return path
    found = [c for folder in (path / "checkpoints", path) if path.is_dir() for c in list_checkpoints(folder)[-1:]]
    if found:
        return found[0][1]
    raise UserError(f"{path} holds no checkpoints (expected {path}/checkpoints/ckpt_*.pt, or config.json and "
                    f"model.safetensors of an exported model)" if path.is_dir() else
                    f"checkpoint {path} does not exist (give a ckpt_*.pt file, a run directory or an exported model)")


RESUME_ADVICE = "move it away to resume from an earlier one, or start over with resume=false"
SAMPLING_ADVICE = "pass another checkpoint file or run directory"


def load_checkpoint(path, header_only: bool = False, advice: str = RESUME_ADVICE) -> dict:
    """Load with weights_only=True; a truncated or foreign file is refused with one clear line ending in
    `advice`. An exported folder gives its EMA weights as `model` and `ema` (`training.exported.read_export`).
    `header_only`: the same checks for the config checks before a run starts, without reading the weights
    (memory-mapped)."""
    path = Path(path)
    if is_exported_folder(path):
        return read_export(path, header_only)
    path = resolve_checkpoint(path)  # a missing path refused in one line
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=header_only)
    except Exception as e:  # truncated zip, not a torch file, disallowed pickle content...
        raise UserError(f"checkpoint {path} cannot be read ({type(e).__name__}: {str(e).splitlines()[0][:120]}); "
                        f"it is truncated or not a checkpoint of this project; {advice}") from None
    if not isinstance(state, dict) or "model" not in state or "step" not in state:
        raise UserError(f"checkpoint {path} is not a training checkpoint of this project (no model/step entries)")
    return state


SHAPE_KEYS = ("depth", "hidden_size", "num_heads", "mlp_ratio", "patch_size", "in_channels", "input_size",
              "num_classes", "qk_norm", "block_type")  # the model arguments that make the weights what they are


def saved_params(params: dict) -> dict:
    """A saved run's `model.params` in today's keys (routing_module.saved_routes: a run trained before a fusion's
    settings moved into its fusion_options still samples and fine-tunes)."""
    return {**params, "routes": saved_routes(params.get("routes"), FUSIONS)}


def check_same_model(source_model: dict, model: dict, source) -> None:
    """One line naming the first size in which `source`'s model (its config's `model`) differs from this
    config's `model`, e.g. "the source has depth 4, this config 12"."""
    theirs = {**dit_defaults(), **model_kwargs(source_model["backbone_type"], saved_params(source_model["params"]),
                                               where=f"{source}'s model")}
    ours = {**dit_defaults(), **model_kwargs(model["backbone_type"], model["params"])}
    for key in SHAPE_KEYS:
        a, b = theirs[key], ours[key]
        if a != b:
            raise UserError(f"init_from={source}: the source has {key} {a}, this config {b} "
                            f"(model.params.{key}); a model starts only from weights of its own sizes")


def strip_prefixes(state_dict: dict) -> dict:
    """Tolerate the `_orig_mod.` (torch.compile) and `module.` (DDP) key prefixes."""
    out = {}
    for key, value in state_dict.items():
        changed = True
        while changed:
            changed = False
            for prefix in PREFIXES:
                if key.startswith(prefix):
                    key, changed = key[len(prefix):], True
        out[key] = value
    return out


def load_model_state(model: torch.nn.Module, state_dict: dict, source) -> None:
    """Load weights strictly; a checkpoint of another model is refused, naming the first mismatch."""
    state_dict = strip_prefixes(state_dict)
    own = model.state_dict()
    missing = sorted(set(own) - set(state_dict))
    unexpected = sorted(set(state_dict) - set(own))
    if missing or unexpected:
        raise UserError(f"checkpoint {source} belongs to another model: missing {missing[:3]}, unexpected "
                        f"{unexpected[:3]}; check model.backbone_type / model.params or use another run_name")
    for key, value in state_dict.items():
        if own[key].shape != value.shape:
            raise UserError(f"checkpoint {source} belongs to another model: {key} has shape {tuple(value.shape)}, "
                            f"this model expects {tuple(own[key].shape)}; check model.backbone_type / model.params")
    model.load_state_dict(state_dict)


def capture_rng_state() -> dict:
    """This process's random streams. On CUDA only the current device's generator: a rank uses its own GPU,
    and a resume may see fewer GPUs per process than the run that saved."""
    np_state = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state(torch.cuda.current_device()) if torch.cuda.is_available() else None,
        "numpy": {"keys": torch.from_numpy(np_state[1].astype(np.int64)), "pos": int(np_state[2]),
                  "has_gauss": int(np_state[3]), "gauss": float(np_state[4])},
        "python": random.getstate(),
    }


def restore_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    cuda = state["cuda"]
    if isinstance(cuda, (list, tuple)):  # checkpoints written before: every visible GPU's state, by index
        index = torch.cuda.current_device() if torch.cuda.is_available() else 0
        cuda = cuda[index] if index < len(cuda) else None
    if cuda is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(cuda, torch.cuda.current_device())
    n = state["numpy"]
    np.random.set_state(("MT19937", n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))


@contextlib.contextmanager
def rng_untouched():
    """Runs a block (or, as a decorator, a function) and then puts back every random stream training draws
    from: torch's CPU and all CUDA generators, numpy's and Python's. In-training evaluation runs under it, so
    whether, when and how much it evaluates never changes the training run (exact resume, eval on or off)."""
    state = capture_rng_state()
    try:
        yield
    finally:
        restore_rng_state(state)


# ----------------------------------------------------------------------------------------------------
# Checkpoint -> EMA denoiser, for sampling

def net_from_state(state: dict, source="checkpoint", device="cpu"):
    """(the run's denoiser (EDMPrecond, or FlowPrecond for diffuser=rf) around the EMA backbone, in eval
    mode on `device`; the run's config dict) from a checkpoint dict read by `load_checkpoint`."""
    cfg = state.get("config")
    if not isinstance(cfg, dict) or "model" not in cfg or "diffuser" not in cfg:
        raise UserError(f"checkpoint {source} holds no run config (model/diffuser); it was not written by train.py")
    if "ema" not in state:
        raise UserError(f"checkpoint {source} holds no EMA weights")
    import_saved(cfg, source)  # the user's modules the run was trained with (imports), before its model
    try:
        model = get_model(cfg["model"]["backbone_type"], saved_params(cfg["model"]["params"]))
        diffuser = OmegaConf.create({"name": "edm", **cfg["diffuser"]})
    except (KeyError, TypeError) as e:
        raise UserError(f"checkpoint {source} has an incomplete model/diffuser config ({e!r} missing)") from None
    load_model_state(model, state["ema"], source)
    model.requires_grad_(False).eval()
    net = build_denoiser(diffuser, model).to(device).eval()
    return net, cfg


def load_sampling_net(ckpt_path, device="cpu"):
    """(EMA denoiser `EDMPrecond` in eval mode on `device`, the run's resolved config as a dict).

    `ckpt_path` is a checkpoint file or a run directory (its newest checkpoint). Missing, corrupt or
    foreign checkpoints raise a one-line `UserError`.
    """
    path = resolve_checkpoint(ckpt_path)
    return net_from_state(read_checkpoint(path), path, device)


def read_checkpoint(path) -> dict:
    """`load_checkpoint`, with advice for sampling rather than for resuming a run."""
    return load_checkpoint(path, advice=SAMPLING_ADVICE)
