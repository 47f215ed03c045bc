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
interrupted run is resumed by running the same command again. Rank 0 writes manifest.json at the end
(the writing: data/shard_writer.py; convert-maskdit: data/maskdit_latents.py).
Unreadable images are skipped and listed in the manifest and the summary. `--images` also stores each crop,
for a teacher computed online from the clean image (REPA on latents: README, REPA); the trainer flips it
with its latent.
"""
import argparse
import hashlib
import os
import sys

import numpy as np
import torch
from PIL import Image

from data.maskdit_latents import convert_maskdit
from data.shard_writer import (ShardWriter, check_writable, default_shard_size, prepare_output, print_summary,
                               shard_complete, write_manifest)
from data.vae import DEFAULT_VAE, encode_moments, load_sd_vae, vae_downsample_factor
from tread_utils.distributed import start_processes
from tread_utils.errors import UserError, report_user_errors
from tread_utils.cli import ArgumentParser, positive_int

IMAGE_EXTS = (".jpg", ".jpeg", ".png", ".bmp", ".webp", ".tif", ".tiff", ".gif", ".ppm", ".pgm", ".pbm")


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


def check_source(source):
    if not os.path.exists(source):
        raise UserError(f"source {source} does not exist; pass an ImageNet-style folder or a `path label` list file")


def list_items(source):
    """([(path, label)], class names or None, root used for the relative paths in the manifest)."""
    source = os.path.abspath(os.fspath(source))
    check_source(source)
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
# Extraction

def make_plan(source, *, resolution, vae_id, latent_channels, factor, shard_size=None, max_images=None,
              images=False):
    """(plan dict, items [(index, path, label)], root) - identical on every rank. `images`: the crops are stored
    too (recorded in the plan only then, so plans of earlier extractions still match)."""
    if resolution <= 0 or resolution % factor:
        raise UserError(f"--resolution {resolution} must be a positive multiple of the VAE's factor {factor}")
    items, classes, root = list_items(source)
    if max_images is not None and max_images < len(items):  # max_images and shard_size: positive (the parser's)
        keep = np.sort(np.random.RandomState(0).permutation(len(items))[:max_images])  # spread over classes
        items = [items[i] for i in keep]
    h = resolution // factor
    shape = [2, 2 * latent_channels, h, h]
    shard_size = shard_size or default_shard_size(shape, resolution * resolution * 3 if images else 0)
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
    check_source(args.source)
    check_writable(os.path.abspath(args.out))  # cheap checks before the (possibly slow) VAE load
    vae = load_sd_vae(args.vae, device=state.device, option="--vae DIR")
    vae_id = os.path.abspath(args.vae) if os.path.isdir(args.vae) else args.vae
    out = os.path.abspath(args.out)
    run_extraction(args.source, out, vae=vae, vae_id=vae_id, resolution=args.resolution,
                   shard_size=args.shard_size, batch_size=args.batch_size, num_workers=args.num_workers,
                   max_images=args.max_images, rank=state.process_index, world_size=state.num_processes,
                   images=args.images)
    state.wait_for_everyone()
    if state.is_main_process:
        print_summary(out, write_manifest(out))


def _convert_main(args):
    print_summary(args.out, convert_maskdit(args.source, args.out, pairs=not args.no_flip_pairs,
                                       shard_size=args.shard_size, max_images=args.max_images))


@report_user_errors
def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else list(argv))
    (_convert_main if args.command == CONVERT else _extract_main)(args)


if __name__ == "__main__":
    main()
