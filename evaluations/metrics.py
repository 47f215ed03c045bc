"""Sample-quality metrics with the exact rules of the ADM evaluation suite (guided-diffusion/evaluations).

* :func:`feature_statistics` - mean and covariance (N - 1 normalisation) of a feature set.
* :func:`frechet_distance` - FID / sFID between two Gaussians. ``scipy.linalg.sqrtm`` of
  ``sigma1 @ sigma2``; if not finite, 1e-6 * I is added to both covariances and the root retried; a
  complex root is an error unless its diagonal's imaginary part is within 1e-3 of 0, in which case
  the real part is used.
* :func:`inception_score` - softmax of the logits, consecutive splits (no shuffle) of ``split_size``,
  per split ``exp(mean KL(p || mean p))``, mean over splits; :class:`InceptionScoreSplits` the same over
  logits that arrive in batches and are not kept (one split in memory).
* :func:`precision_recall` - improved precision/recall (Kynkaanniemi et al.) with k = 3: squared
  Euclidean distances computed in float16 in blocks of 10,000 rows, 5,000 on the CPU (float32 for a
  block whose float16 result is not finite; the block size never changes the result); the radius of
  a point is its k-th nearest-neighbour distance within its own set (itself excluded); a point is inside a manifold if its distance to some point of it is
  <= that point's radius. Never builds the full distance matrix: memory is O(block^2).

Everything accepts numpy arrays or torch tensors. Distances run on the tensors' device (GPU when the
features are CUDA tensors, or when ``device`` says so); statistics and the Inception Score copy GPU
tensors to the host a chunk at a time, never whole.
"""
from __future__ import annotations

import warnings

import numpy as np
import scipy.linalg
import scipy.special
import torch

SQRTM_EPS = 1e-6
IMAG_ATOL = 1e-3
ROW_BATCH = 10_000  # ADM's distance block; the block size changes memory and speed, never the result
COL_BATCH = 10_000
CPU_BATCH = 5_000  # default on the CPU, where blocks live in host memory: ~180 MB of temporaries per block


def _as_numpy64(x) -> np.ndarray:
    if torch.is_tensor(x):
        x = x.detach().cpu().numpy()
    return np.asarray(x, dtype=np.float64)


def _host_rows(features, start: int, stop: int) -> np.ndarray:
    """Rows [start, stop) as a host numpy array, as stored (a GPU tensor is copied over for these rows only)."""
    rows = features[start:stop]
    return rows.detach().cpu().numpy() if torch.is_tensor(rows) else rows


# --------------------------------------------------------------------------------------------
# FID
# --------------------------------------------------------------------------------------------
def feature_statistics(features, chunk: int = 2048):
    """(mu [D], sigma [D, D]) in float64; sigma is the unbiased covariance (N - 1), like np.cov.

    Computed in float64 row chunks of 2048 (32 MB at D=2048), never a float64 (or host) copy of the whole set.
    """
    if not torch.is_tensor(features):
        features = np.asarray(features)
    if features.ndim != 2:
        raise ValueError(f"features must be 2-D [N, D], got shape {tuple(features.shape)}")
    n, d = features.shape
    if n < 2:
        raise ValueError(f"need at least 2 feature vectors for a covariance, got {n}")
    total = np.zeros(d, dtype=np.float64)
    for start in range(0, n, chunk):
        total += _host_rows(features, start, start + chunk).astype(np.float64).sum(axis=0)
    mu = total / n
    sigma = np.zeros((d, d), dtype=np.float64)
    for start in range(0, n, chunk):
        centred = _host_rows(features, start, start + chunk).astype(np.float64) - mu
        sigma += centred.T @ centred
    sigma /= n - 1
    return mu, sigma


class RunningStatistics:
    """feature_statistics over batches that are not kept: float64 sums of the features shifted by the
    first batch's mean (a shift keeps the one-pass covariance as accurate as the two-pass one)."""

    def __init__(self):
        self.n, self.shift, self.total, self.outer = 0, None, None, None

    def update(self, batch):
        batch = np.asarray(batch, dtype=np.float64).reshape(len(batch), -1)
        if self.shift is None:
            self.shift = batch.mean(axis=0)
            self.total = np.zeros_like(self.shift)
            self.outer = np.zeros((len(self.shift), len(self.shift)))
        centred = batch - self.shift
        self.n += len(batch)
        self.total += centred.sum(axis=0)
        self.outer += centred.T @ centred

    def merge(self, other: "RunningStatistics") -> "RunningStatistics":
        """Add the vectors `other` has seen (e.g. another process's share): its sums are re-centred on
        this shift, x - s = (x - s_other) + d with d = s_other - s."""
        if other.n == 0:
            return self
        if self.n == 0:
            self.n, self.shift = other.n, other.shift.copy()
            self.total, self.outer = other.total.copy(), other.outer.copy()
            return self
        d = other.shift - self.shift
        self.outer += other.outer + np.outer(other.total, d) + np.outer(d, other.total) + other.n * np.outer(d, d)
        self.total += other.total + other.n * d
        self.n += other.n
        return self

    def result(self):
        """(mu [D], sigma [D, D]), sigma unbiased (N - 1) like np.cov."""
        if self.n < 2:
            raise ValueError(f"need at least 2 feature vectors for a covariance, got {self.n}")
        mean_shifted = self.total / self.n
        sigma = (self.outer - self.n * np.outer(mean_shifted, mean_shifted)) / (self.n - 1)
        return self.shift + mean_shifted, sigma


def _sqrtm(a: np.ndarray) -> np.ndarray:
    with warnings.catch_warnings():
        # scipy warns about singular input; the finiteness check below is the ADM rule that matters.
        warnings.simplefilter("ignore")
        return scipy.linalg.sqrtm(a)


def frechet_distance(mu1, sigma1, mu2, sigma2, eps: float = SQRTM_EPS) -> float:
    """|mu1 - mu2|^2 + tr(sigma1) + tr(sigma2) - 2 tr(sqrtm(sigma1 sigma2)), ADM rules."""
    mu1, mu2 = np.atleast_1d(_as_numpy64(mu1)), np.atleast_1d(_as_numpy64(mu2))
    sigma1, sigma2 = np.atleast_2d(_as_numpy64(sigma1)), np.atleast_2d(_as_numpy64(sigma2))
    if not mu1.shape == mu2.shape == sigma1.shape[:1] or not sigma1.shape == sigma2.shape == mu1.shape * 2:
        raise ValueError(f"FID needs two means [D] and two covariances [D, D] of one D, got means {mu1.shape}, "
                         f"{mu2.shape} and covariances {sigma1.shape}, {sigma2.shape}")
    diff = mu1 - mu2
    covmean = _sqrtm(sigma1.dot(sigma2))
    if not np.isfinite(covmean).all():
        warnings.warn(f"FID: sqrtm of the covariance product is not finite; adding {eps} to the "
                      f"diagonal of both covariances", RuntimeWarning, stacklevel=2)
        offset = np.eye(sigma1.shape[0]) * eps
        covmean = _sqrtm((sigma1 + offset).dot(sigma2 + offset))
    if np.iscomplexobj(covmean):
        if not np.allclose(np.diagonal(covmean).imag, 0, atol=IMAG_ATOL):
            raise ValueError(f"FID: sqrtm has an imaginary component of {np.max(np.abs(covmean.imag))} "
                             f"(more than {IMAG_ATOL} on the diagonal); the statistics are degenerate")
        covmean = covmean.real
    return float(diff.dot(diff) + np.trace(sigma1) + np.trace(sigma2) - 2.0 * np.trace(covmean))


# --------------------------------------------------------------------------------------------
# Inception Score
# --------------------------------------------------------------------------------------------
def _split_score(part: np.ndarray) -> float:
    """exp(mean_i KL(p_i || mean_j p_j)) of one split of float64 logits (overwritten with log p)."""
    part -= scipy.special.logsumexp(part, axis=1, keepdims=True)
    p = np.exp(part)
    log_marginal = np.log(p.mean(axis=0, keepdims=True))
    kl = np.sum(p * (part - log_marginal), axis=1)
    return np.exp(kl.mean())


def inception_score(logits, split_size: int = 5000) -> float:
    """Mean over consecutive splits of exp(mean_i KL(p_i || mean_j p_j)), p = softmax(logits)."""
    if not torch.is_tensor(logits):
        logits = np.asarray(logits)
    if logits.ndim != 2 or len(logits) == 0:
        raise ValueError(f"logits must be a non-empty [N, C] array, got shape {tuple(logits.shape)}")
    scores = InceptionScoreSplits(split_size, total=len(logits))  # float64 one split at a time: 40 MB at 50K
    for start in range(0, len(logits), split_size):
        scores.update(_host_rows(logits, start, start + split_size))
    return scores.result()


class InceptionScoreSplits:
    """The Inception Score of logits that arrive in batches and are not kept (`inception_score` feeds it a split at
    a time): the rows of the current split are gathered in a float64 buffer and scored as soon as the split is
    complete, so one split is in memory and the result does not depend on how the rows were batched. ``total``:
    how many rows will come, if known (sizes the last split's buffer; more rows than that are refused)."""

    def __init__(self, split_size: int = 5000, total: int | None = None):
        if split_size < 1:
            raise ValueError(f"split_size must be >= 1, got {split_size}")
        self.split_size, self.total = split_size, total
        self.n, self.filled, self.buffer, self.scores = 0, 0, None, []

    def update(self, batch):
        batch = np.asarray(batch)
        if batch.ndim != 2:
            raise ValueError(f"logits must be [B, C], got shape {batch.shape}")
        if self.total is not None and self.n + len(batch) > self.total:
            raise ValueError(f"{self.n + len(batch)} rows of logits, more than the {self.total} announced")
        start = 0
        while start < len(batch):
            if self.buffer is None:
                rows = self.split_size if self.total is None else min(self.split_size, self.total - self.n)
                self.buffer = np.empty((rows, batch.shape[1]), dtype=np.float64)
            take = min(len(batch) - start, len(self.buffer) - self.filled)
            self.buffer[self.filled:self.filled + take] = batch[start:start + take]
            self.filled, self.n, start = self.filled + take, self.n + take, start + take
            if self.filled == len(self.buffer):
                self._score_split()

    def _score_split(self):
        self.scores.append(_split_score(self.buffer[:self.filled]))
        self.buffer, self.filled = None, 0

    def result(self) -> float:
        if self.filled:
            self._score_split()
        if not self.scores:
            raise ValueError("no logits were given")
        return float(np.mean(self.scores))


# --------------------------------------------------------------------------------------------
# Precision / recall
# --------------------------------------------------------------------------------------------
def _block(features, start: int, stop: int, device) -> torch.Tensor:
    rows = features[start:stop]
    if not torch.is_tensor(rows):
        rows = torch.from_numpy(np.ascontiguousarray(rows))
    return rows.to(device=device, dtype=torch.float32)


# Rows per step of the elementwise work on a distance block. On the CPU, temporaries of a whole block (20-25 MB)
# fall below glibc's mmap threshold once it has grown, land on its heap and stay resident after they are freed:
# precision/recall of 20K x 10K features peaked 474 MB above them that way, 273 MB in chunks. Elementwise
# results do not depend on the chunking.
ELEMENTWISE_ROWS = 512


def _row_chunks(n: int):
    return ((i, min(i + ELEMENTWISE_ROWS, n)) for i in range(0, n, ELEMENTWISE_ROWS))


def _rounded_to_half(x: torch.Tensor):
    """``x`` rounded to float16, held as float32 (for the float32-accumulated product), and its float16
    squared norms (each square rounded to float16, summed in float32, the sum rounded to float16)."""
    rounded, squares = torch.empty_like(x), torch.empty_like(x)
    for i, j in _row_chunks(len(x)):
        rounded[i:j] = x[i:j].to(torch.float16)
        squares[i:j] = rounded[i:j].square().half()
    return rounded, squares.sum(1).half()


def pairwise_sq_distances(u: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """ADM's distance block: max(|u|^2 - 2 u.v + |v|^2, 0), computed in float16 (inputs and every
    intermediate rounded to float16, products accumulated in float32 like a GPU half GEMM); if any
    value is not finite, the block is recomputed in float32. Returns [len(u), len(v)]: the float16 block
    itself when finite (ADM casts it to float32, which is exact, so comparisons and top-k agree while
    the block takes half the memory), else the float32 recomputation."""
    # Each temporary goes as soon as it is used: at 5,000 x 5,000 x 2048 the rounded inputs (41 MB each)
    # and the float32 product (100 MB) would otherwise all coexist with the float16 block.
    uf, norm_u = _rounded_to_half(u)
    vf, norm_v = _rounded_to_half(v)
    product = uf @ vf.t()
    del uf, vf
    dist = torch.empty(product.shape, dtype=torch.float16, device=product.device)
    for i, j in _row_chunks(len(dist)):
        dist[i:j] = product[i:j]
    del product
    # (|u|^2 - 2 u.v) + |v|^2, each step rounded to float16 (in place: -2x is exact, + commutes)
    dist.mul_(-2).add_(norm_u[:, None]).add_(norm_v[None, :])
    # amax/amin catch +-inf and propagate NaN (and are much faster than isfinite on CPU halves)
    if bool(torch.isfinite(torch.stack([dist.amax(), dist.amin()]).float()).all()):
        return dist.clamp_(min=0)
    del dist
    norm_u = u.square().sum(1)
    norm_v = v.square().sum(1)
    dist = u @ v.t()
    dist.mul_(-2).add_(norm_u[:, None]).add_(norm_v[None, :])
    return dist.clamp_(min=0)


def _pick_device(device, *arrays):
    if device is not None:
        return torch.device(device)
    for a in arrays:
        if torch.is_tensor(a):
            return a.device
    return torch.device("cpu")


def _block_sizes(device, row_batch_size, col_batch_size):
    default = CPU_BATCH if device.type == "cpu" else None
    return row_batch_size or default or ROW_BATCH, col_batch_size or default or COL_BATCH


def manifold_radii(features, k: int = 3, row_batch_size: int | None = None, col_batch_size: int | None = None,
                   device=None) -> torch.Tensor:
    """Squared distance of every point to its k-th nearest neighbour in the same set (itself
    excluded: entry k of the sorted row, whose entry 0 is the point itself). float32 [N], on device."""
    device = _pick_device(device, features)
    row_batch_size, col_batch_size = _block_sizes(device, row_batch_size, col_batch_size)
    n = len(features)
    if n < k + 1:
        raise ValueError(f"precision/recall with k={k} needs at least {k + 1} feature vectors, got {n}")
    radii = torch.empty(n, dtype=torch.float32, device=device)
    for r0 in range(0, n, row_batch_size):
        rows = _block(features, r0, r0 + row_batch_size, device)
        best = None
        for c0 in range(0, n, col_batch_size):
            dist = pairwise_sq_distances(rows, _block(features, c0, c0 + col_batch_size, device))
            smallest = torch.topk(dist, min(k + 1, dist.shape[1]), dim=1, largest=False).values
            del dist
            best = smallest if best is None else torch.cat([best, smallest], dim=1)
            best = torch.topk(best, min(k + 1, best.shape[1]), dim=1, largest=False).values
        radii[r0:r0 + len(rows)] = best[:, k].float()
    return radii


def precision_recall(ref_features, sample_features, k: int = 3, row_batch_size: int | None = None,
                     col_batch_size: int | None = None, device=None):
    """(precision, recall): precision = share of samples inside the reference manifold, recall =
    share of reference points inside the sample manifold (ADM's ManifoldEstimator, k = 3)."""
    shapes = [tuple(getattr(f, "shape", ())) for f in (ref_features, sample_features)]
    if len(shapes[0]) != 2 or len(shapes[1]) != 2 or shapes[0][1] != shapes[1][1]:
        raise ValueError(f"precision/recall needs reference and sample features [N, D] of one D, got {shapes}")
    device = _pick_device(device, ref_features, sample_features)
    row_batch_size, col_batch_size = _block_sizes(device, row_batch_size, col_batch_size)
    radii_ref = manifold_radii(ref_features, k, row_batch_size, col_batch_size, device)
    radii_sample = manifold_radii(sample_features, k, row_batch_size, col_batch_size, device)
    ref_in = torch.zeros(len(ref_features), dtype=torch.bool, device=device)  # ref inside sample manifold
    sample_in = torch.zeros(len(sample_features), dtype=torch.bool, device=device)  # sample inside ref manifold
    for r0 in range(0, len(ref_features), row_batch_size):
        rows = _block(ref_features, r0, r0 + row_batch_size, device)
        for c0 in range(0, len(sample_features), col_batch_size):
            cols = _block(sample_features, c0, c0 + col_batch_size, device)
            dist = pairwise_sq_distances(rows, cols)
            c1 = c0 + len(cols)
            for i, j in _row_chunks(len(dist)):  # boolean masks a chunk of rows at a time (see ELEMENTWISE_ROWS)
                ref_in[r0 + i:r0 + j] |= (dist[i:j] <= radii_sample[c0:c1][None, :]).any(dim=1)
                sample_in[c0:c1] |= (dist[i:j] <= radii_ref[r0 + i:r0 + j, None]).any(dim=0)
            del dist
    return sample_in.sum().item() / len(sample_in), ref_in.sum().item() / len(ref_in)
