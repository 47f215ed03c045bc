"""Loader section of lab/bench.py: samples/s of the training data path alone, no model.

    python -m lab.bench --sections loader --loader-path /data/imagenet256-latents --loader-workers 8

The trainer's own loader (`LatentShardDataset`, `ResumableBatchSampler`, a DataLoader with persistent
workers) reads `--loader-batches` batches of `--loader-batch` samples over the shard folder `--loader-path`.
Without a path it first writes temporary shards with the extractor's own `ShardWriter`, in the extractor's
layout (float16 posterior moments of the image and its flip, [2, 2C, S, S]), so reads cost what they cost on
extracted ImageNet latents except for the disk (here the page cache). The first batch, which includes worker
start-up, is timed apart from the rest.
"""
import os
import tempfile
import time

import numpy as np
import torch

from data.batch_sampler import ResumableBatchSampler
from data.shard_writer import ShardWriter, check_writable
from data.shards import LatentShardDataset
from tread_utils.cli import non_negative_int, positive_int


def add_loader_args(parser):
    parser.add_argument("--loader-path", default=None,
                        help="loader: folder of latent shards (default: temporary random shards written first)")
    parser.add_argument("--loader-workers", type=non_negative_int, default=4,
                        help="loader: DataLoader workers (default 4)")
    parser.add_argument("--loader-batch", type=positive_int, default=256, help="loader: batch size (default 256)")
    parser.add_argument("--loader-batches", type=positive_int, default=20,
                        help="loader: timed batches after the first")
    parser.add_argument("--loader-samples", type=positive_int, default=4096,
                        help="loader, no --loader-path: samples in the temporary shards (4 shards)")
    parser.add_argument("--loader-shape", type=positive_int, nargs=3, default=[4, 32, 1000],
                        metavar=("CHANNELS", "SIZE", "CLASSES"),
                        help="loader: latent channels, latent side and classes of the data "
                             "(default ImageNet 256: 4 32 1000)")


def write_random_shards(out, num_samples, channels, size, classes, num_shards=4, seed=0):
    """`num_samples` random float16 moment pairs in `num_shards` tar shards under `out`, as the extractor writes."""
    check_writable(out)
    rng = np.random.default_rng(seed)
    per_shard = -(-num_samples // num_shards)
    for k in range(num_shards):
        writer = ShardWriter(out, k)
        for i in range(k * per_shard, min(num_samples, (k + 1) * per_shard)):
            writer.add(f"{i:08d}", rng.standard_normal((2, 2 * channels, size, size)).astype(np.float16),
                       int(rng.integers(classes)))
        writer.finish()
    return out


def bench_loader(args) -> list:
    channels, size, classes = args.loader_shape
    with tempfile.TemporaryDirectory(prefix="tread-loader-") as tmp:
        path = args.loader_path or write_random_shards(os.path.join(tmp, "shards"), args.loader_samples,
                                                       channels, size, classes)
        dataset = LatentShardDataset(path, channels, size, classes)
        sampler = ResumableBatchSampler(len(dataset), args.loader_batch, seed=0)
        workers = args.loader_workers
        loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler, num_workers=workers,
                                             persistent_workers=workers > 0, generator=torch.Generator())
        batches = iter(loader)
        t0 = time.perf_counter()
        next(batches)
        t1 = time.perf_counter()
        for _ in range(args.loader_batches):
            next(batches)
        t2 = time.perf_counter()
        del batches, loader
        dataset.close()
    samples = args.loader_batches * args.loader_batch
    row = dict(path=args.loader_path or "temporary random shards", samples=samples, batch=args.loader_batch,
               workers=workers, dataset_size=len(dataset), first_batch_s=t1 - t0, seconds=t2 - t1,
               samples_per_s=samples / (t2 - t1))
    print(f"loader: {row['samples_per_s']:.0f} samples/s ({workers} workers, batch {args.loader_batch}; "
          f"first batch {row['first_batch_s']:.2f} s)", flush=True)
    return [row]

