"""ADM evaluation suite (guided-diffusion/evaluations/evaluator.py) on a PyTorch Inception port.

    python evaluations/evaluator.py REF.npz SAMPLE.npz [--batch-size 64] [--device auto]
                                    [--weights PATH] [--num-samples N] [--backend torch|tf]

Inputs are ADM batches: ``arr_0`` uint8 [N, H, W, 3]. The reference may also hold precomputed
``mu``, ``sigma`` (pool_3) and ``mu_s``, ``sigma_s`` (spatial), which are used instead of
recomputing. Precision/recall need the reference images' pool features: they come from the
reference's ``arr_0`` (or a ``pool_features`` array written by ``fid.py ref --save-features``); a
reference holding statistics only gets ``nan`` with a note on stderr. Prints exactly five lines:

    Inception Score: x
    FID: x
    sFID: x
    Precision: x
    Recall: x

``--random-init`` is for tests only: a seeded, randomly initialised network (numbers are meaningless).
Weights: ``--weights PATH`` or env ``TREAD_INCEPTION_WEIGHTS`` or the cache, else a download
(see evaluations/inception_weights.py). Bad input -> one ``error:`` line on stderr and exit code 2.

From Python: :func:`evaluate` (two .npz paths and an extractor -> dict),
:func:`reference_from_npz` (reference statistics + pool features, computed once),
:func:`metrics_from_features` (sample features + reference -> dict; :func:`score_features` is the same
taking its inputs over, to free them early) and
:func:`fid_against_reference` (uint8 images + reference -> FID), e.g. for train-time FID::

    from evaluations.inception_weights import load_inception
    from data.images import latents_to_uint8
    extractor = load_inception()                       # weights: --weights / env / cache / download
    ref = reference_from_npz("VIRTUAL_imagenet256_labeled.npz", extractor)
    fid = fid_against_reference(extractor, latents_to_uint8(decoded_images), ref)
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as `python evaluations/evaluator.py`: make the repo importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np
import torch

from evaluations.features import compute_features, npz_images, open_npz
from evaluations.inception import InceptionV3FID
from evaluations.inception_weights import load_inception
from evaluations.metrics import feature_statistics, frechet_distance, inception_score, precision_recall
from evaluations.reference_check import (check_image_size, check_reference_network, few_samples_warning,
                                          network_tag, split_tag)
from tread_utils.errors import UserError, report_user_errors
from tread_utils.cli import ArgumentParser, positive_int

K_NEIGHBOURS = 3
STAT_PAIRS = (("mu", "sigma", "pool"), ("mu_s", "sigma_s", "spatial"))
TF_GRAPH_FILENAME = "classify_image_graph_def.pb"
TF_GRAPH_URL = "https://openaipublic.blob.core.windows.net/diffusion/jul-2021/ref_batches/" + TF_GRAPH_FILENAME
TF_GRAPH_ENV = "TREAD_INCEPTION_GRAPH"


# --------------------------------------------------------------------------------------------
# Reference / sample inspection (cheap: validates before any network is built)
# --------------------------------------------------------------------------------------------
def _check_stat_array(path, name, arr, dims):
    problem = (f"has dtype {arr.dtype}, expected a float array" if arr.dtype.kind not in "fiu" else
               None if np.isfinite(arr).all() else "contains NaN or inf values")
    if problem:
        raise UserError(f"{path} '{name}' {problem}")
    if dims is not None:
        want = (dims,) if name.startswith("mu") else (dims, dims)
        if arr.shape != want:
            raise UserError(f"{path} '{name}' has shape {arr.shape}, expected {want} for this feature network")


def _read_member(npz, path, key) -> np.ndarray:
    try:
        return np.asarray(npz[key])
    except (ValueError, OSError, EOFError) as e:  # object arrays (pickles are refused), corrupt members
        raise UserError(f"{path} '{key}' cannot be read as a numeric array ({str(e).splitlines()[0]})") from None


def inspect_reference(path, feature_dims: dict | None = None) -> dict:
    """Validate a reference .npz. Returns {'stats': {name: array}, 'images': NpzImages or None,
    'pool_features': array or None}. Stats come in pairs (mu, sigma) / (mu_s, sigma_s)."""
    npz = open_npz(path)
    with npz:
        keys = set(npz.files)
        stats = {}
        for mu_key, sigma_key, feature in STAT_PAIRS:
            present = [k for k in (mu_key, sigma_key) if k in keys]
            if len(present) == 1:
                missing = sigma_key if present[0] == mu_key else mu_key
                raise UserError(f"{path} has '{present[0]}' but not '{missing}'; statistics come in pairs")
            if present:
                dims = (feature_dims or {}).get(feature)
                for k in (mu_key, sigma_key):
                    arr = _read_member(npz, path, k)
                    _check_stat_array(path, k, arr, dims)
                    stats[k] = arr.astype(np.float64)
        pool_features = None
        if "pool_features" in keys:
            pool_features = _read_member(npz, path, "pool_features")
            if (pool_features.ndim != 2 or pool_features.dtype.kind != "f" or len(pool_features) < K_NEIGHBOURS + 1
                    or not np.isfinite(pool_features).all()):
                raise UserError(f"{path} 'pool_features' must be a finite float array [N, D] with N >= {K_NEIGHBOURS + 1}")
    # precision/recall's k-th neighbour needs k + 1 images
    images = npz_images(path, min_count=K_NEIGHBOURS + 1, what="reference images") if "arr_0" in keys else None
    if images is None and "mu" not in stats:
        raise UserError(f"{path} holds neither statistics ('mu', 'sigma') nor images ('arr_0'); "
                        f"make a reference with `python fid.py ref --images DIR_OR_NPZ --out REF.npz`")
    return {"stats": stats, "images": images, "pool_features": pool_features}


def inspect_samples(path, num_samples: int | None = None):
    """Validated lazy reader of the sample batch's ``arr_0``; at least ``num_samples`` images (and 4)."""
    open_npz(path).close()
    reader = npz_images(path, min_count=num_samples, what="sample images")
    n = len(reader) if num_samples is None else num_samples
    if n < K_NEIGHBOURS + 1:
        raise UserError(f"{path}: {n} sample images are too few; FID and precision/recall need at least {K_NEIGHBOURS + 1}")
    return reader


# --------------------------------------------------------------------------------------------
# Metrics
# --------------------------------------------------------------------------------------------
def metrics_from_features(sample: dict, reference: dict, split_size: int = 5000, device=None) -> dict:
    """ADM's five numbers from sample features and reference statistics.

    ``sample``: {'pool', 'spatial', 'logits'} float arrays [N, D] or tensors (a missing key gives nan);
    instead of an array, ``'<key>_stats'``: (mu, sigma) accumulated by compute_features(stats_keys=...),
    and instead of the logits, ``'inception_score'`` (compute_features(inception_split=...)).
    ``reference``: {'mu', 'sigma', 'mu_s', 'sigma_s', 'pool'} (any may be missing -> nan + note).
    Returns {'inception_score', 'fid', 'sfid', 'precision', 'recall', 'notes': [str]}.
    """
    return score_features(dict(sample), dict(reference), split_size, device)


def score_features(sample: dict, reference: dict, split_size: int = 5000, device=None) -> dict:
    """`metrics_from_features` that takes both dicts over: it removes the feature arrays from them once it is
    done with them, and does precision/recall before the two matrix square roots, so that these (a few
    hundred MB each at 2048 dims) run with no features held. The numbers are the same in any order."""
    notes = []
    out = {"inception_score": float("nan"), "fid": float("nan"), "sfid": float("nan"),
           "precision": float("nan"), "recall": float("nan")}
    if "inception_score" in sample:  # scored split by split while extracting
        out["inception_score"] = sample["inception_score"]
    elif "logits" in sample:
        out["inception_score"] = inception_score(sample.pop("logits"), split_size=split_size)
    else:
        notes.append("Inception Score: the feature network has no logits")
    gaussians = {}
    for (mu_key, sigma_key, feature), metric in zip(STAT_PAIRS, ("fid", "sfid")):
        if mu_key not in reference:
            notes.append(f"{metric}: the reference has no '{mu_key}'/'{sigma_key}' and no images")
            continue
        if feature + "_stats" in sample:  # accumulated while extracting (compute_features stats_keys)
            gaussians[metric] = sample[feature + "_stats"], (reference[mu_key], reference[sigma_key])
        elif feature in sample:  # the pool features stay for precision/recall
            features = sample[feature] if feature == "pool" else sample.pop(feature)
            gaussians[metric] = feature_statistics(features), (reference[mu_key], reference[sigma_key])
            del features
        else:
            notes.append(f"{metric}: the feature network gives no '{feature}' features")
    if reference.get("pool") is None:
        notes.append("Precision/Recall: nan because the reference holds statistics only; precision/recall "
                     "need its images (arr_0) or pool_features")
    elif "pool" in sample:
        if reference["pool"].shape[1] != sample["pool"].shape[1]:
            raise UserError(f"reference pool features have {reference['pool'].shape[1]} dims, samples "
                            f"{sample['pool'].shape[1]}: they come from different networks")
        out["precision"], out["recall"] = precision_recall(reference["pool"], sample["pool"],
                                                           k=K_NEIGHBOURS, device=device)
    sample.pop("pool", None)
    reference.pop("pool", None)
    for metric, ((mu, sigma), (mu_ref, sigma_ref)) in gaussians.items():
        try:
            out[metric] = frechet_distance(mu, sigma, mu_ref, sigma_ref)
        except ValueError as e:
            raise UserError(f"{metric}: {e}") from None
    out["notes"] = notes
    return out


def reference_from_images(extractor, images, batch_size: int = 64, progress: bool = False, stats: dict | None = None,
                          on_device: bool = False) -> dict:
    """Reference statistics and pool features of uint8 NHWC ``images`` (array, tensor or NpzImages);
    ``stats`` given (mu, sigma, mu_s, sigma_s) win over the images' own. ``on_device``: see compute_features."""
    feats = compute_features(extractor, images, batch_size, progress=progress, desc="reference",
                             keys=("pool", "spatial"), stats_keys=("spatial",), on_device=on_device)
    ref = dict(stats or {})
    ref["pool"] = feats["pool"]
    for mu_key, sigma_key, feature in STAT_PAIRS:
        if mu_key not in ref and feature + "_stats" in feats:
            ref[mu_key], ref[sigma_key] = feats[feature + "_stats"]
        elif mu_key not in ref and feature in feats:
            ref[mu_key], ref[sigma_key] = feature_statistics(feats[feature])
    return ref


def reference_from_npz(ref_npz, extractor, batch_size: int = 64, progress: bool = True,
                       on_device: bool = False) -> dict:
    """Reference statistics (precomputed ones win) and pool features of a reference .npz."""
    info = inspect_reference(ref_npz, getattr(extractor, "feature_dims", None))
    if info["images"] is not None:
        return reference_from_images(extractor, info["images"], batch_size, progress, info["stats"], on_device)
    return {**info["stats"], "pool": info["pool_features"]}


def fid_against_reference(extractor, images, reference: dict, batch_size: int = 64, progress: bool = False) -> float:
    """FID of uint8 NHWC ``images`` (array, tensor or NpzImages) against ``reference['mu'/'sigma']``
    (e.g. from :func:`reference_from_npz`, computed once). The train-time FID entry point."""
    feats = compute_features(extractor, images, batch_size, progress=progress, keys=("pool",))
    mu, sigma = feature_statistics(feats["pool"])
    return frechet_distance(mu, sigma, reference["mu"], reference["sigma"])


def evaluate(ref_npz, sample_npz, extractor, batch_size: int = 64, num_samples: int | None = None,
             progress: bool = True, split_size: int = 5000, device=None) -> dict:
    """Evaluate an ADM sample batch against an ADM reference batch with ``extractor``.

    ``extractor``: callable uint8 NHWC tensor -> {'pool', 'spatial', 'logits'} (see
    evaluations.inception_weights.load_inception). ``num_samples``: use the first N sample images (error if
    fewer). Returns the dict of :func:`metrics_from_features`. Host memory: the pool features of the
    samples and the reference stay on the extractor's GPU when it has one; the logits and the spatial
    features are reduced while they come; the matrix square roots run after the features are released.
    """
    inspect_reference(ref_npz, getattr(extractor, "feature_dims", None))  # fail fast, before any compute
    samples = inspect_samples(sample_npz, num_samples)
    ref = reference_from_npz(ref_npz, extractor, batch_size, progress, on_device=True)
    feats = compute_features(extractor, samples, batch_size, limit=num_samples, progress=progress, desc="samples",
                             stats_keys=("spatial",), inception_split=split_size, on_device=True)
    return score_features(feats, ref, split_size=split_size, device=device)


def format_results(result: dict) -> str:
    """The five ADM output lines."""
    return "\n".join([
        f"Inception Score: {result['inception_score']}",
        f"FID: {result['fid']}",
        f"sFID: {result['sfid']}",
        f"Precision: {result['precision']}",
        f"Recall: {result['recall']}",
    ])


# --------------------------------------------------------------------------------------------
# Optional TensorFlow backend: the original graph, as ADM runs it (needs `pip install -e ".[tf]"`)
# --------------------------------------------------------------------------------------------
class TFInceptionExtractor:
    """Runs ``classify_image_graph_def.pb`` with TensorFlow like ADM's evaluator (best effort:
    not exercised by this repository's tests, which run without TensorFlow)."""

    feature_dims = {"pool": 2048, "spatial": 2023, "logits": 1008}

    def __init__(self, tf, graph_path):
        self._graph = tf.Graph()
        with self._graph.as_default():
            graph_def = tf.GraphDef()
            graph_def.ParseFromString(Path(graph_path).read_bytes())
            self._input = tf.placeholder(tf.float32, shape=[None, None, None, 3])
            pool3, spatial, matmul = tf.import_graph_def(
                graph_def, input_map={"ExpandDims:0": self._input},
                return_elements=["pool_3:0", "mixed_6/conv:0", "softmax/logits/MatMul"], name="")
            self._pool = tf.reshape(pool3, [-1, 2048])
            self._spatial = tf.reshape(spatial[..., :7], [tf.shape(spatial)[0], -1])
            self._weight = matmul.inputs[1]
        self._session = tf.Session(graph=self._graph)
        self._w = self._session.run(self._weight)

    def parameters(self):
        return iter(())

    def __call__(self, images):
        batch = images.cpu().numpy() if torch.is_tensor(images) else np.asarray(images)
        pool, spatial = self._session.run([self._pool, self._spatial], {self._input: batch.astype(np.float32)})
        return {"pool": torch.from_numpy(pool), "spatial": torch.from_numpy(spatial),
                "logits": torch.from_numpy(pool @ self._w)}


def load_tf_extractor(graph_path=None) -> TFInceptionExtractor:
    try:
        import tensorflow.compat.v1 as tf  # noqa: F401
    except ImportError:
        raise UserError('--backend tf needs TensorFlow, which is not installed: pip install -e ".[tf]" '
                        '(or use the default --backend torch)') from None
    tf.disable_eager_execution()
    path = graph_path or os.environ.get(TF_GRAPH_ENV)
    if path is None:
        candidate = Path(os.path.expanduser("~")) / ".cache" / "tread" / TF_GRAPH_FILENAME
        if candidate.is_file():
            path = candidate
    if path is None or not Path(path).is_file():
        raise UserError(f"--backend tf needs {TF_GRAPH_FILENAME} ({TF_GRAPH_URL}); pass --tf-graph PATH or set "
                        f"{TF_GRAPH_ENV}=PATH (or put it in ~/.cache/tread/)")
    return TFInceptionExtractor(tf, path)


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------
def resolve_device(name: str):
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise UserError(f"--device {name!r} is not a device (use auto, cpu, cuda or cuda:N)") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"--device {name} asked for, but CUDA is not available here (use --device cpu)")
    return device


def _same_network(stored: str) -> str:
    name, random_init = split_tag(stored)
    if name != "inception":
        return "make the reference with `fid.py ref --network inception` (the evaluator scores with Inception)"
    return ("pass --random-init, as the reference was made with `fid.py ref --random-init`" if random_init else
            "leave out --random-init: the reference was made with the real weights")


def build_parser() -> ArgumentParser:
    p = ArgumentParser(
        description="ADM evaluation (Inception Score, FID, sFID, precision, recall) of SAMPLE.npz against REF.npz.")
    p.add_argument("ref_batch", help="reference .npz (arr_0 uint8 [N,H,W,3] and/or mu, sigma, mu_s, sigma_s)")
    p.add_argument("sample_batch", help="sample .npz (arr_0 uint8 [N,H,W,3])")
    p.add_argument("--batch-size", type=positive_int, default=64, help="images per forward pass (ADM: 64)")
    p.add_argument("--device", default="auto", help="auto (cuda if available), cpu, cuda, cuda:N")
    p.add_argument("--weights", default=None,
                   help="pt_inception-2015-12-05-6726825d.pth (else env TREAD_INCEPTION_WEIGHTS, the cache, or a download)")
    p.add_argument("--num-samples", type=positive_int, default=None, help="evaluate the first N samples (error if fewer)")
    p.add_argument("--backend", choices=("torch", "tf"), default="torch",
                   help="torch: the PyTorch port (default); tf: the original TF graph (pip install -e \".[tf]\")")
    p.add_argument("--tf-graph", default=None, help=f"{TF_GRAPH_FILENAME} for --backend tf (else env {TF_GRAPH_ENV})")
    p.add_argument("--random-init", action="store_true",
                   help="FOR TESTS ONLY: a seeded randomly initialised network; the numbers mean nothing")
    p.add_argument("--no-progress", action="store_true", help="no progress bars on stderr")
    return p


@report_user_errors
def main(argv=None):
    args = build_parser().parse_args(argv)
    # Validate both files before building a network.
    inspect_reference(args.ref_batch, InceptionV3FID.feature_dims)
    check_reference_network(args.ref_batch, network_tag("inception", args.random_init),
                            _same_network)
    samples = inspect_samples(args.sample_batch, args.num_samples)
    check_image_size(args.ref_batch, samples.shape)
    if args.backend == "tf":
        extractor = load_tf_extractor(args.tf_graph)
        device = None
    else:
        device = resolve_device(args.device)
        extractor = load_inception(args.weights, device=device, random_init=args.random_init,
                                   weights_option="--weights PATH")
    warning = few_samples_warning(args.num_samples or len(samples), InceptionV3FID.feature_dims["pool"])
    if warning:  # after every refusal: an error stays the only line
        print(f"warning: {warning}", file=sys.stderr, flush=True)
    result = evaluate(args.ref_batch, args.sample_batch, extractor, batch_size=args.batch_size,
                      num_samples=args.num_samples, progress=not args.no_progress, device=device)
    for note in result["notes"]:
        print(f"note: {note}", file=sys.stderr)
    print(format_results(result), flush=True)


if __name__ == "__main__":
    main()
