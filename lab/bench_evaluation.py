"""Evaluation sections of lab/bench.py: what scoring samples costs.

- evaluator: images/s of the Inception port's feature pass (all three heads, 256 x 256 inputs).
- suite: ADM's whole evaluation, `python -m evaluations.evaluator REF SAMPLES`, run as its own process
  on random uint8 batches written to a temporary folder (N samples and M reference images, streamed
  to disk like real batches), timed end to end, with that process's peak host memory.
- metrics: the suite's metric stage alone (IS, FID, sFID, precision/recall) on random features of N
  samples and M references, in its own process, with its peak host memory: the 50K-sample memory
  figure on a machine where 60,000 Inception passes would take an hour (lab/bench_memory.py).
- fid: FID during training for a backbone: EDM Heun sampling of N images (40 steps, unguided, as
  train.eval does), SD-VAE decoding, Inception features and the Frechet distance, each stage timed.
Networks are randomly initialised (the real architectures: the cost is the same, the numbers mean
nothing), so this runs with no weights downloaded; `--vae` picks real SD-VAE weights instead.
"""
import json
import math
import os
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

import numpy as np
import torch
from torch._dynamo.utils import counters

from data.decoders import SDVAEDecoder
from data.vae import load_sd_vae, random_sd_vae
from dit import get_model
from edm import EDMPrecond
from edm.sampler import StackedRandomGenerator
from evaluations.features import compute_features
from evaluations.inception_weights import load_inception
from evaluations.metrics import feature_statistics, frechet_distance
from generation.generate import make_sampler

REPO = Path(__file__).resolve().parent.parent
IMAGENET_LATENT = dict(num_classes=1000, in_channels=4, input_size=32)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def bench_evaluator(args, device):
    """Inception feature extraction (the evaluator's cost per image), a randomly initialised network of the
    exact FID Inception shape on 256x256 uint8 images."""
    net = load_inception(device=device, random_init=True)
    images = torch.randint(0, 256, (args.eval_batch, 256, 256, 3), dtype=torch.uint8, device=device)
    net(images[:2])
    sync(device)
    t0 = time.perf_counter()
    for _ in range(args.eval_batches):
        net(images)
    sync(device)
    rate = args.eval_batch * args.eval_batches / (time.perf_counter() - t0)
    print(f"evaluator: {rate:.1f} images/s (Inception features, batch {args.eval_batch})", flush=True)
    return [dict(batch=args.eval_batch, images_per_s=rate)]


def write_random_batch(path, count, seed, size=256, chunk=512, progress=None):
    """An ADM-layout .npz (arr_0 uint8 [count, size, size, 3]) of uniform noise, written in chunks so
    a 50,000-image batch never sits in memory; `progress(done, count)` after every chunk."""
    rng = np.random.default_rng(seed)
    header = {"descr": "|u1", "fortran_order": False, "shape": (count, size, size, 3)}
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED, allowZip64=True) as z, \
            z.open("arr_0.npy", "w", force_zip64=True) as f:
        np.lib.format.write_array_header_2_0(f, header)
        for start in range(0, count, chunk):
            f.write(rng.bytes(min(chunk, count - start) * size * size * 3))
            if progress:
                progress(min(start + chunk, count), count)


class Progress:
    """Flushed progress lines of a long stage, at most one per `every` seconds (and always the last)."""

    def __init__(self, label, every=5.0):
        self.label, self.every, self.t0, self.last = label, every, time.perf_counter(), -math.inf
        self.first = None  # seconds to the first report: the first batch, compilation included

    def __call__(self, done, total, unit="images"):
        now = time.perf_counter()
        if self.first is None:
            self.first = now - self.t0
        if done >= total or now - self.last >= self.every:
            self.last = now
            print(f"  {self.label}: {done}/{total} {unit}, {now - self.t0:.1f} s", flush=True)


def run_stage(row, name, label, save, fn, *args, **kwargs):
    """Runs one stage of a section: says so, times it, stores its seconds in `row[name + '_s']`, and saves the
    section's record, so a run killed in a later stage keeps this one."""
    print(f"{label}: {name} ...", flush=True)
    t0 = time.perf_counter()
    out = fn(*args, **kwargs)
    row[f"{name}_s"] = time.perf_counter() - t0
    row["stages_done"] = row.get("stages_done", []) + [name]
    print(f"{label}: {name} done in {row[f'{name}_s']:.1f} s", flush=True)
    save()
    return out


# Runs the evaluator CLI and reports its own peak RSS (MB) on stderr as it exits (lab.bench_memory imports
# nothing the evaluator does not).
_MEASURED_EVALUATOR = """
import atexit, runpy, sys
from lab.bench_memory import peak_rss_mb
atexit.register(lambda: print("peak_rss_mb", peak_rss_mb(), file=sys.stderr))
sys.argv[0] = "evaluator"
runpy.run_module("evaluations.evaluator", run_name="__main__", alter_sys=True)
"""


def relay(stream, label, keep, every=5.0):
    """Prints a child's output lines as they come (progress-bar updates at most every `every` seconds),
    flushed, and keeps the last `keep` lines."""
    tail, last = [], -math.inf
    for line in stream:
        line = line.rstrip()
        if not line:
            continue
        tail = (tail + [line])[-keep:]
        bar = "%|" in line or "it/s]" in line or "s/it]" in line
        if not bar or time.perf_counter() - last >= every:
            last = time.perf_counter() if bar else last
            print(f"  {label}: {line}", flush=True)
    return tail


def bench_suite(args, device, save=lambda rows: None):
    """Time `python -m evaluations.evaluator` end to end on N random samples against M random references,
    its progress relayed as it runs, the record saved after writing the batches and after the evaluator."""
    row = dict(samples=args.suite_samples, reference=args.suite_ref, batch=args.suite_batch)
    rows = [row]
    label = f"ADM suite {args.suite_samples} vs {args.suite_ref}"
    with tempfile.TemporaryDirectory(dir=args.tmp_dir) as tmp:
        ref, samples = Path(tmp) / "ref.npz", Path(tmp) / "samples.npz"

        def write_batches():
            write_random_batch(ref, args.suite_ref, seed=1, progress=Progress("reference batch"))
            write_random_batch(samples, args.suite_samples, seed=2, progress=Progress("sample batch"))

        run_stage(row, "writing", label, lambda: save(rows), write_batches)
        env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
                   PYTHONUNBUFFERED="1")
        cmd = [sys.executable, "-c", _MEASURED_EVALUATOR, str(ref), str(samples), "--random-init",
               "--batch-size", str(args.suite_batch), "--device", str(device)]

        def evaluator():
            with subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True) as proc:
                tail = relay(proc.stdout, "evaluator", keep=40)
            if proc.returncode != 0:
                raise RuntimeError(f"the evaluator failed ({proc.returncode}):\n" + "\n".join(tail))
            return tail

        tail = run_stage(row, "evaluator", label, lambda: save(rows), evaluator)
    seconds = row["evaluator_s"]
    peak_mb = [float(line.split()[1]) for line in tail if line.startswith("peak_rss_mb")][-1]
    row.update(seconds=seconds, images_per_s=(args.suite_samples + args.suite_ref) / seconds, peak_host_mb=peak_mb)
    print(f"ADM suite: {args.suite_samples} samples vs {args.suite_ref} references in {seconds:.1f} s "
          f"(process start included), peak host memory {row['peak_host_mb']:.0f} MB", flush=True)
    return rows


def bench_metrics(args, device):
    code = f"from lab.bench_memory import metric_stage; metric_stage({args.suite_samples}, {args.suite_ref}, '{device}')"
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"the metric stage failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    row = dict(samples=args.suite_samples, reference=args.suite_ref, **json.loads(proc.stdout.splitlines()[-1]))
    print(f"ADM metrics stage: {args.suite_samples} samples vs {args.suite_ref} references (random features) in "
          f"{row['seconds']:.1f} s, peak host memory {row['peak_host_mb']:.0f} MB", flush=True)
    return [row]


# The VAE decodes at most this many latents at a time: its 256 x 256 activations are what bound memory.
MAX_DECODE_BATCH = 64


def sample_latents(net, seeds, batch_size, device, sampler, pad, progress=None):
    """Latents and labels of one sample per seed, exactly as `generation.generate` draws and samples them
    (one generator per seed), in batches of `batch_size`; with `pad`, a short last batch is filled up to
    `batch_size` with repeats of its last seed and cut back after sampling, so a network compiled for one
    batch shape never sees another."""
    backbone = getattr(net.model, "_orig_mod", net.model)  # torch.compile's wrapper keeps the module here
    shape = (backbone.in_channels, *backbone.x_embedder.img_size)
    latents, labels = [], []
    for lo in range(0, len(seeds), batch_size):
        batch = list(seeds[lo:lo + batch_size])
        real = len(batch)
        if pad:
            batch += batch[-1:] * (batch_size - real)
        rnd = StackedRandomGenerator(device, batch)
        x = rnd.randn([len(batch), *shape], device=device)
        y = rnd.randint(net.num_classes, size=[len(batch)], device=device)
        latents.append(sampler(net, x, y, randn_like=rnd.randn_like)[:real].float())
        labels.append(y[:real])
        if progress:
            progress(lo + real, len(seeds))
    return torch.cat(latents), torch.cat(labels)


def decode_all(decoder, latents, batch_size, progress=None):
    """uint8 images [N, H, W, 3] on the host, decoded `batch_size` latents at a time."""
    images = None
    for lo in range(0, len(latents), batch_size):
        part = decoder.decode(latents[lo:lo + batch_size]).numpy()
        if images is None:
            images = np.empty((len(latents), *part.shape[1:]), np.uint8)
        images[lo:lo + len(part)] = part
        if progress:
            progress(lo + len(part), len(latents))
    return images


def pool_features(inception, images, batch_size, progress=None):
    pools = []
    for lo in range(0, len(images), batch_size):
        pools.append(compute_features(inception, images[lo:lo + batch_size], batch_size, keys=("pool",))["pool"])
        if progress:
            progress(lo + len(pools[-1]), len(images))
    return np.concatenate(pools)


@torch.no_grad()
def bench_training_fid(args, device, dtype, save=lambda rows: None, compile_fn=None):
    """FID on `--fid-samples` images as train.eval computes it, per backbone, stage by stage: sampling (EDM
    Heun, unguided), decoding (SD-VAE, at most 64 latents at a time), Inception features, their statistics
    and the Frechet distance. Every stage prints its progress and seconds and saves the record.
    `compile_fn(module)`: how `--fid-compile` compiles the backbone (for one batch shape)."""
    vae = random_sd_vae(device) if args.vae == "random" else load_sd_vae(args.vae, device=device, option="--vae DIR")
    decode_batch = min(MAX_DECODE_BATCH, args.fid_batch)
    decoder = SDVAEDecoder(vae, decode_batch_size=decode_batch)
    inception = load_inception(device=device, random_init=True)
    sampler = make_sampler(dict(name="edm", num_steps=args.fid_steps))
    rows = []
    for backbone in args.backbones:
        torch.manual_seed(0)
        net = EDMPrecond(get_model(backbone, IMAGENET_LATENT).to(device).eval())
        if args.fid_compile:  # one static batch shape, as a compiled trainer's evaluation would run it
            net.model = compile_fn(net.model)
        seeds = range(args.fid_samples)
        padded = -args.fid_samples % args.fid_batch if args.fid_compile else 0
        row = dict(backbone=backbone, samples=args.fid_samples, heun_steps=args.fid_steps, batch=args.fid_batch,
                   decode_batch=decode_batch, compiled=args.fid_compile, padded_samples=padded)
        rows.append(row)
        label = f"in-training FID {backbone}, {args.fid_samples} samples"
        counters.clear()
        progress = Progress("sampling")

        def sampling():
            with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
                out = sample_latents(net, seeds, args.fid_batch, device, sampler, pad=args.fid_compile,
                                     progress=progress)
            sync(device)
            row["sampling_first_batch_s"] = progress.first  # with --fid-compile, compilation happens here
            return out

        latents, _ = run_stage(row, "sampling", label, lambda: save(rows), sampling)
        if args.fid_compile:
            row.update(graphs=int(counters["stats"]["unique_graphs"]), frames=int(counters["frames"]["total"]))
        images = run_stage(row, "decoding", label, lambda: save(rows), lambda: decode_all(
            decoder, latents, decode_batch, progress=Progress("decoding")))
        pool = run_stage(row, "features", label, lambda: save(rows), lambda: pool_features(
            inception, images, args.fid_batch, progress=Progress("features")))
        mu, sigma = run_stage(row, "statistics", label, lambda: save(rows), feature_statistics, pool)
        # the reference statistics are precomputed in training: any fixed pair costs the same
        run_stage(row, "distance", label, lambda: save(rows), frechet_distance, mu, sigma, mu, sigma + np.eye(len(mu)))
        row["seconds"] = sum(row[f"{stage}_s"] for stage in ("sampling", "decoding", "features", "statistics",
                                                             "distance"))
        save(rows)
        print(f"{label}: {row['seconds']:.1f} s (sampling {row['sampling_s']:.1f}, decoding {row['decoding_s']:.1f}, "
              f"Inception {row['features_s']:.1f}, statistics {row['statistics_s']:.1f}, "
              f"distance {row['distance_s']:.1f})", flush=True)
        del net, latents, images
    return rows
