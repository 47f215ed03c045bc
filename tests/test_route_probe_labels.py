"""The route probe's picture (tools/route_probe_report.py, tools/route_probe_labels.py): each route's label
readable where routes crowd, as they do near damage 0 on a model trained with a route."""
import json
import math

import pytest
from matplotlib.text import Text

from tools import route_probe_report
from tools.route_probe_labels import needs_leader, overlaps, place_labels
from tools.route_probe_measure import default_candidates
from tools.route_probe_report import annotate
from tread_utils.errors import report_user_errors


def test_labels_in_a_crowd_do_not_overlap():
    anchors = [(100 + 3 * (k % 5), 50 + 2 * (k // 5)) for k in range(30)]  # 30 points within 15 x 12 pixels
    sizes = [(18 + k % 3 * 4, 8) for k in range(30)]
    markers = [(x - 3, y - 3, x + 3, y + 3) for x, y in anchors]
    bounds = (0, 0, 400, 300)
    boxes = place_labels(anchors, sizes, bounds, markers + [(300, 200, 400, 300)])
    for i, a in enumerate(boxes):
        assert a[2] - a[0] == pytest.approx(sizes[i][0]) and a[3] - a[1] == pytest.approx(sizes[i][1])
        assert bounds[0] <= a[0] and a[2] <= bounds[2] and bounds[1] <= a[1] and a[3] <= bounds[3]
        assert not any(overlaps(a, b) for b in boxes[i + 1:] + markers + [(300, 200, 400, 300)]), i
        if not needs_leader(anchors[i], a):  # beside its point, nearer to it than to any other
            nearest = min(range(30), key=lambda j: math.dist(anchors[j], (min(max(anchors[j][0], a[0]), a[2]),
                                                                          min(max(anchors[j][1], a[1]), a[3]))))
            assert nearest == i
    assert 0 < sum(needs_leader(p, b) for p, b in zip(anchors, boxes)) < 30


def crowded_result() -> dict:
    """The default grid on 12 blocks as a model trained with 2 -> 8 shows it: every route inside at damage ~0."""
    rows = []
    for c in default_candidates(12):
        speedup = 12 / (12 - c.ratio * (c.end - c.start + 1))
        damage = 1e-4 * c.start if 2 <= c.start and c.end <= 8 else 0.2 * (speedup - 1) + 0.01 * c.start
        rows.append({"route": c.name, "start": c.start, "end": c.end, "ratio": c.ratio, "flop_speedup_bound": speedup,
                     "activation_memory_fraction": 1 / speedup, "damage": damage,
                     "damage_ci": [damage - 0.002, damage + 0.002]})
    return annotate({"routes": rows, "depth": 12, "block_similarity": [0.99] * 12}, 1.3)


def test_the_probe_picture_labels_do_not_overlap(tmp_path, monkeypatch):
    boxes = []

    def measured(plt, fig, out, stem):  # as report_plots.save lays the figure out, the labels' own boxes
        fig.tight_layout()
        fig.canvas.draw()
        boxes.extend(Text.get_window_extent(t, fig.canvas.get_renderer()) for t in fig.axes[0].texts)
        plt.close(fig)

    monkeypatch.setattr(route_probe_report, "save", measured)
    route_probe_report.plot(crowded_result(), tmp_path)
    assert len(boxes) == 27
    for i, a in enumerate(boxes):
        assert not any(overlaps((a.x0, a.y0, a.x1, a.y1), (b.x0, b.y0, b.x1, b.y1)) for b in boxes[i + 1:]), i


def test_pictures_are_drawn_again_from_a_recorded_probe(tmp_path, capsys):
    result = crowded_result()
    (tmp_path / "probe.json").write_text(json.dumps(result))
    assert route_probe_report.main([str(tmp_path / "probe.json")]) == [tmp_path / "probe.png"]
    assert (tmp_path / "probe.png").stat().st_size > 0 and (tmp_path / "probe.svg").stat().st_size > 0
    (tmp_path / "other.json").write_text(json.dumps({"routes": []}))
    with pytest.raises(SystemExit) as stop:
        report_user_errors(route_probe_report.main)([str(tmp_path / "other.json")])
    err = capsys.readouterr().err.strip()
    assert stop.value.code == 2 and "is not a probe.json" in err and "\n" not in err
