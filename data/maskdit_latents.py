"""MaskDiT's released ImageNet latents (an LMDB, or .npz/.npy arrays) converted to this project's shards:
`python -m data.extract_latents convert-maskdit SRC OUT`."""
import os

import numpy as np

from data.shard_writer import ShardWriter, default_shard_size, prepare_output, write_manifest
from tread_utils.errors import UserError

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
            shard_size = shard_size or default_shard_size(first)
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
