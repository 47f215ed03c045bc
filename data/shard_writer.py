"""Writing latent shards (the format data/shards.py reads): webdataset tars of `<key>.latent.npy` + `<key>.cls`
(+ `<key>.png` with images), each written to `<name>.tar.partial` and renamed after its done-marker
`.progress/<name>.json`, a recorded plan that a resumed extraction must match, and manifest.json gathered from
the markers. Used by data/extract_latents.py, data/maskdit_latents.py and lab/bench_loader.py.
"""
import io
import json
import os
import tarfile
import tempfile

import numpy as np
from PIL import Image

from data.vae import SD_VAE_SCALE
from tread_utils.errors import UserError

SHARD_PREFIX = "latents"
PROGRESS_DIR = ".progress"
FORMAT = "tread-latents-v1"
TARGET_SHARD_BYTES = 10**9


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


def print_summary(out, manifest):
    skipped = manifest["skipped"]
    print(f"wrote {manifest['num_samples']} samples of {manifest['num_classes']} classes in "
          f"{len(manifest['shards'])} shards to {out} (manifest.json); {len(skipped)} file(s) skipped", flush=True)
    for s in skipped[:20]:
        print(f"  skipped {s['path']}: {s['error']}", flush=True)
    if len(skipped) > 20:
        print(f"  ... {len(skipped) - 20} more in manifest.json", flush=True)


def default_shard_size(sample_shape, image_bytes=0):
    """image_bytes: an upper bound of a stored crop (its raw size; PNG stores less), 0 without images."""
    npy = 128 + 2 * int(np.prod(sample_shape))
    per_sample = 512 + -(-npy // 512) * 512 + 1024  # tar headers + padded .npy + padded .cls
    per_sample += 512 + image_bytes if image_bytes else 0
    return max(1, TARGET_SHARD_BYTES // per_sample)
