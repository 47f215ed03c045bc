"""Precompute SD-VAE latents of ImageNet (or any class-folder image set) into webdataset tar shards.

    python -m data.extract_latents /data/imagenet/train /data/latents256 [--resolution 256] [--vae ID_OR_DIR]
    accelerate launch --multi_gpu --num_processes 8 -m data.extract_latents /data/imagenet/train /data/latents256
    (CPU-only machine: `accelerate launch --multi_gpu --num_processes 2 -m data.extract_latents ... --cpu` runs two
     processes; `accelerate launch --cpu` starts a single one)
    python -m data.extract_latents convert-maskdit /data/imagenet_256_latent_lmdb/train /data/latents256

SOURCE is a folder with one sub-folder per class (classes sorted by name -> label 0, 1, ...) or a list
file of `path label` lines (relative paths are relative to the list file). Every image gets the ADM centre
crop, is converted to RGB and encoded together with its horizontal flip; the stored sample is the posterior
moments, float16 [2, 2C, h, w] = [original|flipped, mean channels + logvar channels, h, w], unscaled
(multiply samples by 0.18215). Shard format (webdataset, the layout of the official TREAD code):
    latents-000123.tar:  <key>.latent.npy  (np.save bytes of that array)   <key>.cls  (ascii int label)
                         [<key>.png  (with --images: the centre crop itself, lossless, unflipped)]
with key = the image's 8-digit index in the sorted item list. Item i belongs to shard i // shard_size and
shard k is written only by rank k % world_size, to `<name>.tar.partial`, renamed when complete, after its
done-marker `.progress/<name>.json` (count, bytes, skipped files). A re-run skips complete shards, so an
interrupted run is resumed by running the same command again. Rank 0 writes manifest.json at the end.
Unreadable images are skipped and listed in the manifest and the summary. `--images` also stores each crop,
for a teacher computed online from the clean image (REPA on latents: README, REPA); the trainer flips it
with its latent.
"""
import argparse
import hashlib
import io
import json
import os
import sys
import tarfile
import tempfile

import numpy as np
import torch
from PIL import Image

from data.vae import DEFAULT_VAE, SD_VAE_SCALE, encode_moments, load_sd_vae, vae_downsample_factor
from tread_utils.distributed import start_processes
from tread_utils.errors import UserError, report_user_errors
from tread_utils.files import ArgumentParser, positive_int

IMAGE_EXTS = (".jpg", ".jpeg", ".png", ".bmp", ".webp", ".tif", ".tiff", ".gif", ".ppm", ".pgm", ".pbm")
SHARD_PREFIX = "latents"
PROGRESS_DIR = ".progress"
FORMAT = "tread-latents-v1"
TARGET_SHARD_BYTES = 10**9


# ----------------------------------------------------------------------------------------------------
# Source images

def center_crop_arr(image: Image.Image, size: int) -> np.ndarray:
    """ADM centre crop: halve with BOX while the short side >= 2*size, BICUBIC to short side = size, crop."""
    while min(image.size) >= 2 * size:
        image = image.resize(tuple(s // 2 for s in image.size), resample=Image.Resampling.BOX)
    scale = size / min(image.size)
    image = image.resize(tuple(round(s * scale) for s in image.size), resample=Image.Resampling.BICUBIC)
    arr = np.asarray(image)
    top, left = (arr.shape[0] - size) // 2, (arr.shape[1] - size) // 2
    return arr[top:top + size, left:left + size]


def list_items(source):
    """([(path, label)], class names or None, root used for the relative paths in the manifest)."""
    source = os.path.abspath(os.fspath(source))
    if not os.path.exists(source):
        raise UserError(f"source {source} does not exist; pass an ImageNet-style folder or a `path label` list file")
    if os.path.isfile(source):
        root, items = os.path.dirname(source), []
        with open(source, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                line = line.strip()
                if not line or line.startswith("#"):
                    continue
                parts = line.rsplit(None, 1)
                if len(parts) != 2 or not parts[1].isdigit():
                    raise UserError(f"{source} line {n}: expected `path label` with a non-negative integer label")
                items.append((os.path.join(root, parts[0]), int(parts[1])))
        if not items:
            raise UserError(f"list file {source} names no images; write one `path label` line per image")
        return items, None, root
    classes = sorted(d.name for d in os.scandir(source) if d.is_dir() and not d.name.startswith("."))
    items = []
    for label, name in enumerate(classes):
        for dirpath, dirs, files in os.walk(os.path.join(source, name), followlinks=True):
            dirs.sort()
            items += [(os.path.join(dirpath, f), label) for f in sorted(files) if f.lower().endswith(IMAGE_EXTS)]
    if not items:
        raise UserError(f"no images found in {source}; expected one sub-folder per class holding "
                        f"{'/'.join(e[1:] for e in IMAGE_EXTS[:4])} files (or pass a `path label` list file)")
    return items, classes, source


class _Images(torch.utils.data.Dataset):
    """(centre crop uint8 [R, R, 3], label, index, error) - error is '' or why the file was skipped."""

    def __init__(self, items, resolution):
        self.items, self.resolution = items, resolution

    def __len__(self):
        return len(self.items)

    def __getitem__(self, j):
        index, path, label = self.items[j]
        try:
            with Image.open(path) as im:
                arr = center_crop_arr(im.convert("RGB"), self.resolution)
            return torch.from_numpy(np.array(arr, dtype=np.uint8)), label, index, ""
        except Exception as e:  # any decode failure (PIL raises many types) means: skip this file
            error = f"{type(e).__name__}: {e}"[:300]
            return torch.zeros(self.resolution, self.resolution, 3, dtype=torch.uint8), label, index, error


# ----------------------------------------------------------------------------------------------------
# Shards, markers, plan, manifest

def shard_name(k):
    return f"{SHARD_PREFIX}-{k:06d}.tar"


def _marker_path(out, k):
    return os.path.join(out, PROGRESS_DIR, shard_name(k)[:-4] + ".json")


def _write_json(path, obj):
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _read_json(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def shard_complete(out, k):
    """A shard is complete when its marker exists and its .tar has the size the marker recorded."""
    marker = _read_json(_marker_path(out, k))
    tar = os.path.join(out, shard_name(k))
    return marker is not None and os.path.isfile(tar) and os.path.getsize(tar) == marker.get("bytes")


class ShardWriter:
    """Writes one tar shard to `<name>.partial`; finish() writes the done-marker, then renames the tar."""

    def __init__(self, out, k):
        self.out, self.k, self.count, self.skipped, self.class_counts = out, k, 0, [], {}
        self.path = os.path.join(out, shard_name(k))
        self._file = open(self.path + ".partial", "wb")
        self._tar = tarfile.open(fileobj=self._file, mode="w", format=tarfile.USTAR_FORMAT)

    def _member(self, name, data):
        info = tarfile.TarInfo(name)
        info.size, info.mode, info.mtime = len(data), 0o444, 0
        self._tar.addfile(info, io.BytesIO(data))

    def add(self, key, latent, label, image=None):
        """image: the crop, uint8 [R, R, 3], stored as `<key>.png` (None: none stored)."""
        buf = io.BytesIO()
        np.save(buf, latent, allow_pickle=False)
        self._member(f"{key}.latent.npy", buf.getvalue())
        self._member(f"{key}.cls", str(int(label)).encode("ascii"))
        if image is not None:
            png = io.BytesIO()
            Image.fromarray(np.asarray(image)).save(png, format="PNG")
            self._member(f"{key}.png", png.getvalue())
        self.count += 1
        self.class_counts[str(int(label))] = self.class_counts.get(str(int(label)), 0) + 1

    def skip(self, path, error):
        self.skipped.append({"path": path, "error": error})

    def finish(self):
        self._tar.close()
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        size = os.path.getsize(self.path + ".partial")
        _write_json(_marker_path(self.out, self.k), {"name": shard_name(self.k), "count": self.count, "bytes": size,
                                                     "class_counts": self.class_counts, "skipped": self.skipped})
        os.replace(self.path + ".partial", self.path)


def check_writable(out):
    try:
        os.makedirs(os.path.join(out, PROGRESS_DIR), exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=out, prefix=".write-test-"):
            pass
    except OSError as e:
        raise UserError(f"output folder {out} cannot be written ({e.strerror or e}); choose another output "
                        f"folder or fix its permissions") from None


def prepare_output(out, plan):
    """Create OUT, check it is writable and that it holds no different extraction; record the plan."""
    check_writable(out)
    progress = os.path.join(out, PROGRESS_DIR)
    old = _read_json(os.path.join(progress, "plan.json"))
    if old is not None and old != plan:
        diff = ", ".join(f"{k}: {old.get(k)!r} -> {plan.get(k)!r}" for k in {**old, **plan} if old.get(k) != plan.get(k))
        raise UserError(f"output folder {out} holds an extraction with other settings ({diff}); "
                        f"use a new output folder or the same settings to resume")
    if old is None:
        _write_json(os.path.join(progress, "plan.json"), plan)


def write_manifest(out, plan=None):
    """Gather the done-markers of all shards into manifest.json (rank 0, after every rank finished)."""
    plan = plan or _read_json(os.path.join(out, PROGRESS_DIR, "plan.json"))
    if plan is None:
        raise UserError(f"{out} holds no extraction plan (.progress/plan.json); run the extraction first")
    missing = [shard_name(k) for k in range(plan["num_shards"]) if not shard_complete(out, k)]
    if missing:
        raise UserError(f"{len(missing)} shard(s) of {out} are not complete (first: {missing[0]}); "
                        f"run the same command again to finish them")
    shards, skipped, class_counts = [], [], [0] * plan["num_classes"]
    for k in range(plan["num_shards"]):
        marker = _read_json(_marker_path(out, k))
        shards.append({key: marker[key] for key in ("name", "count", "bytes")})
        skipped += marker["skipped"]
        for label, n in marker["class_counts"].items():
            class_counts[int(label)] += n
    for name in os.listdir(out):  # leftovers of interrupted runs; no rank is writing any more
        if name.endswith(".partial"):
            os.remove(os.path.join(out, name))
    manifest = {"format": FORMAT, "num_samples": sum(s["count"] for s in shards),
                "num_classes": plan["num_classes"], "class_counts": class_counts, "classes": plan["classes"],
                "vae": plan["vae"], "scale_factor": SD_VAE_SCALE, "scaled": False,
                "resolution": plan["resolution"], "latent_shape": plan["latent_shape"], "latent_dtype": "float16",
                "layout": plan["layout"], "source": plan["source"], "shard_size": plan["shard_size"],
                "shards": shards, "skipped": skipped, **({"images": plan["images"]} if plan.get("images") else {})}
    _write_json(os.path.join(out, "manifest.json"), manifest)
    return manifest


def _summary(out, manifest):
    skipped = manifest["skipped"]
    print(f"wrote {manifest['num_samples']} samples of {manifest['num_classes']} classes in "
          f"{len(manifest['shards'])} shards to {out} (manifest.json); {len(skipped)} file(s) skipped", flush=True)
    for s in skipped[:20]:
        print(f"  skipped {s['path']}: {s['error']}", flush=True)
    if len(skipped) > 20:
        print(f"  ... {len(skipped) - 20} more in manifest.json", flush=True)


def _default_shard_size(sample_shape, image_bytes=0):
    """image_bytes: an upper bound of a stored crop (its raw size; PNG stores less), 0 without images."""
    npy = 128 + 2 * int(np.prod(sample_shape))
    per_sample = 512 + -(-npy // 512) * 512 + 1024  # tar headers + padded .npy + padded .cls
    per_sample += 512 + image_bytes if image_bytes else 0
    return max(1, TARGET_SHARD_BYTES // per_sample)


# ----------------------------------------------------------------------------------------------------
# Extraction

def make_plan(source, *, resolution, vae_id, latent_channels, factor, shard_size=None, max_images=None,
              images=False):
    """(plan dict, items [(index, path, label)], root) - identical on every rank. `images`: the crops are stored
    too (recorded in the plan only then, so plans of earlier extractions still match)."""
    if resolution <= 0 or resolution % factor:
        raise UserError(f"--resolution {resolution} must be a positive multiple of the VAE's factor {factor}")
    items, classes, root = list_items(source)
    if max_images is not None and max_images < len(items):
        if max_images <= 0:
            raise UserError(f"--max-images must be positive, got {max_images}")
        keep = np.sort(np.random.RandomState(0).permutation(len(items))[:max_images])  # spread over classes
        items = [items[i] for i in keep]
    h = resolution // factor
    shape = [2, 2 * latent_channels, h, h]
    shard_size = shard_size or _default_shard_size(shape, resolution * resolution * 3 if images else 0)
    if shard_size <= 0:
        raise UserError(f"--shard-size must be positive, got {shard_size}")
    digest = hashlib.sha1("".join(f"{os.path.relpath(p, root)}\t{y}\n" for p, y in items).encode()).hexdigest()
    plan = {"source": root, "num_items": len(items), "items_sha1": digest, "resolution": resolution,
            "vae": vae_id, "latent_shape": shape, "shard_size": shard_size,
            "num_shards": -(-len(items) // shard_size),
            "num_classes": len(classes) if classes is not None else max(y for _, y in items) + 1,
            "classes": classes, "layout": "[original, flipped] x [mean channels, logvar channels] x h x w"}
    if images:
        plan["images"] = "png"
    return plan, [(i, p, y) for i, (p, y) in enumerate(items)], root


def run_extraction(source, out, *, vae, vae_id, resolution=256, shard_size=None, batch_size=32, num_workers=4,
                   max_images=None, rank=0, world_size=1, progress=True, images=False):
    """Encode the shards of this rank (k % world_size == rank) that are not complete yet; returns #images done.
    `images`: store each crop beside its latents."""
    from tqdm import tqdm

    out = os.path.abspath(os.fspath(out))
    plan, items, root = make_plan(source, resolution=resolution, vae_id=vae_id, shard_size=shard_size,
                                  latent_channels=vae.config.latent_channels, factor=vae_downsample_factor(vae),
                                  max_images=max_images, images=images)
    prepare_output(out, plan)
    size = plan["shard_size"]
    mine = [k for k in range(plan["num_shards"]) if k % world_size == rank]
    todo = [k for k in mine if not shard_complete(out, k)]
    work = [it for k in todo for it in items[k * size:(k + 1) * size]]
    if progress:
        print(f"rank {rank}/{world_size}: {len(todo)} of {len(mine)} shards to encode "
              f"({len(mine) - len(todo)} already complete), {len(work)} images", flush=True)
    loader = torch.utils.data.DataLoader(_Images(work, resolution), batch_size=batch_size, shuffle=False,
                                         num_workers=num_workers, pin_memory=torch.cuda.is_available())
    device = next(vae.parameters()).device
    bar = tqdm(total=len(work), unit="img", dynamic_ncols=True, disable=not progress or rank != 0,
               desc=f"rank 0/{world_size} encoding")
    writer = None
    try:
        for crops, labels, indices, errors in loader:
            ok = [j for j, e in enumerate(errors) if not e]
            if ok:
                x = crops[ok].to(device).permute(0, 3, 1, 2).float() / 127.5 - 1.0
                mean, logvar = encode_moments(vae, torch.cat([x, x.flip(-1)]))
                moments = torch.cat([mean, logvar], dim=1).float()
                pairs = torch.stack([moments[:len(ok)], moments[len(ok):]], dim=1).half().cpu().numpy()
            row = {j: n for n, j in enumerate(ok)}
            for j, index in enumerate(indices.tolist()):
                if writer is None or writer.k != index // size:
                    if writer is not None:
                        writer.finish()
                    writer = ShardWriter(out, index // size)
                if j in row:
                    writer.add(f"{index:08d}", pairs[row[j]], labels[j], crops[j].numpy() if images else None)
                else:
                    writer.skip(os.path.relpath(items[index][1], root), errors[j])
            bar.update(len(indices))
        if writer is not None:
            writer.finish()
    finally:
        bar.close()
    return len(work)


# ----------------------------------------------------------------------------------------------------
# MaskDiT's released latents

MASKDIT_VAE = "MaskDiT release: SD kl-f8 encoder (the encoder of stabilityai/sd-vae-ft-ema is the same)"


def _maskdit_samples(src, pairs):
    """Yield (label, float array) from MaskDiT's LMDB (keys z-<i> float32 moments, y-<i>, length; the
    x-flips stored as entries length/2 .. length-1) or a folder of .npz / .npy arrays [N, 8, h, w] (or
    [N, 2, 8, h, w]) with labels [N]: in an .npz under `labels`/`y`/`label`, for X.npy in X.labels.npy."""
    lmdb_dir = next((d for d in (src, os.path.join(src, "train")) if os.path.isfile(os.path.join(d, "data.mdb"))), None)
    if lmdb_dir is not None:
        try:
            import lmdb
        except ImportError:
            raise UserError("reading MaskDiT's LMDB needs the lmdb package: `pip install lmdb`") from None
        with lmdb.open(lmdb_dir, readonly=True, lock=False, readahead=False, subdir=True) as env, env.begin() as txn:
            def get(key):
                value = txn.get(key.encode())
                if value is None:
                    raise UserError(f"{lmdb_dir} lacks the entry {key!r}; is it MaskDiT's latent LMDB?")
                return value

            length = int(get("length").decode())
            n = length // 2 if pairs else length
            if pairs and length % 2:
                raise UserError(f"{lmdb_dir} holds an odd number ({length}) of entries, so no x-flip halves; "
                                f"pass --no-flip-pairs")
            for i in range(n):
                z = np.frombuffer(get(f"z-{i}"), dtype=np.float32)
                y = int(get(f"y-{i}").decode())
                if pairs:
                    zf = np.frombuffer(get(f"z-{i + n}"), dtype=np.float32)
                    if int(get(f"y-{i + n}").decode()) != y:
                        raise UserError(f"{lmdb_dir}: entries {i} and {i + n} have different labels, so the second "
                                        f"half is not the x-flips; pass --no-flip-pairs")
                    z = np.stack([z, zf])
                side = int(round((z.shape[-1] / 8) ** 0.5))
                yield y, z.reshape(*z.shape[:-1], 8, side, side)
        return
    files = sorted(os.path.join(dp, f) for dp, _, fs in os.walk(src) for f in fs
                   if f.endswith(".npz") or (f.endswith(".npy") and not f.endswith(".labels.npy")))
    if not files:
        raise UserError(f"{src} holds neither MaskDiT's LMDB (data.mdb; unzip imagenet_256_latent_lmdb.zip "
                        f"first) nor .npz/.npy latent arrays")
    for path in files:
        try:
            if path.endswith(".npz"):
                with np.load(path, allow_pickle=False) as z:
                    lab_key = next((k for k in ("labels", "label", "y") if k in z.files), None)
                    lat_key = next((k for k in z.files if k != lab_key), None)
                    if lab_key is None or lat_key is None:
                        raise UserError(f"{path} needs a latent array and a `labels` (or `y`) array")
                    latents, labels = z[lat_key], z[lab_key]
            else:
                lab_path = path[:-4] + ".labels.npy"
                if not os.path.isfile(lab_path):
                    raise UserError(f"{path} has no labels file {lab_path}")
                latents, labels = np.load(path, mmap_mode="r"), np.load(lab_path)
        except (OSError, ValueError, EOFError) as e:
            raise UserError(f"{path}: unreadable array file ({e})") from None
        if latents.ndim not in (4, 5) or latents.shape[-3] != 8 or labels.shape != (latents.shape[0],):
            raise UserError(f"{path}: want latents [N, 8, h, w] or [N, 2, 8, h, w] and labels [N], got "
                            f"{list(latents.shape)} and {list(labels.shape)}")
        for z, y in zip(latents, labels):
            yield int(y), np.asarray(z)


def convert_maskdit(src, out, *, pairs=True, shard_size=None, max_images=None):
    src, out = os.path.abspath(src), os.path.abspath(out)
    if not os.path.isdir(src):
        raise UserError(f"{src} is not a folder; unzip MaskDiT's imagenet_256_latent_lmdb.zip and pass its train/ "
                        f"folder, or a folder of .npz/.npy arrays")
    writer, count, first = None, 0, None
    max_label = -1
    for y, z in _maskdit_samples(src, pairs):
        if first is None:
            first = list(z.shape)
            shard_size = shard_size or _default_shard_size(first)
            prepare_output(out, {"source": src, "converted_from": "maskdit", "shard_size": shard_size,
                                 "pairs": pairs, "max_images": max_images})
        elif list(z.shape) != first:
            raise UserError(f"{src}: sample {count} has shape {list(z.shape)}, the first had {first}")
        if writer is None or writer.k != count // shard_size:
            if writer is not None:
                writer.finish()
            writer = ShardWriter(out, count // shard_size)
        writer.add(f"{count:08d}", z.astype(np.float16), y)
        max_label, count = max(max_label, y), count + 1
        if max_images and count >= max_images:
            break
    if writer is None:
        raise UserError(f"{src} holds no latents")
    writer.finish()
    plan = {"source": src, "converted_from": "maskdit", "shard_size": shard_size, "num_shards": writer.k + 1,
            "num_items": count, "num_classes": max_label + 1, "classes": None, "vae": MASKDIT_VAE,
            "resolution": first[-1] * 8, "latent_shape": first,
            "layout": ("[original, flipped] x " if len(first) == 4 else "") + "[mean channels, logvar channels] x h x w"}
    return write_manifest(out, plan)


# ----------------------------------------------------------------------------------------------------
# Command line

CONVERT = "convert-maskdit"


def build_parser(command: str = "extract") -> ArgumentParser:
    """The options of `extract` (the default, no command word) or of `convert-maskdit`."""
    if command == CONVERT:
        p = ArgumentParser(prog=f"python -m data.extract_latents {CONVERT}",
                           description="Convert MaskDiT's released latents (LMDB folder with data.mdb, or "
                                       ".npz/.npy arrays of 8-channel moments) into tar shards.")
        p.add_argument("source", help="MaskDiT LMDB folder (e.g. imagenet_256_latent_lmdb/train) or array folder")
        p.add_argument("out", help="output folder")
        p.add_argument("--no-flip-pairs", action="store_true",
                       help="LMDB only: do not pair entry i with its x-flip i + length/2; store every entry alone")
        p.add_argument("--shard-size", type=positive_int, default=None, help="samples per shard (default: ~1 GB shards)")
        p.add_argument("--max-images", type=positive_int, default=None, help="convert only the first this many")
        return p
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("source", help="ImageNet-style folder (one sub-folder per class) or a `path label` list file")
    p.add_argument("out", help="output folder for the tar shards and manifest.json")
    p.add_argument("--resolution", type=positive_int, default=256, help="centre-crop size (256 or 512; default 256)")
    p.add_argument("--vae", default=DEFAULT_VAE, help=f"diffusers VAE repo id or local folder (default {DEFAULT_VAE})")
    p.add_argument("--shard-size", type=positive_int, default=None, help="samples per shard (default: ~1 GB shards)")
    p.add_argument("--batch-size", type=positive_int, default=32, help="images per encoder batch (per process)")
    p.add_argument("--num-workers", type=int, default=4, help="image decoding workers per process")
    p.add_argument("--max-images", type=positive_int, default=None, help="encode only this many (a fixed spread-out subset)")
    p.add_argument("--cpu", action="store_true", help="encode on the CPU even when a GPU is present")
    p.add_argument("--images", action="store_true",
                   help="also store each centre crop as <key>.png, for REPA's teacher (several times the latents' bytes)")
    return p


def parse_args(argv):
    """`convert-maskdit ...`, or without that word the extraction; the command is `args.command`."""
    command = CONVERT if argv[:1] == [CONVERT] else "extract"
    args = build_parser(command).parse_args(argv[1:] if command == CONVERT else argv)
    args.command = command
    return args


def _extract_main(args):
    # ranks may finish far apart (a resumed run leaves some ranks little to do): a barrier timeout of a day
    state = start_processes(24 * 60, cpu=args.cpu)
    if not os.path.exists(args.source):
        raise UserError(f"source {args.source} does not exist; pass an ImageNet-style folder or a `path label` list file")
    check_writable(os.path.abspath(args.out))  # cheap checks before the (possibly slow) VAE load
    vae = load_sd_vae(args.vae, device=state.device)
    vae_id = os.path.abspath(args.vae) if os.path.isdir(args.vae) else args.vae
    out = os.path.abspath(args.out)
    run_extraction(args.source, out, vae=vae, vae_id=vae_id, resolution=args.resolution,
                   shard_size=args.shard_size, batch_size=args.batch_size, num_workers=args.num_workers,
                   max_images=args.max_images, rank=state.process_index, world_size=state.num_processes,
                   images=args.images)
    state.wait_for_everyone()
    if state.is_main_process:
        _summary(out, write_manifest(out))


def _convert_main(args):
    _summary(args.out, convert_maskdit(args.source, args.out, pairs=not args.no_flip_pairs,
                                       shard_size=args.shard_size, max_images=args.max_images))


@report_user_errors
def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else list(argv))
    (_convert_main if args.command == CONVERT else _extract_main)(args)


if __name__ == "__main__":
    main()
