"""Exported models: a run's EMA weights as ``model.safetensors`` and a ``config.json``, the Hugging Face layout.

``config.json`` holds DiT's constructor arguments at the top level (what ``DiT.from_pretrained`` reads:
sizes, routes, init) and, under ``"tread"``, what sampling needs besides the backbone: the registry name,
the diffuser and its constants (``sigma_data``, ``P_mean``, ``P_std``), the data (shape, classes, kind and
the latent scale its decoder uses), the class-dropout probability (classifier-free guidance) and the step.
Reading one uses ``json`` and safetensors only: nothing in the folder is unpickled.
"""
import json
import os
from pathlib import Path

import torch

from data.vae import SD_VAE_SCALE
from dit import dit_defaults, get_model, model_kwargs
from tread_utils.errors import UserError
from tread_utils.hub import CONFIG_NAME, WEIGHTS_NAME, check_matches, read_config, read_weights, weight_shapes

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
        "format": FORMAT, "format_version": FORMAT_VERSION, "run_name": run_cfg.get("run_name"), "step": int(step),
        "backbone_type": run_cfg["model"]["backbone_type"],
        "diffuser": {"name": "edm", **run_cfg["diffuser"]},
        "dataset": dataset,
        "data": {"shape": [params["in_channels"], params["input_size"], params["input_size"]],
                 "latent_scale": LATENT_SCALES.get(kind)},
        "class_drop_prob": run_cfg.get("train", {}).get("general", {}).get("class_drop_prob"),
    }


def dit_arguments(run_cfg: dict) -> dict:
    """Every argument of `DiT` for the run's model (defaults written out too, so the file alone rebuilds it)."""
    defaults = dit_defaults()
    chosen = model_kwargs(run_cfg["model"]["backbone_type"], run_cfg["model"]["params"])  # checked
    chosen["routes"] = [dict(r) for r in run_cfg["model"]["params"].get("routes") or []]  # as configured
    return json.loads(json.dumps({**defaults, **chosen, "grad_checkpointing": False}))  # plain JSON values


def model_card(config: dict, parameters: int) -> str:
    """README.md of an export: what the model is, how it was trained, how to sample and fine-tune it."""
    tread, routes = config["tread"], config["routes"]
    data, dataset = tread["data"], tread["dataset"]
    route_text = "; ".join(f"{r['selection_ratio']} of the tokens skip blocks {r['start_layer_idx']} to "
                           f"{r['end_layer_idx']}, {r.get('selection', 'random')} selection" for r in routes)
    trained = (f"with TREAD token routing ({route_text})" if config["enable_routing"] and routes
               else "without token routing (a plain DiT)")
    guidance = tread.get("class_drop_prob") or 0
    return f"""---
library_name: tread
tags: [diffusion, tread, dit]
---

# {tread['backbone_type']} ({tread.get('run_name') or 'exported run'}, step {tread['step']:,})

A class-conditional diffusion transformer ({parameters:,} parameters: depth {config['depth']}, width \
{config['hidden_size']}, {config['num_heads']} heads, patch size {config['patch_size']}) on \
{data['shape'][0]} x {data['shape'][1]} x {data['shape'][2]} {dataset.get('kind', 'latent')} inputs with \
{config['num_classes']} classes, trained for {tread['step']:,} steps {trained}; these are the EMA weights. \
Diffuser: {tread['diffuser']['name']} (sigma_data {tread['diffuser'].get('sigma_data')}). \
{'Trained with class dropout ' + str(guidance) + ', so classifier-free guidance applies.' if guidance else
 'Trained without class dropout: sample it unguided.'} \
Routing acts in training only: sampling runs every token through every block.

Made with the TREAD reference implementation ("TREAD: Token Routing for Efficient Architecture-agnostic
Diffusion Training", https://arxiv.org/abs/2501.04765).

## Sample

`MODEL_DIR` is this folder (from the Hub: `hf download OWNER/NAME --local-dir MODEL_DIR`).

```bash
python sample.py ckpt=MODEL_DIR num_samples=64 out=samples.npz grid=grid.png
```

## Load

```python
from dit import DiT
model = DiT.from_pretrained("MODEL_DIR")   # the backbone; training.checkpoint.load_sampling_net gives the denoiser
```

## Fine-tune

```bash
accelerate launch train.py model=dit init_from=MODEL_DIR run_name=my-fine-tune
```
"""


def write_export(ema, run_cfg: dict, step: int, out) -> Path:
    """``ema`` (the run's DiT with the EMA weights) -> ``out``/{config.json, model.safetensors, README.md}."""
    out = Path(out)
    config = {**dit_arguments(run_cfg), "tread": tread_section(run_cfg, step)}
    out.mkdir(parents=True, exist_ok=True)
    card = model_card(config, sum(p.numel() for p in ema.parameters()))
    (out / "README.md").write_text(card)  # written first: save_pretrained keeps an existing card
    ema.save_pretrained(out, config=config)
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


def read_export(folder, header_only: bool = False) -> ExportedState:
    """An exported folder as a checkpoint-like dict: ``step``, ``config`` (shaped like a run config: model,
    diffuser, dataset, train.general.class_drop_prob), ``ema`` and ``model`` (the same EMA tensors; with
    `header_only`, their shapes, read from the file's header: the same checks without loading the weights)."""
    folder = Path(folder)
    config = read_config(folder / CONFIG_NAME)
    tread = config.get("tread")
    if not isinstance(tread, dict) or tread.get("format") != FORMAT:
        raise UserError(f"{folder}/{CONFIG_NAME} has no '\"tread\": {{\"format\": \"{FORMAT}\"}}' entry: not a model "
                        f"exported by this project (python -m tools.export RUN_DIR --out DIR)")
    try:
        params = {k: v for k, v in config.items() if k != "tread"}
        run_cfg = {"run_name": tread.get("run_name"), "model": {"backbone_type": tread["backbone_type"], "params": params},
                   "diffuser": dict(tread["diffuser"]), "dataset": dict(tread["dataset"]),
                   "train": {"general": {"class_drop_prob": tread.get("class_drop_prob")}}}
        step = int(tread["step"])
    except (KeyError, TypeError, ValueError) as e:
        raise UserError(f"{folder}/{CONFIG_NAME} is incomplete ({e!r}); export the run again") from None
    tensors = (weight_shapes if header_only else read_weights)(folder / WEIGHTS_NAME)
    with torch.device("meta"):  # names and shapes only: no memory for a second copy of the weights
        skeleton = get_model(run_cfg["model"]["backbone_type"], params, where=str(folder / CONFIG_NAME))
    check_matches(skeleton.state_dict(), tensors, folder)
    state = ExportedState(step=step, config=run_cfg, ema=tensors, model=tensors)
    state.source = folder
    return state
