"""The evaluator's memory path: the five numbers are the ones it gave before it streamed, and the large arrays
(the logits, the pool features during the matrix square roots) are not held."""
import tracemalloc

import numpy as np
import pytest
import torch
from conftest import projection_extractor

from evaluations import evaluator, metrics
from evaluations.evaluator import evaluate
from evaluations.features import compute_features

def _extractor():
    return projection_extractor({"pool": 32, "spatial": 12, "logits": 10}, offset=0.5, gain=10)


def _batches(tmp_path):
    rng = np.random.default_rng(12)
    ref, sample = tmp_path / "ref.npz", tmp_path / "sample.npz"
    np.savez(ref, arr_0=rng.integers(0, 256, (60, 24, 20, 3), dtype=np.uint8))
    np.savez(sample, arr_0=rng.integers(0, 256, (50, 24, 20, 3), dtype=np.uint8))
    return ref, sample


def test_evaluate_gives_the_numbers_of_every_feature_kept(tmp_path):
    """Streaming the logits and the spatial features and releasing the pool features before FID changes no digit:
    the five numbers are those of the metric functions on every feature kept (same float64 arithmetic, same
    float16 blocks). Against numbers of this run, not stored ones: float32 features differ in their last bits
    between CPUs."""
    ref, sample = _batches(tmp_path)
    # splits of 20 (the last one partial) and batches of 7 that straddle them
    result = evaluate(ref, sample, _extractor(), batch_size=7, progress=False, split_size=20)
    kept = {name: compute_features(_extractor(), np.load(path)["arr_0"], batch_size=7, keys=("pool", "spatial", "logits"))
            for name, path in (("ref", ref), ("sample", sample))}
    fid = {key: metrics.frechet_distance(*metrics.feature_statistics(kept["sample"][key]),
                                         *metrics.feature_statistics(kept["ref"][key])) for key in ("pool", "spatial")}
    expected = {"inception_score": metrics.inception_score(kept["sample"]["logits"], split_size=20),
                "fid": fid["pool"], "sfid": fid["spatial"]}
    for key, value in expected.items():
        assert result[key] == pytest.approx(value, rel=1e-12, abs=0), key
    assert (result["precision"], result["recall"]) == metrics.precision_recall(kept["ref"]["pool"], kept["sample"]["pool"])
    assert 0 < result["precision"] < 1 and 0 < result["recall"] < 1  # the instance separates them


SMALL = {"pool": 128, "spatial": 16, "logits": 1000}  # logits dominate, as at 2048 / 2023 / 1008 they do not


def _traced_peak(fn):
    tracemalloc.start()
    try:
        result = fn()
        return result, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_the_inception_score_is_taken_split_by_split_without_keeping_the_logits():
    from lab.bench_memory import RandomFeatures

    n = 8000
    images = np.zeros((n, 1, 1, 3), np.uint8)
    kept = compute_features(RandomFeatures(dims=SMALL), images, keys=("logits",))["logits"]
    logits_bytes = kept.nbytes  # 32 MB
    streamed, peak = _traced_peak(lambda: compute_features(RandomFeatures(dims=SMALL), images, keys=("logits",),
                                                           inception_split=250))
    assert "logits" not in streamed
    assert streamed["inception_score"] == metrics.inception_score(kept, split_size=250)  # same arithmetic
    assert peak < logits_bytes * 0.6  # one split of 250 in float64 and its temporaries: about 12 MB


def test_the_matrix_square_roots_run_with_no_features_held(tmp_path, monkeypatch):
    from lab.bench_memory import RandomFeatures

    n = 8000
    np.savez(tmp_path / "ref.npz", arr_0=np.zeros((1000, 1, 1, 3), np.uint8))
    np.savez(tmp_path / "sample.npz", arr_0=np.zeros((n, 1, 1, 3), np.uint8))
    held = []
    sqrtm = metrics._sqrtm
    monkeypatch.setattr(metrics, "_sqrtm", lambda a: held.append(tracemalloc.get_traced_memory()[0]) or sqrtm(a))
    result, _ = _traced_peak(lambda: evaluate(tmp_path / "ref.npz", tmp_path / "sample.npz",
                                              RandomFeatures(dims=SMALL), progress=False, split_size=250))
    assert np.isfinite(result["fid"]) and np.isfinite(result["sfid"]) and len(held) == 2
    pool_bytes = n * SMALL["pool"] * 4  # 4 MB; the logits would be 32 MB
    assert max(held) < pool_bytes / 2, held  # the statistics (128^2 and 16^2 float64) and little else: 0.5 MB


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_features_kept_on_the_gpu_give_the_numbers_of_host_features(tmp_path):
    ref, sample = _batches(tmp_path)
    extractor = _extractor().cuda()
    images = np.load(sample)["arr_0"]
    assert compute_features(extractor, images, batch_size=7, on_device=True)["pool"].is_cuda
    on_gpu = evaluate(ref, sample, extractor, batch_size=7, progress=False, split_size=20, device="cuda")
    host_ref = evaluator.reference_from_npz(ref, extractor, batch_size=7, progress=False)
    host_feats = compute_features(extractor, images, batch_size=7, stats_keys=("spatial",))
    assert isinstance(host_feats["pool"], np.ndarray) and isinstance(host_ref["pool"], np.ndarray)
    on_host = evaluator.metrics_from_features(host_feats, host_ref, split_size=20, device="cuda")
    assert {k: on_gpu[k] for k in EXPECTED} == {k: on_host[k] for k in EXPECTED}
