"""Shared helpers of the evaluation suite: image batches in and feature batches out.

* :class:`NpzImages` - streams ``arr_0`` (or any key) of an .npz in batches without loading it whole.
* :func:`load_image_folder` - a folder of PNG/JPG files -> uint8 [N, H, W, 3] (PIL, RGB).
* :func:`compute_features` - runs a feature extractor (Inception, digits classifier, ...) over uint8
  NHWC images in batches and returns float32 numpy arrays ``pool``, ``spatial``, ``logits`` (or, for
  the evaluator, keeps them on the extractor's GPU, reduces sFID's to statistics and the logits to the
  Inception Score while they come).

Validation failures raise :class:`tread_utils.errors.UserError` with a one-line message.
"""
from __future__ import annotations

import zipfile
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from tqdm import tqdm

from evaluations.metrics import InceptionScoreSplits, RunningStatistics
from tread_utils.errors import UserError

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg")
FEATURE_KEYS = ("pool", "spatial", "logits")


# --------------------------------------------------------------------------------------------
# .npz reading
# --------------------------------------------------------------------------------------------
def _npy_header(f):
    version = np.lib.format.read_magic(f)
    if version == (1, 0):
        return np.lib.format.read_array_header_1_0(f)
    if version == (2, 0):
        return np.lib.format.read_array_header_2_0(f)
    return np.lib.format._read_array_header(f, version)  # version 3.0 (utf-8 header)


def open_npz(path) -> np.lib.npyio.NpzFile:
    """np.load of an .npz with one-line UserErrors for a missing file, a .npy or a non-npz file."""
    p = Path(path)
    if not p.is_file():
        raise UserError(f"{p} is a folder; expected an .npz file" if p.is_dir() else f"{p}: no such file")
    if not zipfile.is_zipfile(p):
        raise UserError(f"{p} is not an .npz file (expected an ADM batch: np.savez(path, arr_0=uint8 [N,H,W,3]))")
    try:
        return np.load(p, allow_pickle=False)
    except Exception as e:  # a zip that numpy cannot read
        raise UserError(f"{p} is not a readable .npz file ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None


class NpzImages:
    """Lazy view of one array of an .npz: ``shape``, ``dtype``, ``__len__`` and ``batches()``.

    Reads the array member of the zip in a stream, so a 50,000-image batch never sits in memory.
    """

    def __init__(self, path, key: str = "arr_0"):
        self.path, self.key = Path(path), key
        member = key + ".npy"
        try:
            with zipfile.ZipFile(self.path) as z:
                if member not in z.namelist():
                    raise KeyError(member)
                with z.open(member) as f:
                    self.shape, self.fortran_order, self.dtype = _npy_header(f)
        except KeyError:
            raise UserError(f"{self.path} has no '{key}' array") from None
        except (zipfile.BadZipFile, ValueError, OSError) as e:
            raise UserError(f"{self.path}: cannot read '{key}' ({e})") from None
        self.shape = tuple(int(s) for s in self.shape)

    def __len__(self):
        return self.shape[0] if self.shape else 0

    def batches(self, batch_size: int, limit: int | None = None):
        """Yield numpy arrays of up to ``batch_size`` rows, the first ``limit`` rows in all."""
        n = len(self) if limit is None else min(limit, len(self))
        if self.fortran_order or self.dtype.hasobject:
            data = np.load(self.path, allow_pickle=False)[self.key]
            for start in range(0, n, batch_size):
                yield np.ascontiguousarray(data[start:min(start + batch_size, n)])
            return
        row_items = int(np.prod(self.shape[1:], dtype=np.int64))
        row_bytes = row_items * self.dtype.itemsize
        with zipfile.ZipFile(self.path) as z, z.open(self.key + ".npy") as f:
            _npy_header(f)
            for start in range(0, n, batch_size):
                count = min(batch_size, n - start)
                buf = f.read(count * row_bytes)
                if len(buf) != count * row_bytes:
                    raise UserError(f"{self.path}: '{self.key}' is truncated")
                yield np.frombuffer(bytearray(buf), dtype=self.dtype).reshape((count,) + self.shape[1:])

    def read(self, limit: int | None = None) -> np.ndarray:
        n = len(self) if limit is None else min(limit, len(self))
        parts = list(self.batches(max(1, min(n, 4096)), n))
        return np.concatenate(parts) if parts else np.zeros((0,) + self.shape[1:], self.dtype)


def check_images(shape, dtype, name: str, finite_check=None):
    """UserError unless ``shape`` is [N, H, W, 3] and ``dtype`` uint8. ``finite_check`` is a callable
    returning False when a float array holds NaN/inf (reported before the dtype problem)."""
    dtype = np.dtype(dtype)
    if dtype.kind == "f" and finite_check is not None and not finite_check():
        raise UserError(f"{name} contains NaN or inf values; images must be uint8 [N, H, W, 3] in [0, 255]")
    if dtype != np.uint8:
        raise UserError(f"{name} has dtype {dtype}, expected uint8 images [N, H, W, 3] in [0, 255] "
                        f"(convert with np.clip(np.round(x), 0, 255).astype(np.uint8))")
    if len(shape) != 4 or shape[-1] != 3:
        raise UserError(f"{name} has shape {tuple(shape)}, expected [N, H, W, 3] (NHWC RGB)")
    if shape[0] < 1 or shape[1] < 1 or shape[2] < 1:
        raise UserError(f"{name} has shape {tuple(shape)}: it holds no images")


def npz_images(path, key: str = "arr_0", min_count: int | None = None, what: str = "images") -> NpzImages:
    """Validated lazy reader of ``key`` in an ADM .npz (uint8 [N, H, W, 3]); ``min_count`` images at least."""
    reader = NpzImages(path, key)
    name = f"{path} '{key}'"

    def finite():
        return all(np.isfinite(b).all() for b in reader.batches(4096))

    check_images(reader.shape, reader.dtype, name, finite)
    if min_count is not None and len(reader) < min_count:
        raise UserError(f"{name} holds {len(reader)} {what}, fewer than the {min_count} needed")
    return reader


def load_image_folder(folder) -> np.ndarray:
    """All PNG/JPG files under ``folder`` (recursive, sorted by path), as uint8 RGB [N, H, W, 3]."""
    folder = Path(folder)
    files = sorted(p for p in folder.rglob("*") if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES)
    if not files:
        raise UserError(f"{folder} holds no .png/.jpg images")
    images = []
    for p in files:
        try:
            with Image.open(p) as im:
                arr = np.asarray(im.convert("RGB"), dtype=np.uint8)
        except Exception as e:
            raise UserError(f"cannot read image {p}: {e}") from None
        if images and arr.shape != images[0].shape:
            raise UserError(f"{p} is {arr.shape[1]}x{arr.shape[0]} but {files[0]} is "
                            f"{images[0].shape[1]}x{images[0].shape[0]}; all images must have one size")
        images.append(arr)
    return np.stack(images)


def open_images(source, min_count: int | None = None):
    """A folder of images (-> uint8 array) or an .npz with ``arr_0`` (-> lazy NpzImages); ``min_count`` at least."""
    p = Path(source)
    if not p.is_dir():
        open_npz(p).close()  # file / format checks with clear messages
        return npz_images(p, min_count=min_count)
    images = load_image_folder(p)
    if min_count is not None and len(images) < min_count:
        raise UserError(f"{p} holds {len(images)} images, fewer than the {min_count} needed")
    return images


# --------------------------------------------------------------------------------------------
# Features
# --------------------------------------------------------------------------------------------
def _iter_batches(images, batch_size: int, limit: int | None):
    if isinstance(images, NpzImages):
        yield from images.batches(batch_size, limit)
        return
    n = len(images) if limit is None else min(limit, len(images))
    for start in range(0, n, batch_size):
        yield images[start:min(start + batch_size, n)]


def extractor_device(extractor) -> torch.device:
    try:
        return next(extractor.parameters()).device
    except (AttributeError, StopIteration):
        return torch.device("cpu")


def compute_features(extractor, images, batch_size: int = 64, limit: int | None = None, progress: bool = False,
                     desc: str = "features", keys=FEATURE_KEYS, stats_keys=(), inception_split: int | None = None,
                     on_device: bool = False) -> dict:
    """Run ``extractor`` (uint8 NHWC batch -> dict of [B, D] tensors) over ``images``.

    ``images``: uint8 [N, H, W, 3] numpy array or torch tensor (any device), or an :class:`NpzImages`.
    Batches of ``batch_size`` are moved to the extractor's device. Returns ``{key: float32 numpy
    [N, D]}`` for each of ``keys`` the extractor provides, except the ``stats_keys`` among them, whose
    features are not kept: ``{key + '_stats': (mu, sigma)}`` instead (sFID's 50,000 x 2023 features
    would otherwise take 400 MB of host memory for two statistics). With ``inception_split``, the
    logits are not kept either: ``'inception_score'`` (splits of that many, `InceptionScoreSplits`)
    instead of 200 MB of logits at 50,000. With ``on_device`` and an extractor on a GPU, the kept
    features are float32 tensors on that GPU instead of host arrays (the metrics take either).
    """
    total = len(images) if limit is None else min(limit, len(images))
    sinks = {}
    if inception_split is not None and "logits" in keys:
        sinks["logits"] = InceptionScoreSplits(inception_split, total)
    out, running = feature_pass(extractor, images, batch_size, limit, progress, desc, keys, stats_keys,
                                sinks=sinks, on_device=on_device)
    out.update({key + "_stats": r.result() for key, r in running.items() if r.n})
    if "logits" in sinks and sinks["logits"].n:
        out["inception_score"] = sinks["logits"].result()
    return out


def feature_pass(extractor, images, batch_size: int = 64, limit: int | None = None, progress: bool = False,
                 desc: str = "features", keys=FEATURE_KEYS, stats_keys=(), sinks=None, on_device: bool = False) -> tuple:
    """`compute_features` before its statistics are finished: ({key: float32 [N, D]}, {stats key:
    RunningStatistics}), so that the statistics of several processes' shares can be merged. ``sinks``:
    {key: object with ``update(float32 numpy [B, D])``} that take that key's features instead of keeping them."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    device = extractor_device(extractor)
    keep_on_device = on_device and device.type != "cpu"
    total = len(images) if limit is None else min(limit, len(images))
    out = {}
    running = {key: RunningStatistics() for key in stats_keys}
    sinks = {**(sinks or {}), **running}
    bar = None
    if progress:
        bar = tqdm(total=total, desc=desc, unit="img", dynamic_ncols=True)
    done = 0
    with torch.no_grad():
        for batch in _iter_batches(images, batch_size, limit):
            if not torch.is_tensor(batch):
                batch = torch.from_numpy(np.asarray(batch))
            result = extractor(batch.to(device))
            for key in keys:
                if key not in result:
                    continue
                value = result[key].detach().float().reshape(len(batch), -1)
                if key in sinks:
                    sinks[key].update(value.cpu().numpy())
                    continue
                if key not in out:
                    out[key] = (torch.empty((total, value.shape[1]), dtype=torch.float32, device=device)
                                if keep_on_device else np.empty((total, value.shape[1]), dtype=np.float32))
                out[key][done:done + len(batch)] = value.to(device) if keep_on_device else value.cpu().numpy()
            done += len(batch)
            if bar is not None:
                bar.update(len(batch))
    if bar is not None:
        bar.close()
    return out, running
