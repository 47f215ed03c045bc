"""Files from the Hugging Face Hub and other downloads: whether a download can be tried at all (answered in a
few seconds: an offline cluster node otherwise spends half a minute in the hub client's retries before
failing), and published models, a local folder or a Hub repository through its cache.

Exported models are a folder with ``config.json`` and ``model.safetensors`` (``python -m tools.export``).
The weights are read with safetensors only: nothing in such a folder is unpickled.
"""
from __future__ import annotations

import contextlib
import json
import os
import socket
from pathlib import Path
from urllib.parse import urlparse

from tread_utils.errors import UserError

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
EXPORT_HINT = "write one with: python -m tools.export RUN_DIR --out DIR"

TRUE = ("1", "true", "yes", "on")
HUB_OFFLINE_ENVS = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
CONNECT_TIMEOUT_S = 3.0


def marked_offline(envs=HUB_OFFLINE_ENVS) -> str:
    """The first of `envs` set to a true value ('HF_HUB_OFFLINE'), or ''."""
    return next((k for k in envs if os.environ.get(k, "").strip().lower() in TRUE), "")


def unreachable(url: str, timeout: float = CONNECT_TIMEOUT_S) -> str:
    """'' when a TCP connection to `url`'s host opens within `timeout` seconds, else why not (one phrase)."""
    parsed = urlparse(url)
    if not parsed.hostname:
        return f"{url} names no host"
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    try:
        with socket.create_connection((parsed.hostname, port), timeout=timeout):
            return ""
    except OSError as e:
        return f"{parsed.hostname} cannot be reached ({e.strerror or type(e).__name__})"


def hub_unavailable() -> str:
    """'' when the Hugging Face hub can be tried, else why not: HF_HUB_OFFLINE=1, or no connection."""
    env = marked_offline()
    if env:
        return f"{env}=1"
    return unreachable(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))


def is_exported_folder(path) -> bool:
    path = Path(str(path)).expanduser()
    return path.is_dir() and (path / CONFIG_NAME).is_file() and (path / WEIGHTS_NAME).is_file()


@contextlib.contextmanager
def hub_errors_as_user_errors(model_id):
    """A Hub repository that cannot be had (no network and not cached, unknown repository or file) becomes
    one line saying what to download."""
    from huggingface_hub.errors import (EntryNotFoundError, HfHubHTTPError, HFValidationError, LocalEntryNotFoundError,
                                        OfflineModeIsEnabled, RepositoryNotFoundError)

    try:
        yield
    except (EntryNotFoundError, OfflineModeIsEnabled, HfHubHTTPError, HFValidationError, OSError) as e:
        fix = (f"where there is a network run `hf download {model_id} --local-dir DIR` and pass DIR (an exported "
               f"model folder: {EXPORT_HINT})")
        if isinstance(e, (LocalEntryNotFoundError, OfflineModeIsEnabled)):
            why = "not in the Hub cache and not downloaded (offline, or the Hub cannot be reached)"
        elif isinstance(e, RepositoryNotFoundError):
            why = "no such repository on the Hub (or it is private: log in with `hf auth login`)"
        elif isinstance(e, HFValidationError):
            why = "neither a folder nor a Hub repository id (owner/name)"
            fix = f"give an exported model folder ({EXPORT_HINT}) or a repository id"
        else:
            why = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:120] if str(e).strip() else ''}"
        raise UserError(f"cannot load {model_id}: {why}; {fix}") from None


def refuse_missing_folder(model_id) -> None:
    """A name that means a local folder but names none is one line at once, not a Hub download attempt: a path
    (absolute, ~, ./, ../, or more than one /), or owner/name where `owner` is a local folder."""
    text = str(model_id)
    path = Path(text).expanduser()
    if path.exists():
        return
    if text.startswith(("/", "~", ".")) or text.count("/") != 1 or "\\" in text or path.parent.is_dir():
        near = sorted(p.name for p in path.parent.iterdir() if p.is_dir())[:8] if path.parent.is_dir() else []
        raise UserError(f"no such folder: {text}" + (f" ({path.parent} holds: {', '.join(near)})" if near else "")
                        + f"; give an exported model folder ({EXPORT_HINT}) or a Hub repository id owner/name")


def model_file(model_id, filename: str, **hub_kwargs) -> Path:
    """``filename`` of an exported folder, or of a Hub repository (downloaded into the cache, or read from
    it when offline)."""
    folder = Path(str(model_id)).expanduser()
    if folder.is_dir():
        path = folder / filename
        if not path.is_file():
            raise UserError(f"{folder} is not an exported model folder: it has no {filename} "
                            f"(needs {CONFIG_NAME} and {WEIGHTS_NAME}; {EXPORT_HINT})")
        return path
    from huggingface_hub import hf_hub_download

    with hub_errors_as_user_errors(model_id):
        return Path(hf_hub_download(repo_id=str(model_id), filename=filename, **hub_kwargs))


def read_config(path) -> dict:
    try:
        config = json.loads(Path(path).read_text(encoding="utf-8"))
        problem = None if isinstance(config, dict) else f"a JSON {type(config).__name__}, not an object"
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        problem = str(e)
    if problem:
        raise UserError(f"{path} is not a readable JSON model config ({problem})")
    return config


@contextlib.contextmanager
def reading_safetensors(path):
    """A corrupt or truncated .safetensors file as one line."""
    from safetensors import SafetensorError

    try:
        yield
    except (SafetensorError, OSError, ValueError) as e:
        raise UserError(f"{path} cannot be read as safetensors ({str(e).splitlines()[0][:160]})") from None


def read_weights(path) -> dict:
    """The tensors of a .safetensors file (on the CPU)."""
    from safetensors.torch import load_file

    with reading_safetensors(path):
        return load_file(str(path), device="cpu")


def weight_shapes(path) -> dict:
    """{name: shape} from a .safetensors file's header alone (a truncated file is refused all the same)."""
    from safetensors import safe_open

    with reading_safetensors(path):
        with safe_open(str(path), "pt") as f:
            return {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}


def check_matches(own: dict, tensors: dict, source) -> None:
    """One line naming the first difference unless ``tensors`` (tensors, or shapes) has exactly the names and
    shapes of the state dict ``own`` (else the folder's config describes another model than its weights)."""
    def shape(value):
        return tuple(getattr(value, "shape", value))

    missing = sorted(set(own) - set(tensors))
    unexpected = sorted(set(tensors) - set(own))
    bad = [k for k in own if k in tensors and shape(own[k]) != shape(tensors[k])]
    if missing or unexpected or bad:
        detail = (f"{bad[0]} has shape {shape(tensors[bad[0]])}, the config's model expects "
                  f"{shape(own[bad[0]])}" if bad else f"missing {missing[:3]}, unexpected {unexpected[:3]}")
        raise UserError(f"{source}: its {CONFIG_NAME} does not match its {WEIGHTS_NAME} ({detail}); "
                        f"export the run again ({EXPORT_HINT})")


def load_exact(module, tensors: dict, source) -> None:
    check_matches(module.state_dict(), tensors, source)
    module.load_state_dict(tensors)
