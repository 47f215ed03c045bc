"""A randomly initialised SD-VAE, built offline: the architecture of stabilityai/sd-vae-ft-ema (diffusers
AutoencoderKL, 83.65M parameters) with seeded random weights, saved as a diffusers folder. A stand-in for
timing `data.extract_latents` where the real weights cannot be downloaded; its latents mean nothing.
`--images DIR` also writes seeded random JPEGs (`--size`, 256 x 256 by default) in one class folder, the input of
that timing:

    python -m tools.make_random_sdvae sdvae-arch-random --images imgs --num-images 32
    python -m data.extract_latents imgs/ out/ --vae sdvae-arch-random --batch-size 8 --num-workers 1
"""
import argparse
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from data.vae import SD_VAE_SCALE
from tread_utils.errors import report_user_errors
from tread_utils.cli import ArgumentParser, positive_int

# stabilityai/sd-vae-ft-ema's config.json (diffusers AutoencoderKL), keys that differ from the defaults.
SD_VAE_CONFIG = dict(in_channels=3, out_channels=3, latent_channels=4, sample_size=256, layers_per_block=2,
                     block_out_channels=(128, 256, 512, 512), norm_num_groups=32, act_fn="silu",
                     down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
                     scaling_factor=SD_VAE_SCALE)


def random_sd_vae(seed: int = 0):
    from diffusers import AutoencoderKL

    torch.manual_seed(seed)
    return AutoencoderKL(**SD_VAE_CONFIG)


def write_images(folder: Path, count: int, seed: int = 0, size: int = 256):
    """`count` seeded uniform-noise RGB JPEGs in `folder`/0 (one class)."""
    rng = np.random.default_rng(seed)
    (folder / "0").mkdir(parents=True, exist_ok=True)
    for i in range(count):
        pixels = rng.integers(0, 256, (size, size, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(folder / "0" / f"{i:04d}.jpg", quality=90)


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", help="folder to save the VAE in (diffusers save_pretrained)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--images", help="also write random JPEGs here, in one class folder")
    p.add_argument("--num-images", type=positive_int, default=32)
    p.add_argument("--size", type=positive_int, default=256, help="the JPEGs' width and height")
    return p


@report_user_errors
def main(argv=None):
    args = build_parser().parse_args(argv)
    vae = random_sd_vae(args.seed)
    vae.save_pretrained(args.out)
    print(f"saved a random-weight SD-VAE ({sum(q.numel() for q in vae.parameters()) / 1e6:.2f}M parameters) "
          f"to {args.out}")
    if args.images:
        write_images(Path(args.images), args.num_images, args.seed, args.size)
        print(f"wrote {args.num_images} random {args.size} x {args.size} JPEGs to {args.images}/0")


if __name__ == "__main__":
    main()
