"""ADM metrics against independent float64 computations (eigenvalues, brute-force k-NN)."""
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from evaluations import metrics  # noqa: E402
from evaluations.metrics import (feature_statistics, frechet_distance, inception_score,  # noqa: E402
                                 pairwise_sq_distances, precision_recall)


def _random_gaussian_features(rng, n, d, shift=0.0):
    mix = rng.standard_normal((d, d)) / np.sqrt(d)
    return rng.standard_normal((n, d)) @ mix + shift


def _fid_by_eigenvalues(mu1, s1, mu2, s2):
    """tr sqrt(s1 s2) = sum sqrt(eig(A s2 A)), A = s1^(1/2) (symmetric PSD): no sqrtm involved."""
    w, v = np.linalg.eigh(s1)
    a = (v * np.sqrt(np.clip(w, 0, None))) @ v.T
    eig = np.linalg.eigvalsh(a @ s2 @ a)
    return float(np.sum((mu1 - mu2) ** 2) + np.trace(s1) + np.trace(s2) - 2 * np.sum(np.sqrt(np.clip(eig, 0, None))))


def test_feature_statistics_match_numpy():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((257, 12)).astype(np.float32) * 3 + 1
    mu, sigma = feature_statistics(x, chunk=50)  # several chunks
    np.testing.assert_allclose(mu, x.astype(np.float64).mean(0), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(sigma, np.cov(x.astype(np.float64), rowvar=False), rtol=1e-10, atol=1e-12)
    with pytest.raises(ValueError):
        feature_statistics(x[:1])


def test_frechet_distance_matches_independent_float64():
    rng = np.random.default_rng(1)
    a = _random_gaussian_features(rng, 600, 48)
    b = _random_gaussian_features(rng, 500, 48, shift=0.3) * 1.2
    mu1, s1 = feature_statistics(a)
    mu2, s2 = feature_statistics(b)
    expected = _fid_by_eigenvalues(mu1, s1, mu2, s2)
    assert frechet_distance(mu1, s1, mu2, s2) == pytest.approx(expected, rel=1e-6)
    # torch inputs work too
    assert frechet_distance(torch.from_numpy(mu1), torch.from_numpy(s1), mu2, s2) == pytest.approx(expected, rel=1e-6)


def test_frechet_distance_of_a_set_against_itself_is_zero():
    rng = np.random.default_rng(2)
    mu, s = feature_statistics(_random_gaussian_features(rng, 400, 32))
    assert abs(frechet_distance(mu, s, mu, s)) < 1e-8 * np.trace(s)


def test_frechet_distance_retries_with_eps_when_sqrtm_is_not_finite(monkeypatch):
    rng = np.random.default_rng(3)
    mu1, s1 = feature_statistics(_random_gaussian_features(rng, 100, 6))
    mu2, s2 = feature_statistics(_random_gaussian_features(rng, 100, 6))
    seen = []
    real_sqrtm = metrics._sqrtm

    def fake_sqrtm(a):
        seen.append(a.copy())
        return np.full_like(a, np.nan) if len(seen) == 1 else real_sqrtm(a)

    monkeypatch.setattr(metrics, "_sqrtm", fake_sqrtm)
    with pytest.warns(RuntimeWarning, match="adding"):
        value = frechet_distance(mu1, s1, mu2, s2)
    eye = np.eye(6) * 1e-6
    np.testing.assert_allclose(seen[0], s1 @ s2)
    np.testing.assert_allclose(seen[1], (s1 + eye) @ (s2 + eye))
    expected = (np.sum((mu1 - mu2) ** 2) + np.trace(s1) + np.trace(s2)
                - 2 * np.trace(real_sqrtm((s1 + eye) @ (s2 + eye))).real)
    assert value == pytest.approx(expected, rel=1e-9)


def test_frechet_distance_complex_rules(monkeypatch):
    d = 4
    mu, s = np.zeros(d), np.eye(d)
    root = np.eye(d) * 0.5 + 0j

    def fake(imag_diag):
        def _sqrtm(a):
            r = root.copy()
            r[np.diag_indices(d)] += 1j * imag_diag
            r[0, 1] += 0.5j  # off-diagonal imaginary parts do not matter
            return r
        return _sqrtm

    monkeypatch.setattr(metrics, "_sqrtm", fake(9e-4))
    assert frechet_distance(mu, s, mu, s) == pytest.approx(2 * d - 2 * 0.5 * d)  # real part used
    monkeypatch.setattr(metrics, "_sqrtm", fake(2e-3))
    with pytest.raises(ValueError, match="imaginary"):
        frechet_distance(mu, s, mu, s)


def test_frechet_distance_rejects_mismatched_shapes():
    with pytest.raises(ValueError):
        frechet_distance(np.zeros(3), np.eye(3), np.zeros(4), np.eye(4))


def _is_reference(logits, split_size):
    scores = []
    for start in range(0, len(logits), split_size):
        part = logits[start:start + split_size].astype(np.float64)
        e = np.exp(part - part.max(axis=1, keepdims=True))
        p = e / e.sum(axis=1, keepdims=True)
        py = p.mean(axis=0)
        kls = [sum(p[i, c] * (np.log(p[i, c]) - np.log(py[c])) for c in range(p.shape[1])) for i in range(len(p))]
        scores.append(np.exp(np.mean(kls)))
    return float(np.mean(scores))


def test_inception_score_matches_float64_reference():
    rng = np.random.default_rng(4)
    logits = (rng.standard_normal((23, 17)) * 3).astype(np.float32)
    for split in (5, 7, 23, 5000):  # partial last split included, no shuffle
        assert inception_score(logits, split_size=split) == pytest.approx(_is_reference(logits, split), rel=1e-6)
    # uniform predictions -> 1; confident and balanced -> number of classes
    assert inception_score(np.zeros((10, 5))) == pytest.approx(1.0)
    confident = np.eye(5)[np.arange(10) % 5] * 100
    assert inception_score(confident) == pytest.approx(5.0, rel=1e-6)


# ---------------------------------------------------------------------------------------------
# precision / recall
# ---------------------------------------------------------------------------------------------
def _brute_force_pr(ref, sample, k=3):
    """float64, explicit loops over points: returns (precision, recall, ambiguous_precision,
    ambiguous_recall) where 'ambiguous' counts points within `tol` of a manifold boundary."""
    ref, sample = ref.astype(np.float64), sample.astype(np.float64)

    def sqdist(a, b):
        return ((a[:, None, :] - b[None, :, :]) ** 2).sum(-1)

    def radii(x):
        d = sqdist(x, x)
        return np.array([np.sort(np.delete(d[i], i))[k - 1] for i in range(len(x))])

    r_ref, r_sample = radii(ref), radii(sample)
    d = sqdist(ref, sample)
    tol = 4e-3 * d.max()  # float16 rounding of |u|^2 - 2uv + |v|^2
    margin_sample = (d - r_ref[:, None]).min(axis=0)  # sample j vs reference manifold
    margin_ref = (d - r_sample[None, :]).min(axis=1)  # reference i vs sample manifold
    precision = np.mean(margin_sample <= 0)
    recall = np.mean(margin_ref <= 0)
    return precision, recall, np.mean(np.abs(margin_sample) <= tol), np.mean(np.abs(margin_ref) <= tol)


def test_precision_recall_matches_brute_force_within_float16_rounding():
    rng = np.random.default_rng(5)
    ref = rng.random((70, 16)).astype(np.float32)
    sample = (rng.random((55, 16)) * 1.2 + 0.05).astype(np.float32)
    p, r = precision_recall(ref, sample, row_batch_size=16, col_batch_size=9)  # many blocks
    bp, br, amb_p, amb_r = _brute_force_pr(ref, sample)
    assert abs(p - bp) <= amb_p + 1e-12
    assert abs(r - br) <= amb_r + 1e-12
    assert 0.0 < bp < 1.0 and 0.0 < br < 1.0  # a non-trivial case
    # block sizes do not change the answer
    assert precision_recall(ref, sample) == (p, r)


def _clusters(rng, centres, per, spread=0.01):
    return np.concatenate([c + spread * rng.standard_normal((per, len(c))) for c in centres]).astype(np.float32)


def test_precision_recall_exact_on_well_separated_sets():
    rng = np.random.default_rng(6)
    d = 8
    centres = np.eye(d)[:4] * 10
    ref = _clusters(rng, centres[:3], 10)  # clusters 0, 1, 2
    sample = _clusters(rng, centres[[0, 1, 3]], 10)  # clusters 0, 1 and a far-away 3
    p, r = precision_recall(ref, sample, row_batch_size=7, col_batch_size=13)
    assert p == 2 / 3 and r == 2 / 3
    assert precision_recall(ref, ref) == (1.0, 1.0)
    # torch tensors give the same result
    assert precision_recall(torch.from_numpy(ref), torch.from_numpy(sample)) == (p, r)


def test_precision_recall_float32_fallback_when_float16_overflows():
    rng = np.random.default_rng(7)
    centres = np.eye(4)[:3] * 5000.0  # squared norms ~2.5e7: float16 overflows
    ref = _clusters(rng, centres[:2], 6, spread=1.0)
    sample = _clusters(rng, centres[[0, 2]], 6, spread=1.0)
    u = torch.from_numpy(ref)
    dist = pairwise_sq_distances(u, u)
    assert torch.isfinite(dist).all()
    exact = ((ref[:, None].astype(np.float64) - ref[None]) ** 2).sum(-1)
    np.testing.assert_allclose(dist.numpy(), exact, atol=1e-6 * exact.max())
    assert precision_recall(ref, sample) == (0.5, 0.5)


def test_pairwise_distances_are_rounded_to_float16():
    rng = np.random.default_rng(8)
    u = torch.from_numpy(rng.random((5, 3)).astype(np.float32))
    v = torch.from_numpy(rng.random((4, 3)).astype(np.float32))
    d = pairwise_sq_distances(u, v)
    assert d.dtype == torch.float16  # a finite float16 block is returned as is (half the memory)
    d = d.float()
    exact = ((u[:, None].double() - v[None].double()) ** 2).sum(-1)
    np.testing.assert_allclose(d.numpy(), exact.numpy(), atol=5e-3)
    assert (d >= 0).all()


def test_precision_recall_needs_k_plus_one_points():
    x = np.zeros((3, 4), np.float32)
    with pytest.raises(ValueError, match="at least 4"):
        precision_recall(x, np.ones((10, 4), np.float32))


def test_no_warnings_from_regular_fid():
    rng = np.random.default_rng(9)
    mu1, s1 = feature_statistics(_random_gaussian_features(rng, 200, 10))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        frechet_distance(mu1, s1, mu1 + 1, s1)


def test_running_statistics_match_the_two_pass_statistics():
    from evaluations.metrics import RunningStatistics

    rng = np.random.default_rng(11)
    features = (rng.random((1000, 16)) * 3 + 50).astype(np.float32)  # a large mean tests the shift
    running = RunningStatistics()
    for start in range(0, 1000, 64):
        running.update(features[start:start + 64])
    mu, sigma = running.result()
    np.testing.assert_allclose(mu, features.astype(np.float64).mean(0), rtol=1e-12)
    np.testing.assert_allclose(sigma, np.cov(features.astype(np.float64), rowvar=False), rtol=1e-9, atol=1e-12)
