"""Exported models: a run's EMA weights as ``model.safetensors`` and a ``config.json``, the Hugging Face layout.

``config.json`` holds DiT's constructor arguments at the top level (what ``DiT.from_pretrained`` reads:
sizes, routes, init) and, under ``"tread"``, what sampling needs besides the backbone: the registry name,
the diffuser and its constants (``sigma_data``, ``P_mean``, ``P_std``), the data (shape, classes, kind and
the latent scale its decoder uses), the class-dropout probability (classifier-free guidance) and the step.
Reading one uses ``json`` and safetensors only: nothing in the folder is unpickled.
"""
import inspect
import json
import os
from pathlib import Path

import torch

from data.vae import SD_VAE_SCALE
from dit import DiT, get_model, model_kwargs
from tread_utils.errors import UserError
from tread_utils.hub import CONFIG_NAME, WEIGHTS_NAME, check_matches, read_config, read_weights

FORMAT = "tread-export"
FORMAT_VERSION = 1
# run config keys of `dataset` that say how to turn samples into images (never a local path)
DATASET_KEYS = ("name", "kind", "in_channels", "input_size", "num_classes", "quantize", "vae", "backbone_type")
LATENT_SCALES = {"shards": SD_VAE_SCALE, "digits": 1.0}  # what the decoder divides by (digits: pixels in [-1, 1])


def tread_section(run_cfg: dict, step: int) -> dict:
    """The ``"tread"`` entry of config.json, from a run's resolved config."""
    dataset = {k: v for k, v in run_cfg.get("dataset", {}).items() if k in DATASET_KEYS}
    params = run_cfg["model"]["params"]
    kind = dataset.get("kind")
    return {
        "format": FORMAT, "format_version": FORMAT_VERSION, "step": int(step),
        "backbone_type": run_cfg["model"]["backbone_type"],
        "diffuser": {"name": "edm", **run_cfg["diffuser"]},
        "dataset": dataset,
        "data": {"shape": [params["in_channels"], params["input_size"], params["input_size"]],
                 "latent_scale": LATENT_SCALES.get(kind)},
        "class_drop_prob": run_cfg.get("train", {}).get("general", {}).get("class_drop_prob"),
    }


def dit_arguments(run_cfg: dict) -> dict:
    """Every argument of `DiT` for the run's model (defaults written out too, so the file alone rebuilds it)."""
    defaults = {n: p.default for n, p in inspect.signature(DiT.__init__).parameters.items() if n != "self"}
    chosen = model_kwargs(run_cfg["model"]["backbone_type"], run_cfg["model"]["params"])  # checked
    chosen["routes"] = [dict(r) for r in run_cfg["model"]["params"].get("routes") or []]  # as configured
    return json.loads(json.dumps({**defaults, **chosen, "grad_checkpointing": False}))  # plain JSON values


def write_export(ema, run_cfg: dict, step: int, out) -> Path:
    """``ema`` (the run's DiT with the EMA weights) -> ``out``/{config.json, model.safetensors, README.md}."""
    out = Path(out)
    ema.save_pretrained(out, config={**dit_arguments(run_cfg), "tread": tread_section(run_cfg, step)})
    umask = os.umask(0)
    os.umask(umask)
    for path in out.iterdir():  # safetensors writes its file owner-only; a model to share gets the usual mode
        path.chmod(0o666 & ~umask)
    return out


class ExportedState(dict):
    """What `training.checkpoint.load_checkpoint` returns for an exported folder: the EMA weights as both
    ``model`` and ``ema``; asking for what a folder does not hold (the optimizer) is one line."""

    source = None

    def __missing__(self, key):
        raise UserError(f"{self.source} is an exported model: it holds the EMA weights only, no {key} state "
                        f"(start from it with init_from_optimizer=false, or use the run directory)")


def read_export(folder) -> ExportedState:
    """An exported folder as a checkpoint-like dict: ``step``, ``config`` (shaped like a run config: model,
    diffuser, dataset, train.general.class_drop_prob), ``ema`` and ``model`` (the same EMA tensors)."""
    folder = Path(folder)
    config = read_config(folder / CONFIG_NAME)
    tread = config.get("tread")
    if not isinstance(tread, dict) or tread.get("format") != FORMAT:
        raise UserError(f"{folder}/{CONFIG_NAME} has no '\"tread\": {{\"format\": \"{FORMAT}\"}}' entry: not a model "
                        f"exported by this project (python -m tools.export RUN_DIR --out DIR)")
    try:
        params = {k: v for k, v in config.items() if k != "tread"}
        run_cfg = {"model": {"backbone_type": tread["backbone_type"], "params": params},
                   "diffuser": dict(tread["diffuser"]), "dataset": dict(tread["dataset"]),
                   "train": {"general": {"class_drop_prob": tread.get("class_drop_prob")}}}
        step = int(tread["step"])
    except (KeyError, TypeError, ValueError) as e:
        raise UserError(f"{folder}/{CONFIG_NAME} is incomplete ({e!r}); export the run again") from None
    tensors = read_weights(folder / WEIGHTS_NAME)
    with torch.device("meta"):  # names and shapes only: no memory for a second copy of the weights
        skeleton = get_model(run_cfg["model"]["backbone_type"], params)
    check_matches(skeleton.state_dict(), tensors, folder)
    state = ExportedState(step=step, config=run_cfg, ema=tensors, model=tensors)
    state.source = folder
    return state
