"""Evaluation sections of tools/bench.py: what scoring samples costs.

- evaluator: images/s of the Inception port's feature pass (all three heads, 256 x 256 inputs).
- suite: ADM's whole evaluation, `python -m evaluations.evaluator REF SAMPLES`, run as its own process
  on random uint8 batches written to a temporary folder (N samples and M reference images, streamed
  to disk like real batches), timed end to end, with that process's peak host memory.
- metrics: the suite's metric stage alone (IS, FID, sFID, precision/recall) on random features of N
  samples and M references, in its own process, with its peak host memory: the 50K-sample memory
  figure on a machine where 60,000 Inception passes would take an hour.
- fid: FID during training for a backbone: EDM Heun sampling of N images (40 steps, unguided, as
  train.eval does), SD-VAE decoding, Inception features and the Frechet distance, each stage timed.
Networks are randomly initialised (the real architectures: the cost is the same, the numbers mean
nothing), so this runs with no weights downloaded; `--vae` picks real SD-VAE weights instead.
"""
import json
import os
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

import numpy as np
import torch

from data.decoders import SDVAEDecoder
from data.vae import load_sd_vae, random_sd_vae
from dit import get_model
from edm import EDMPrecond
from evaluations.evaluator import metrics_from_features
from evaluations.features import compute_features
from evaluations.inception import load_inception
from evaluations.metrics import RunningStatistics, feature_statistics, frechet_distance
from generation import generate

REPO = Path(__file__).resolve().parent.parent
IMAGENET_LATENT = dict(num_classes=1000, in_channels=4, input_size=32)


def peak_rss_mb() -> float:
    """This process's peak resident memory. VmHWM belongs to the process's own address space; ru_maxrss
    would carry over the parent's peak into a freshly started child on Linux."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024
    except (OSError, StopIteration):
        import resource  # not on every platform; only needed where /proc is missing

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


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


def write_random_batch(path, count, seed, size=256, chunk=512):
    """An ADM-layout .npz (arr_0 uint8 [count, size, size, 3]) of uniform noise, written in chunks so
    a 50,000-image batch never sits in memory."""
    rng = np.random.default_rng(seed)
    header = {"descr": "|u1", "fortran_order": False, "shape": (count, size, size, 3)}
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED, allowZip64=True) as z, \
            z.open("arr_0.npy", "w", force_zip64=True) as f:
        np.lib.format.write_array_header_2_0(f, header)
        for start in range(0, count, chunk):
            f.write(rng.integers(0, 256, (min(chunk, count - start), size, size, 3), dtype=np.uint8).tobytes())


# Runs the evaluator CLI and reports its own peak RSS (MB) on stderr as it exits.
_MEASURED_EVALUATOR = """
import atexit, runpy, sys
from tools.bench_evaluation import peak_rss_mb
atexit.register(lambda: print("peak_rss_mb", peak_rss_mb(), file=sys.stderr))
sys.argv[0] = "evaluator"
runpy.run_module("evaluations.evaluator", run_name="__main__", alter_sys=True)
"""


def bench_suite(args, device):
    """Time `python -m evaluations.evaluator` end to end on N random samples against M random references."""
    with tempfile.TemporaryDirectory(dir=args.tmp_dir) as tmp:
        ref, samples = Path(tmp) / "ref.npz", Path(tmp) / "samples.npz"
        write_random_batch(ref, args.suite_ref, seed=1)
        write_random_batch(samples, args.suite_samples, seed=2)
        env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        cmd = [sys.executable, "-c", _MEASURED_EVALUATOR, str(ref), str(samples), "--random-init", "--no-progress",
               "--batch-size", str(args.suite_batch), "--device", str(device)]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
        seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"the evaluator failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    peak_mb = [float(line.split()[1]) for line in proc.stderr.splitlines() if line.startswith("peak_rss_mb")][-1]
    row = dict(samples=args.suite_samples, reference=args.suite_ref, batch=args.suite_batch, seconds=seconds,
               images_per_s=(args.suite_samples + args.suite_ref) / seconds, peak_host_mb=peak_mb)
    print(f"ADM suite: {args.suite_samples} samples vs {args.suite_ref} references in {seconds:.1f} s "
          f"(process start included), peak host memory {row['peak_host_mb']:.0f} MB", flush=True)
    return [row]


def metric_stage(num_samples, num_ref, device="cpu", seed=0):
    """ADM's metrics on random features shaped like the Inception port's; prints one JSON line with the
    seconds and this process's peak RSS. Features are kept as the evaluator keeps them (pool and logits
    arrays, sFID as running statistics)."""
    rng = np.random.default_rng(seed)
    pool, logits = np.empty((num_samples, 2048), np.float32), np.empty((num_samples, 1008), np.float32)
    spatial = RunningStatistics()
    for start in range(0, num_samples, 1000):
        stop = min(start + 1000, num_samples)
        pool[start:stop] = rng.random((stop - start, 2048), dtype=np.float32)
        logits[start:stop] = rng.standard_normal((stop - start, 1008), dtype=np.float32)
        spatial.update(rng.random((stop - start, 2023), dtype=np.float32))
    ref = {"pool": rng.random((num_ref, 2048), dtype=np.float32)}
    ref["mu"], ref["sigma"] = feature_statistics(ref["pool"])
    ref["mu_s"], ref["sigma_s"] = spatial.result()
    t0 = time.perf_counter()
    metrics_from_features({"pool": pool, "logits": logits, "spatial_stats": spatial.result()}, ref,
                          device=torch.device(device))
    print(json.dumps(dict(seconds=time.perf_counter() - t0, peak_host_mb=peak_rss_mb())))


def bench_metrics(args, device):
    code = f"from tools.bench_evaluation import metric_stage; metric_stage({args.suite_samples}, {args.suite_ref}, '{device}')"
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"the metric stage failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    row = dict(samples=args.suite_samples, reference=args.suite_ref, **json.loads(proc.stdout.splitlines()[-1]))
    print(f"ADM metrics stage: {args.suite_samples} samples vs {args.suite_ref} references (random features) in "
          f"{row['seconds']:.1f} s, peak host memory {row['peak_host_mb']:.0f} MB", flush=True)
    return [row]


def _timed(device, fn, *a, **kw):
    sync(device)
    t0 = time.perf_counter()
    out = fn(*a, **kw)
    sync(device)
    return out, time.perf_counter() - t0


class TimedDecoder:
    """A decoder that adds up the seconds it spends, so sampling and decoding are timed apart."""

    def __init__(self, decoder, device):
        self.decoder, self.device, self.seconds = decoder, device, 0.0

    def decode(self, latents):
        images, seconds = _timed(self.device, self.decoder.decode, latents)
        self.seconds += seconds
        return images


@torch.no_grad()
def bench_training_fid(args, device, dtype):
    """FID on `--fid-samples` images as train.eval computes it, per backbone, with each stage timed."""
    vae = random_sd_vae(device) if args.vae == "random" else load_sd_vae(args.vae, device=device, option="--vae DIR")
    decoder = SDVAEDecoder(vae, decode_batch_size=args.fid_batch)
    inception = load_inception(device=device, random_init=True)
    rows = []
    for backbone in args.backbones:
        torch.manual_seed(0)
        net = EDMPrecond(get_model(backbone, IMAGENET_LATENT).to(device).eval())
        seeds = range(args.fid_samples)
        sampler = dict(name="edm", num_steps=args.fid_steps)
        timed_decoder = TimedDecoder(decoder, device)
        with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
            (images, _), t_generate = _timed(device, generate, net, seeds, sampler_kwargs=sampler,
                                             decoder=timed_decoder, batch_size=args.fid_batch, progress=False)
        t_decode = timed_decoder.seconds
        t_sample = t_generate - t_decode
        feats, t_features = _timed(device, compute_features, inception, images, batch_size=args.fid_batch,
                                   keys=("pool",))
        t0 = time.perf_counter()
        mu, sigma = feature_statistics(feats["pool"])
        frechet_distance(mu, sigma, mu, sigma + np.eye(len(mu)))  # reference statistics are precomputed
        t_fid = time.perf_counter() - t0
        total = t_sample + t_decode + t_features + t_fid
        rows.append(dict(backbone=backbone, samples=args.fid_samples, heun_steps=args.fid_steps, seconds=total,
                         sampling_s=t_sample, decoding_s=t_decode, features_s=t_features, fid_s=t_fid))
        print(f"in-training FID {backbone}, {args.fid_samples} samples: {total:.1f} s (sampling {t_sample:.1f}, "
              f"decoding {t_decode:.1f}, Inception {t_features:.1f}, FID {t_fid:.1f})", flush=True)
    return rows
