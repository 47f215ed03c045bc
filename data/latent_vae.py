"""Which VAE decodes a latent dataset, found before anything runs.

Latents are only meaningful to the VAE that made them, and `python -m data.extract_latents` records it in
manifest.json. Decoding (the in-training FID, sample.py) therefore uses, in this order: the VAE the user
names (`dataset.vae`, sample.py's `vae=`: a local copy of the same weights, or a deliberate other choice),
the manifest's, and stabilityai/sd-vae-ft-ema (the authors' latents carry no manifest). `decoding_vae`
says which in one line, and refuses, in a few seconds, a VAE that cannot be had (not a diffusers folder,
not in the Hugging Face cache while the hub cannot be tried) or whose latents have another channel count
than the dataset's.
"""
import json
import os

from data.shards import _read_manifest
from data.vae import DEFAULT_VAE, vae_source
from tread_utils.errors import UserError
from tread_utils.hub import hub_unavailable

WEIGHT_FILES = ("diffusion_pytorch_model.safetensors", "diffusion_pytorch_model.bin")


def _get(cfg, key):
    return cfg.get(key) if cfg is not None else None


def manifest_vae(train_path):
    """The VAE manifest.json beside `train_path` names, or None (no manifest, or not reachable here)."""
    if not train_path or not os.path.exists(os.path.expanduser(str(train_path))):
        return None
    manifest = _read_manifest(os.path.expanduser(str(train_path)))
    vae = (manifest or {}).get("vae")
    return str(vae) if vae else None


def _hub_config(repo_id: str):
    """config.json of a repo id in the Hugging Face cache when its weights are there too, else None."""
    from huggingface_hub import try_to_load_from_cache

    config = try_to_load_from_cache(repo_id, "config.json")
    weights = [try_to_load_from_cache(repo_id, name) for name in WEIGHT_FILES]
    return config if isinstance(config, str) and any(isinstance(w, str) for w in weights) else None


def resolve_vae(name: str, option: str):
    """The path of `name`'s config.json when it is here, None when the hub will be asked for it; raises a
    UserError naming `option` (how the command is given a VAE) when it cannot be had."""
    path, is_folder = vae_source(str(name), f"{option}=DIR")
    if is_folder:
        return os.path.join(path, "config.json")
    config = _hub_config(path)
    if config is not None:
        return config
    why = hub_unavailable()
    if why:
        raise UserError(f"VAE weights for {name} are not in the Hugging Face cache and the hub cannot be tried "
                        f"({why}): `huggingface-cli download {name}` where there is network (HF_HOME shares the "
                        f"cache), or {option}=DIR, a diffusers VAE folder")
    return None


def decoding_vae(dataset_cfg, given=None, option: str = "dataset.vae"):
    """(VAE name or folder, the line that says which decodes and why) for a `shards` dataset config, found
    (see `resolve_vae`); (None, '') for datasets without a VAE. `given`: the command's own choice, spelt
    `option`; else `dataset.vae`."""
    if _get(dataset_cfg, "kind") != "shards":
        return None, ""
    train_path = _get(dataset_cfg, "train_path")
    made = manifest_vae(train_path)
    source = option
    if given is None and _get(dataset_cfg, "vae"):
        given, source = _get(dataset_cfg, "vae"), "the run's dataset.vae"
    if given:
        vae, note = str(given), f"decoding with VAE {given} ({source})"
        if made and made != vae:
            note += f"; the latents' manifest.json names {made}: the images are right only if both are the same weights"
    elif made:
        vae, note = made, f"decoding with VAE {made}, which made the latents (manifest.json of {train_path})"
    else:
        vae = DEFAULT_VAE
        note = (f"decoding with VAE {DEFAULT_VAE}: no manifest.json names the latents' VAE "
                f"({train_path or 'no dataset.train_path'}); {option}=... chooses another")
    config = resolve_vae(vae, option)
    channels = _get(dataset_cfg, "in_channels")
    if config is not None and channels is not None:
        try:
            with open(config) as f:
                vae_channels = json.load(f).get("latent_channels")
        except (OSError, ValueError):
            vae_channels = None
        if vae_channels is not None and int(vae_channels) != int(channels):
            raise UserError(f"VAE {vae} makes {vae_channels}-channel latents, the dataset's have {channels} "
                            f"(dataset.in_channels); set {option}= to the VAE that made them"
                            f"{f' ({made})' if made else ''}")
    return vae, note
