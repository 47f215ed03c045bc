"""Random-access reader for precomputed VAE latents: webdataset tar shards or .npy shard pairs.

Formats found under a directory (searched recursively) or given as one file:
  * `*.tar` in the webdataset layout of the official TREAD code: per sample `<key>.latent.npy` (np.save
    bytes) and `<key>.cls` (ascii int). Each tar is indexed once from its headers (member offsets and
    sizes, no data read); the index is cached in memory and in a `<shard>.tar.idx.npz` sidecar when the
    folder is writable (validated by the shard's size and mtime). Each process (the trainer, every
    DataLoader worker) opens a shard once, on its first read of it, and keeps the descriptor.
  * `<stem>.latents.npy` [n, ...] with `<stem>.labels.npy` [n], memory-mapped.
Per-sample arrays: [C,H,W] a latent; [2C,H,W] posterior moments (mean, logvar) -> mean + std * eps with
`posterior_sampling`, else the mean; [2,C,H,W] / [2,2C,H,W] the image and its horizontal flip (index 1) ->
one chosen at random with `random_flip`, else the image. Any dtype is read as float32 and multiplied by the
scale: `scale_factor` when given, else manifest.json's (our extraction stores unscaled VAE output), else
one measured from the data (`decide_scale`): the authors' shards hold latents already multiplied by
0.18215, and a second multiplication would pass unseen.
With `with_images` (REPA's teacher on latents) a sample is (latent, label, image): tar shards written by
`extract_latents --images` hold `<key>.png`, the centre crop, returned as uint8 [3, R, R] and flipped with
its latent; shards without them are refused in one line.
Sample i (any non-negative int) is sample i % N of epoch i // N; its randomness comes only from
(seed, epoch, i % N), so reads are reproducible whatever the worker layout - exact resume needs only i.
"""
import bisect
import contextlib
import io
import json
import operator
import os
import tarfile

import numpy as np
import torch
from PIL import Image

from data.vae import LOGVAR_MIN, LOGVAR_MAX, SD_VAE_SCALE
from tread_utils.errors import UserError

LATENT_EXT, LABEL_EXT, IMAGE_EXT = ".latent.npy", ".cls", ".png"
NPY_LATENTS, NPY_LABELS = ".latents.npy", ".labels.npy"
SIDECAR_EXT = ".idx.npz"
SCALE_PROBE = 256          # samples whose std decides the scale of shards without a manifest
UNSCALED_STD = 2.3         # between ~1 (scaled SD-VAE latents) and ~5.5 (unscaled: 1 / 0.18215)
REEXTRACT = "re-create it with `python -m data.extract_latents` (complete shards are kept)"


def open_shard(path):
    """A read-only descriptor of `path` (module level so tests can count the opens)."""
    return os.open(path, os.O_RDONLY)


def _read_at(fd, path, *ranges):
    """The bytes of each (offset, size) range of the open file `fd` (pread: no shared file position)."""
    chunks = []
    try:
        for offset, size in ranges:
            chunks.append(os.pread(fd, size, offset))
            if len(chunks[-1]) != size:
                raise UserError(f"{path}: file is truncated (wanted {size} bytes at offset {offset}); {REEXTRACT}")
    except OSError as e:
        raise UserError(f"{path}: cannot read ({e.strerror or e}); check the file and its permissions") from None
    return chunks


def _npy_shape(fd, path, offset, size, key):
    """Shape of an .npy stored at [offset, offset+size) of `path`, from its header only."""
    f = io.BytesIO(_read_at(fd, path, (offset, min(size, 4096)))[0])
    try:
        version = np.lib.format.read_magic(f)
        if version == (1, 0):
            shape = np.lib.format.read_array_header_1_0(f)[0]
        elif version == (2, 0):
            shape = np.lib.format.read_array_header_2_0(f)[0]
        else:  # rare header versions: read the whole (small) array instead
            f = io.BytesIO(_read_at(fd, path, (offset, size))[0])
            shape = np.lib.format.read_array(f, allow_pickle=False).shape
    except (ValueError, EOFError) as e:
        raise UserError(f"{path}: sample {key} is not a valid .npy ({e}); {REEXTRACT}") from None
    return tuple(shape)


@contextlib.contextmanager
def reading_tar(path):
    """A tar shard that cannot be read, as one line."""
    try:
        yield
    except (tarfile.TarError, OSError, EOFError) as e:
        raise UserError(f"{path}: unreadable tar shard ({e}); {REEXTRACT}") from None


def index_tar(path):
    """(rows int64 [n, 6] = latent offset, latent size, cls offset, cls size, image offset, image size (-1, 0:
    none); keys) from the tar headers."""
    found, order = {}, []
    with reading_tar(path):
        file_size = os.path.getsize(path)
        with tarfile.open(path, "r:") as tf:
            for m in tf:
                if not m.isfile():
                    continue
                head, base = os.path.split(m.name)
                stem, _, ext = base.partition(".")
                ext = "." + ext
                if ext not in (LATENT_EXT, LABEL_EXT, IMAGE_EXT):
                    continue
                if m.offset_data + m.size > file_size:
                    raise tarfile.ReadError(f"member {m.name} runs past the end of the file")
                key = f"{head}/{stem}" if head else stem
                if key not in found:
                    found[key] = {}
                    order.append(key)
                found[key][ext] = (m.offset_data, m.size)
    rows = np.zeros((len(order), 6), dtype=np.int64)
    for j, key in enumerate(order):
        parts = found[key]
        if LATENT_EXT not in parts or LABEL_EXT not in parts:
            raise UserError(f"{path}: sample {key} lacks its {LATENT_EXT} or {LABEL_EXT} member; {REEXTRACT}")
        rows[j] = (*parts[LATENT_EXT], *parts[LABEL_EXT], *parts.get(IMAGE_EXT, (-1, 0)))
    return rows, np.array(order, dtype=str)


class _TarShard:
    def __init__(self, path, count=None):
        self.path, self.count, self._rows, self._keys, self._file = path, count, None, None, None
        if count is None:
            self._index()

    def _fd(self):
        """This process's descriptor of the shard, opened on first use and kept (reopening per sample costs
        an open and a close per read). A DataLoader worker forked after the parent opened it must not read
        through the parent's: it opens its own, and leaves the inherited one alone."""
        if self._file is None or self._file[0] != os.getpid():
            try:
                self._file = (os.getpid(), open_shard(self.path))
            except OSError as e:
                raise UserError(f"{self.path}: cannot open ({e.strerror or e}); check the file and its "
                                f"permissions (or raise `ulimit -n` for many shards)") from None
        return self._file[1]

    def close(self):
        if self._file is not None and self._file[0] == os.getpid():
            os.close(self._file[1])
        self._file = None

    def __del__(self):
        self.close()

    def __getstate__(self):  # a descriptor means nothing in another process
        return dict(self.__dict__, _file=None)

    def _stat(self):
        st = os.stat(self.path)
        return np.array([st.st_size, st.st_mtime_ns], dtype=np.int64)

    def _index(self):
        if self._rows is not None:
            return self._rows, self._keys
        stat, sidecar = self._stat(), self.path + SIDECAR_EXT
        try:
            with np.load(sidecar, allow_pickle=False) as z:
                if np.array_equal(z["stat"], stat) and z["rows"].shape[1:] == (6,):  # (4,): before images
                    self._rows, self._keys = z["rows"], z["keys"]
        except (OSError, ValueError, KeyError, EOFError):
            pass
        if self._rows is None:
            self._rows, self._keys = index_tar(self.path)
            tmp = f"{sidecar}.tmp{os.getpid()}"
            try:  # best effort: a read-only dataset folder simply re-indexes next time
                with open(tmp, "wb") as f:
                    np.savez(f, stat=stat, rows=self._rows, keys=self._keys)
                os.replace(tmp, sidecar)
            except OSError:
                if os.path.exists(tmp):
                    os.remove(tmp)
        if self.count is not None and self.count != len(self._rows):
            raise UserError(f"{self.path} holds {len(self._rows)} samples but manifest.json says {self.count}; "
                            f"delete the stale manifest.json or re-extract")
        self.count = len(self._rows)
        return self._rows, self._keys

    def first_shape(self):
        if self._rows is not None:
            if not self.count:
                return None
            return _npy_shape(self._fd(), self.path, self._rows[0, 0], self._rows[0, 1], self._keys[0])
        with reading_tar(self.path), tarfile.open(self.path, "r:") as tf:  # count from the manifest: first headers
            for m in tf:
                if m.isfile() and m.name.endswith(LATENT_EXT):
                    return _npy_shape(self._fd(), self.path, m.offset_data, m.size, m.name)
        return None

    def has_images(self) -> bool:
        return self.count == 0 or bool((self._index()[0][:, 4] >= 0).all())

    def read(self, j, image=False):
        """(latent array, label, key), and with `image` the stored crop uint8 [R, R, 3] last."""
        rows, keys = self._index()
        lat_off, lat_size, cls_off, cls_size, img_off, img_size = (int(v) for v in rows[j])
        key = str(keys[j])
        ranges = [(lat_off, lat_size), (cls_off, cls_size)] + ([(img_off, img_size)] if image else [])
        data = _read_at(self._fd(), self.path, *ranges)
        try:
            arr = np.lib.format.read_array(io.BytesIO(data[0]), allow_pickle=False)
            label = int(data[1].decode("ascii").strip())
            if image:
                with Image.open(io.BytesIO(data[2])) as im:
                    return arr, label, key, np.asarray(im.convert("RGB"))
        except (ValueError, EOFError, UnicodeDecodeError, OSError) as e:
            raise UserError(f"{self.path}: sample {key} is corrupt ({e}); {REEXTRACT}") from None
        return arr, label, key


class _NpyShard:
    def __init__(self, path):
        self.path, self.label_path, self._maps = path, path[: -len(NPY_LATENTS)] + NPY_LABELS, None
        lat, lab = self._open()
        if lat.ndim < 2 or lab.ndim != 1 or lab.shape[0] != lat.shape[0]:
            raise UserError(f"{path} {list(lat.shape)} and {self.label_path} {list(lab.shape)} do not pair up "
                            f"(want latents [n, ...] and labels [n]); fix or re-create the pair")
        self.count = lat.shape[0]

    def _open(self):
        if self._maps is None or self._maps[0] != os.getpid():
            arrays = []
            for p in (self.path, self.label_path):
                try:
                    arrays.append(np.load(p, mmap_mode="r", allow_pickle=False))
                except (OSError, ValueError, EOFError) as e:
                    why = (f"an unreadable .npy ({e}); re-create the file" if os.path.isfile(p) else
                           f"missing; every *{NPY_LATENTS} needs its *{NPY_LABELS} next to it")
                    raise UserError(f"{p} is {why}") from None
            self._maps = (os.getpid(), *arrays)
        return self._maps[1], self._maps[2]

    def __getstate__(self):  # never pickle a memory map (that would copy the data to each worker)
        return dict(self.__dict__, _maps=None)

    def first_shape(self):
        return tuple(self._open()[0].shape[1:]) if self.count else None

    def read(self, j):
        lat, lab = self._open()
        return lat[j], int(lab[j]), f"#{j}"


def _find_shards(path):
    if os.path.isfile(path):
        if path.endswith(".tar"):
            return [path], []
        if path.endswith(NPY_LATENTS):
            return [], [path]
        raise UserError(f"{path} is not a latent shard (want a .tar or a *{NPY_LATENTS}) or a folder of them")
    tars, npys = [], []
    for root, dirs, files in os.walk(path, followlinks=True):
        dirs.sort()
        for name in sorted(files):
            if name.endswith(".tar"):
                tars.append(os.path.join(root, name))
            elif name.endswith(NPY_LATENTS):
                npys.append(os.path.join(root, name))
    return tars, npys


def _read_manifest(path):
    """manifest.json beside the shards (written by `python -m data.extract_latents`), or None when there is none.
    One that cannot be read or parsed is refused: taken for absent, its scale and VAE would be replaced by
    defaults unseen."""
    root = path if os.path.isdir(path) else os.path.dirname(path)
    file = os.path.join(root, "manifest.json")
    if not os.path.exists(file):
        return None
    try:
        with open(file) as f:
            manifest = json.load(f)
    except (OSError, ValueError) as e:
        raise UserError(f"{file} cannot be read ({type(e).__name__}: {e}); fix it, or rewrite it by running "
                        f"python -m data.extract_latents again on the same folders (it resumes)") from None
    if not isinstance(manifest, dict):
        raise UserError(f"{file} holds a {type(manifest).__name__}, not the mapping data.extract_latents writes")
    return manifest


def _manifest_counts(path, tars, manifest):
    """{tar path: count} from manifest.json when it lists exactly these tars with matching sizes, else {}."""
    root = path if os.path.isdir(path) else os.path.dirname(path)
    try:
        entries = {os.path.normpath(os.path.join(root, s["name"])): s for s in manifest["shards"]}
        counts = {}
        for t in tars:
            s = entries[os.path.normpath(t)]
            if int(s["bytes"]) != os.path.getsize(t):
                return {}
            counts[t] = int(s["count"])
        return counts
    except (OSError, ValueError, KeyError, TypeError):
        return {}


def decide_scale(scale_factor, manifest, probe_std) -> tuple:
    """(scale, the one line that says why). `probe_std()` measures the stored latents when it is needed."""
    if scale_factor is not None:
        return float(scale_factor), f"scale {float(scale_factor):g} (dataset.scale_factor)"
    if manifest is not None and "scale_factor" in manifest:
        scale = 1.0 if manifest.get("scaled") else float(manifest["scale_factor"])
        return scale, f"scale {scale:g} from manifest.json (stored latents are {'' if manifest.get('scaled') else 'un'}scaled)"
    std = probe_std()
    if std > UNSCALED_STD:
        return SD_VAE_SCALE, (f"no manifest.json: the stored latents have std {std:.2f}, like unscaled SD-VAE output, "
                              f"so they are multiplied by {SD_VAE_SCALE} (set dataset.scale_factor to override)")
    return 1.0, (f"no manifest.json: the stored latents have std {std:.2f}, like latents already multiplied by "
                 f"{SD_VAE_SCALE} (the authors' shards), so they are used as stored (set dataset.scale_factor to override)")


def _seed(seed, epoch, idx):
    state = np.random.SeedSequence([seed & (2**64 - 1), epoch, idx]).generate_state(2, dtype=np.uint32)
    return (int(state[0]) << 31) ^ int(state[1])


class LatentShardDataset(torch.utils.data.Dataset):
    """(latent float32 [in_channels, input_size, input_size] * scale, int label) per index, and with
    `with_images` the stored crop last, uint8 [3, R, R], flipped when the latent is.

    The defaults are the authors' data path: one fixed latent per image (no posterior sampling, no flip).
    `scale_note` says which scale was applied and why (the trainer prints it)."""

    def __init__(self, path, in_channels, input_size, num_classes, scale_factor=None, random_flip=False,
                 posterior_sampling=False, seed=0, with_images=False):
        path = os.fspath(path)
        if not os.path.exists(path):
            raise UserError(f"latent data path {path} does not exist; point it at the output of `python -m data.extract_latents`")
        self.path, self.in_channels, self.input_size = path, int(in_channels), int(input_size)
        self.num_classes, self.scale_factor = int(num_classes), 1.0
        self.random_flip, self.posterior_sampling, self.seed = bool(random_flip), bool(posterior_sampling), int(seed)
        self.with_images = bool(with_images)
        tars, npys = _find_shards(path)
        if not tars and not npys:
            raise UserError(f"no latent shards found under {path} (searched recursively for *.tar and "
                            f"*{NPY_LATENTS} + *{NPY_LABELS}); run `python -m data.extract_latents` or fix the path")
        manifest = _read_manifest(path)
        counts = _manifest_counts(path, tars, manifest)
        shards = [_TarShard(p, counts.get(p)) for p in tars] + [_NpyShard(p) for p in npys]
        self.shards = sorted(shards, key=lambda s: s.path)
        for s in self.shards:
            shape = s.first_shape()
            if shape is not None:
                self._layout(shape, s.path)
        if self.with_images:
            bare = next((s.path for s in self.shards if not isinstance(s, _TarShard) or not s.has_images()), None)
            if bare is not None:
                raise UserError(f"{bare} holds no images (<key>{IMAGE_EXT}), which REPA's teacher needs on latents; "
                                f"re-extract with `python -m data.extract_latents SOURCE OUT --images`, or "
                                f"repa.enabled=false")
        self._ends = np.cumsum([s.count for s in self.shards]).tolist()
        if self._ends[-1] == 0:
            raise UserError(f"the latent shards under {path} hold no samples; re-run `python -m data.extract_latents`")
        self.scale_factor, self.scale_note = decide_scale(scale_factor, manifest, self._stored_std)

    def _stored_std(self) -> float:
        """The std of the first SCALE_PROBE stored latents (posterior means, unflipped), as stored."""
        probe = [self._stored_latent(i) for i in range(min(SCALE_PROBE, len(self)))]
        return float(np.std(np.stack(probe)))

    def _locate(self, idx, image=False):
        """(shard, latent array, label, key, layout), and with `image` the crop last."""
        k = bisect.bisect_right(self._ends, idx)
        shard = self.shards[k]
        j = idx - (self._ends[k - 1] if k else 0)
        found = shard.read(j, image=True) if image else shard.read(j)
        arr, key = found[0], found[2]
        return (shard, arr, found[1], key, self._layout(arr.shape, f"{shard.path} sample {key}"), *found[3:])

    def _stored_latent(self, idx):
        _, arr, _, _, layout = self._locate(idx)
        return np.asarray(arr[0] if layout.startswith("pair") else arr, dtype=np.float32)[: self.in_channels]

    def _layout(self, shape, where):
        c, s = self.in_channels, self.input_size
        layouts = {(c, s, s): "latent", (2 * c, s, s): "moments", (2, c, s, s): "pair", (2, 2 * c, s, s): "pair_moments"}
        if tuple(shape) not in layouts:
            raise UserError(f"{where}: stored latent shape {list(shape)} does not fit in_channels={c}, input_size={s} "
                            f"([{c},{s},{s}], [{2 * c},{s},{s}] moments, or [2,...] flip pairs of those); match "
                            f"dataset.in_channels/input_size to the data or re-extract")
        return layouts[tuple(shape)]

    def __len__(self):
        return self._ends[-1]

    def close(self):
        """Close this process's shard descriptors (also done when the dataset is garbage-collected)."""
        for shard in self.shards:
            if isinstance(shard, _TarShard):
                shard.close()

    def __getitem__(self, i):
        i = operator.index(i)
        if i < 0:
            raise IndexError(f"LatentShardDataset index must be non-negative, got {i}")
        epoch, idx = divmod(i, len(self))
        shard, arr, label, key, layout, *image = self._locate(idx, self.with_images)
        if not 0 <= label < self.num_classes:
            raise UserError(f"{shard.path}: sample {key} has label {label} outside [0, {self.num_classes}); "
                            f"set num_classes to the dataset's class count or fix the labels")
        g = torch.Generator().manual_seed(_seed(self.seed, epoch, idx))
        flip = bool(torch.randint(0, 2, (1,), generator=g).item()) and self.random_flip  # always drawn
        if layout.startswith("pair"):
            arr = arr[int(flip)]
        x = np.array(arr, dtype=np.float32)  # a copy: never a view of a memory map
        if flip and not layout.startswith("pair"):
            x = x[..., ::-1]
        if layout.endswith("moments"):  # numpy math: torch's intra-op threads only slow down such small ops
            mean, logvar = x[: self.in_channels], x[self.in_channels:]
            x = mean
            if self.posterior_sampling:
                eps = torch.randn(mean.shape, generator=g).numpy()
                x = mean + np.exp(0.5 * np.clip(logvar, LOGVAR_MIN, LOGVAR_MAX)) * eps
        latent = torch.from_numpy(np.ascontiguousarray(x * np.float32(self.scale_factor)))
        if not self.with_images:
            return latent, label
        crop = image[0][:, ::-1] if flip else image[0]  # [R, R, 3]: flip the width axis, as the latent's pair
        return latent, label, torch.from_numpy(np.ascontiguousarray(crop.transpose(2, 0, 1)))
