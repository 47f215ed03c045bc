"""Labels beside crowded points without overlaps (the route probe's picture, tools/route_probe_report.py).

Routes of similar speed-up and damage sit on top of each other (a model trained with a route puts every route
inside it near damage 0), and a label at a fixed offset from each point turns such a cluster into one smudge.
`place_labels` puts each label, in display coordinates (pixels), at the nearest free spot around its point:
rings of growing radius, the upper right first, skipping spots that overlap a label or leader line already
placed or an obstacle (the points, their error bars, the drawn lines, the legend). A label that ends up away
from its point gets a leader line (`needs_leader`).
"""
import math

import numpy as np

PREFERRED_ANGLE = math.pi / 4  # upper right of the point, where the labels used to sit
FIRST = 5.0  # pixels between a point and a label right beside it: clear of a marker 3 pixels in half-size
NEAR = 6  # label heights: how far a label may go to find a leader line that crosses nothing


def overlaps(a, b, gap: float = 0.0) -> bool:
    """Whether boxes (x0, y0, x1, y1) `a` and `b` come closer than `gap`."""
    return a[0] < b[2] + gap and b[0] < a[2] + gap and a[1] < b[3] + gap and b[1] < a[3] + gap


def ring(anchor, size, radius: float, count: int) -> np.ndarray:
    """`count` boxes of `size` around `anchor`, each touching the square of half-side `radius` around it from
    outside, in order of preference: nearest the upper right first."""
    angles = PREFERRED_ANGLE + 2 * math.pi * np.arange(count) / count
    angles = angles[np.argsort(np.abs((angles - PREFERRED_ANGLE + math.pi) % (2 * math.pi) - math.pi),
                               kind="stable")]
    cos, sin = np.cos(angles), np.sin(angles)
    scale = np.maximum(np.abs(cos), np.abs(sin))  # walk the square's perimeter, not the circle's
    ux, uy = cos / scale, sin / scale
    w, h = size
    cx = anchor[0] + ux * radius + ux * w / 2
    cy = anchor[1] + uy * radius + uy * h / 2
    return np.stack([cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2], axis=1)


def free(candidates: np.ndarray, taken: np.ndarray, gap: float) -> np.ndarray:
    """Which candidate boxes [m, 4] overlap none of the boxes `taken` [p, 4] (closer than `gap`)."""
    if not len(taken):
        return np.ones(len(candidates), dtype=bool)
    c, t = candidates[:, None, :], taken[None, :, :]
    hit = (c[..., 0] < t[..., 2] + gap) & (t[..., 0] < c[..., 2] + gap) & \
          (c[..., 1] < t[..., 3] + gap) & (t[..., 1] < c[..., 3] + gap)
    return ~hit.any(axis=1)


def distances(boxes: np.ndarray, points: np.ndarray) -> np.ndarray:
    """[m, n] distances from each box [m, 4] to each point [n, 2] (0 inside)."""
    x, y = points[None, :, 0], points[None, :, 1]
    dx = np.maximum(np.maximum(boxes[:, None, 0] - x, x - boxes[:, None, 2]), 0)
    dy = np.maximum(np.maximum(boxes[:, None, 1] - y, y - boxes[:, None, 3]), 0)
    return np.hypot(dx, dy)


def leader_samples(anchor, boxes: np.ndarray, first: float, count: int = 12) -> np.ndarray:
    """[m, count, 2] points along the line from `anchor` to each box's centre, from `first` pixels out (clear
    of the point's own marker and error bar caps)."""
    centre = np.stack([(boxes[:, 0] + boxes[:, 2]) / 2, (boxes[:, 1] + boxes[:, 3]) / 2], axis=1)
    length = np.maximum(np.hypot(*(centre - anchor).T), first)
    t = first / length[:, None] + (1 - first / length[:, None]) * np.linspace(0, 1, count)[None, :]
    return np.asarray(anchor)[None, None, :] + t[..., None] * (centre - anchor)[:, None, :]


def crossed(samples: np.ndarray, taken: np.ndarray, gap: float) -> np.ndarray:
    """Which lines (their sample points [m, s, 2]) pass through a box of `taken` [p, 4]."""
    if not len(taken):
        return np.zeros(len(samples), dtype=bool)
    x, y = samples[:, :, None, 0], samples[:, :, None, 1]
    t = taken[None, None, :, :]
    inside = (x > t[..., 0] - gap) & (x < t[..., 2] + gap) & (y > t[..., 1] - gap) & (y < t[..., 3] + gap)
    return inside.any(axis=(1, 2))


def place_labels(anchors, sizes, bounds, obstacles=(), gap: float = 1.0, first: float = FIRST) -> list:
    """Boxes (x0, y0, x1, y1), one per label of `sizes` [(w, h)] at `anchors` [(x, y)], none overlapping another
    label, an obstacle box or a leader line. Labels are placed in the order given, each at the nearest spot the
    earlier ones leave inside `bounds` (x0, y0, x1, y1), by the first rule that finds one: within NEAR label
    heights, a leader line that crosses no label or obstacle; within NEAR, one that crosses no label; anywhere
    inside; anywhere. A label right beside its point (no leader line) must be nearer to it than to any other
    point, so that it cannot be read as another point's."""
    taken = [tuple(map(float, b)) for b in obstacles]
    labels, lines = [], []  # lines: the sample points of the leader lines placed, as boxes of no size
    points = np.asarray(anchors, dtype=float).reshape(-1, 2)
    diagonal = math.hypot(bounds[2] - bounds[0], bounds[3] - bounds[1])

    def nearest(i, size, limit, line_avoids):
        """(box, ring index) of the nearest spot for label `i` within `limit` pixels and the bounds (None: no
        limit, no bounds; that search always ends, every spot far enough out being free), its leader line
        crossing none of the boxes `line_avoids`; None if there is none."""
        anchor, step = points[i], max(2.0, min(size) / 2)
        k = 0
        while limit is None or first + k * step <= limit:
            boxes = ring(anchor, size, first + k * step, 8 * (k + 1))
            ok = free(boxes, np.array(taken + labels + lines).reshape(-1, 4), gap)
            if k == 0 and len(points) > 1:
                near = distances(boxes, points)
                ok &= near[:, i] < np.delete(near, i, axis=1).min(axis=1)
            if limit is not None:
                ok &= (boxes[:, 0] >= bounds[0]) & (boxes[:, 1] >= bounds[1]) & \
                      (boxes[:, 2] <= bounds[2]) & (boxes[:, 3] <= bounds[3])
            if k and len(line_avoids):
                ok &= ~crossed(leader_samples(anchor, boxes, first), np.array(line_avoids).reshape(-1, 4), gap)
            if ok.any():
                return boxes[int(np.argmax(ok))], k
            k += 1
        return None

    for i, size in enumerate(sizes):
        close = NEAR * size[1]
        box, k = (nearest(i, size, close, taken + labels) or nearest(i, size, close, labels) or
                  nearest(i, size, diagonal, []) or nearest(i, size, None, []))
        labels.append(tuple(float(v) for v in box))
        if k:
            lines += [(x, y, x, y) for x, y in leader_samples(points[i], box[None], first)[0].tolist()]
    return labels


def needs_leader(anchor, box, first: float = FIRST) -> bool:
    """Whether `box` sits farther from its point than the first ring (`first` as `place_labels` was given it):
    then a line joins them."""
    dx = max(box[0] - anchor[0], 0.0, anchor[0] - box[2])
    dy = max(box[1] - anchor[1], 0.0, anchor[1] - box[3])
    return max(dx, dy) > first + 1.0
