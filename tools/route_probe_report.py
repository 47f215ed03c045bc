"""The route probe's report (tools/route_probe.py): the Pareto front of damage against speed-up, the suggested
route, and the markdown table, JSON and picture of one probe. Run as a module, it redraws the pictures of
recorded probes from their JSON:

    python -m tools.route_probe_report docs/results/route_probe/digits/probe.json
"""
import json
import sys
from pathlib import Path

import numpy as np

from tools.report_plots import new_figure, save
from tools.route_probe_labels import needs_leader, place_labels
from tools.route_probe_trained import containing, suggestion_caveat, trained_line
from tread_utils.cli import ArgumentParser
from tread_utils.errors import UserError, report_user_errors


def pareto_front(rows) -> set:
    """Indices of the routes no other route beats: none is at least as fast with no more damage, and better in
    one of the two."""
    front = set()
    for i, a in enumerate(rows):
        beaten = any(b["flop_speedup_bound"] >= a["flop_speedup_bound"] and b["damage"] <= a["damage"] and
                     (b["flop_speedup_bound"] > a["flop_speedup_bound"] or b["damage"] < a["damage"])
                     for j, b in enumerate(rows) if j != i)
        if not beaten:
            front.add(i)
    return front


def suggest(rows, target_speedup=None, target_memory=None):
    """The least-damage route whose FLOP-bound speed-up is at least `target_speedup` and whose activation-memory
    fraction is at most `target_memory` (either may be None); None when no route meets them."""
    meeting = [r for r in rows
               if (target_speedup is None or r["flop_speedup_bound"] >= target_speedup)
               and (target_memory is None or r["activation_memory_fraction"] <= target_memory)]
    return min(meeting, key=lambda r: (r["damage"], -r["flop_speedup_bound"]), default=None)


def annotate(result: dict, target_speedup=None, target_memory=None) -> dict:
    """Marks the Pareto front and adds the targets and the suggestion to a `measure` result."""
    front = pareto_front(result["routes"])
    trained = result.get("trained_routes")
    for i, row in enumerate(result["routes"]):
        row["pareto"] = i in front
        if trained and trained["routes"] is not None:
            row["inside_trained_route"] = containing(row["start"], row["end"], trained)
    chosen = suggest(result["routes"], target_speedup, target_memory)
    result.update(target_speedup=target_speedup, target_memory=target_memory,
                  suggestion=None if chosen is None else chosen["route"])
    return result


def suggestion_line(result: dict) -> str:
    targets = " and ".join(t for t in (
        f"a FLOP-bound speed-up of at least {result['target_speedup']:g}x" if result["target_speedup"] else "",
        f"at most {result['target_memory']:.0%} of the block activation memory" if result["target_memory"] else "")
        if t) or "no target"
    if result["suggestion"] is None:
        best = max(r["flop_speedup_bound"] for r in result["routes"])
        return (f"No candidate meets {targets} (the fastest reaches {best:.3f}x): lower the target or add routes "
                f"with --routes.")
    row = next(r for r in result["routes"] if r["route"] == result["suggestion"])
    return (f"Suggested route for {targets}: {row['route']} (speed-up bound {row['flop_speedup_bound']:.3f}x, "
            f"activation memory {row['activation_memory_fraction']:.0%}, damage {row['damage']:+.5f} "
            f"[{row['damage_ci'][0]:+.5f}, {row['damage_ci'][1]:+.5f}], {row['relative_damage']:+.1%} of the "
            f"unrouted loss)." + suggestion_caveat(result))


def markdown(result: dict) -> str:
    timed = result["routes"] and "step_ms" in result["routes"][0]
    marked = any(r.get("inside_trained_route") for r in result["routes"])
    head = ("| route | speed-up bound | activation memory | loss | damage | "
            f"{result['confidence']:.0%} interval | relative | Pareto |" +
            (" unrouted step (ms) | step (ms) | measured speed-up |" if timed else "") +
            (" inside trained route |" if marked else ""))
    trained = trained_line(result)
    lines = [f"# Route probe: {result['model']}", "",
             f"Command: `{result['command']}`", "",
             f"Source: `{result['source']}`; {result['samples']} samples ({result['batches']} batches of "
             f"{result['batch_size']}), seed {result['seed']}. Unrouted training loss {result['unrouted_loss']:.5f}."
             + (f" Step times: medians of {result['time_steps']} forward + backward passes of one batch, unrouted "
                "and routed alternating." if timed else ""), "",
             "Damage: the routed minus the unrouted training loss of the same samples, noise and noise levels "
             "(training-mode routing on the trained weights, no training); the interval is a paired t interval "
             "over samples. Best first.", "",
             *([trained, ""] if trained else []),
             suggestion_line(result), "", head, "|" + "---|" * head.count(" |")]
    for row in sorted(result["routes"], key=lambda r: r["damage"]):
        lines.append(
            f"| {row['route']} | {row['flop_speedup_bound']:.3f}x | {row['activation_memory_fraction']:.0%} | "
            f"{row['loss']:.5f} | {row['damage']:+.5f} | [{row['damage_ci'][0]:+.5f}, {row['damage_ci'][1]:+.5f}] | "
            f"{row['relative_damage']:+.1%} | {'yes' if row['pareto'] else ''} |" + (
                f" {row['unrouted_step_ms']:.1f} | {row['step_ms']:.1f} | {row['measured_speedup']:.3f}x |"
                if timed else "") + (f" {row.get('inside_trained_route') or ''} |" if marked else ""))
    lines += ["", "Cosine similarity between each block's input and output tokens (unrouted):", "",
              "| block | " + " | ".join(str(k) for k in range(result["depth"])) + " |",
              "|---|" + "---|" * result["depth"],
              "| cos | " + " | ".join(f"{s:.3f}" for s in result["block_similarity"]) + " |"]
    return "\n".join(lines) + "\n"


def box(bbox) -> tuple:
    return bbox.x0, bbox.y0, bbox.x1, bbox.y1


def point_obstacles(ax, rows, dpi: float) -> list:
    """Display boxes of the markers (4 points wide) and of the error bars with their caps (2 points)."""
    pad = 3 * dpi / 72
    boxes = []
    for r in rows:
        (x, y), (_, low), (_, high) = ax.transData.transform(
            [(r["flop_speedup_bound"], r["damage"]), (r["flop_speedup_bound"], r["damage_ci"][0]),
             (r["flop_speedup_bound"], r["damage_ci"][1])])
        boxes += [(x - pad, y - pad, x + pad, y + pad), (x - pad, min(low, high), x + pad, max(low, high))]
    return boxes


def line_obstacles(ax, spacing: float = 2.0) -> list:
    """Points every `spacing` pixels along the drawn lines of `ax` (the Pareto front, the target and zero
    lines), as boxes of no size: a label on a line is hard to read."""
    boxes = []
    for line in ax.lines:
        if line.get_linestyle() in ("None", "", " "):
            continue  # markers only: the points, their caps and the star
        path = line.get_transform().transform(line.get_xydata())
        for a, b in zip(path[:-1], path[1:]):
            count = max(2, int(np.hypot(*(b - a)) / spacing) + 1)
            boxes += [(x, y, x, y) for x, y in np.linspace(a, b, count).tolist()]
    return boxes


def label_points(fig, ax, rows, colors: dict, suggested=None) -> None:
    """Each route's START->END beside its point, in its ratio's colour, placed so that no two labels overlap
    (tools/route_probe_labels.py); a label moved away from its point is joined to it by a line."""
    fig.tight_layout()  # the final layout first: the labels are placed in display coordinates
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    legend = ax.get_legend()
    legend_box = legend.get_window_extent(renderer)
    legend.set_loc(tuple(ax.transAxes.inverted().transform((legend_box.x0, legend_box.y0))))  # stays there
    obstacles = [box(legend_box), *point_obstacles(ax, rows, fig.dpi), *line_obstacles(ax)]
    if suggested is not None:
        x, y = ax.transData.transform((suggested["flop_speedup_bound"], suggested["damage"]))
        star = 8 * fig.dpi / 72
        obstacles.append((x - star, y - star, x + star, y + star))
    texts = [f"{r['start']}->{r['end']}" for r in rows]
    sizes = []
    for text in texts:
        t = fig.text(0, 0, text, fontsize=6)
        extent = t.get_window_extent(renderer)
        sizes.append((extent.width, extent.height))
        t.remove()
    anchors = ax.transData.transform([(r["flop_speedup_bound"], r["damage"]) for r in rows])
    order = sorted(range(len(rows)), key=lambda i: (anchors[i][1], anchors[i][0]))  # the crowd near 0 first
    first = 5 * fig.dpi / 72  # clear of the marker's half-size and its error bar's caps (3 points)
    placed = place_labels([anchors[i] for i in order], [sizes[i] for i in order], box(ax.get_window_extent()),
                          obstacles, first=first)
    to_points = 72 / fig.dpi
    for i, label in zip(order, placed):
        (x, y), r = anchors[i], rows[i]
        centre = ((label[0] + label[2]) / 2 - x) * to_points, ((label[1] + label[3]) / 2 - y) * to_points
        leader = dict(arrowstyle="-", lw=0.5, color="0.5", shrinkA=0, shrinkB=2) \
            if needs_leader((x, y), label, first) else None
        note = ax.annotate(texts[i], (r["flop_speedup_bound"], r["damage"]), xytext=centre, textcoords="offset points",
                           ha="center", va="center", fontsize=6, color=colors[r["ratio"]], arrowprops=leader,
                           annotation_clip=False)
        note.set_in_layout(False)  # the layout is final: a label must not move the axes it was placed in


def draw(result: dict):
    """(plt, fig, the damage axes, the similarity axes) of one probe. Left: damage against the FLOP-bound
    speed-up with intervals, the Pareto front, the suggestion and the labelled routes. Right: the block
    similarity curve, with the trained routes shaded."""
    plt, fig, ax = new_figure(12, 5)
    fig.delaxes(ax)
    left, right = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    rows = result["routes"]
    ratios = sorted({r["ratio"] for r in rows})
    colors = {ratio: f"C{k}" for k, ratio in enumerate(ratios)}
    for ratio in ratios:
        chosen = [r for r in rows if r["ratio"] == ratio]
        left.errorbar([r["flop_speedup_bound"] for r in chosen], [r["damage"] for r in chosen],
                      yerr=[[r["damage"] - r["damage_ci"][0] for r in chosen],
                            [r["damage_ci"][1] - r["damage"] for r in chosen]],
                      fmt="o", ms=4, capsize=2, color=colors[ratio], label=f"ratio {ratio:g}")
    front = sorted((r for r in rows if r["pareto"]), key=lambda r: r["flop_speedup_bound"])
    left.plot([r["flop_speedup_bound"] for r in front], [r["damage"] for r in front], "k--", lw=1,
              label="Pareto front")
    best = next((r for r in rows if r["route"] == result["suggestion"]), None)
    if best is not None:
        left.plot(best["flop_speedup_bound"], best["damage"], marker="*", ms=16, color="gold", mec="k", ls="",
                  label=f"suggested: {best['route']}")
    if result["target_speedup"]:
        left.axvline(result["target_speedup"], color="grey", lw=0.8, ls=":", label="target speed-up")
    left.axhline(0, color="grey", lw=0.5)
    left.set_xlabel("FLOP-bound speed-up of a training step")
    left.set_ylabel("damage: routed - unrouted training loss")
    left.set_title("cost and damage of each route (no training)", fontsize=10)
    left.legend(fontsize=7)
    right.plot(range(result["depth"]), result["block_similarity"], marker="o")
    trained = (result.get("trained_routes") or {}).get("routes") or []
    for k, t in enumerate(trained):
        right.axvspan(t["start"] - 0.5, t["end"] + 0.5, color="0.85", zorder=0,
                      label="trained route" + ("s" if len(trained) > 1 else "") if k == 0 else None)
    if trained:
        right.legend(fontsize=7)
    right.set_xlabel("block")
    right.set_ylabel("cosine similarity, input vs output tokens")
    right.set_title("block similarity (unrouted)", fontsize=10)
    right.grid(alpha=0.3)
    label_points(fig, left, rows, colors, best)
    return plt, fig, left, right


def plot(result: dict, out: Path, stem: str = "probe") -> None:
    plt, fig, _, _ = draw(result)
    save(plt, fig, out, stem)


def write(result: dict, out: Path, stem: str = "probe") -> list:
    """probe.json, probe.md, probe.png (and .svg) in `out`; the paths written."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / f"{stem}.md").write_text(markdown(result))
    plot(result, out, stem)
    return [out / f"{stem}.{ext}" for ext in ("json", "md", "png", "svg")]


PICTURED = ("routes", "suggestion", "target_speedup", "depth", "block_similarity")  # what `draw` reads


def build_parser() -> ArgumentParser:
    p = ArgumentParser(prog="python -m tools.route_probe_report",
                       description="Draw probe.png and probe.svg again from recorded probes' probe.json.")
    p.add_argument("probes", nargs="+", help="probe.json files written by python -m tools.route_probe")
    return p


def main(argv=None) -> list:
    """The pictures of each probe.json named, beside it (when the picture's code changed, not the probe)."""
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    results = []
    for path in map(Path, args.probes):  # every file read before any picture is drawn
        try:
            result = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise UserError(f"{path} cannot be read as JSON ({type(e).__name__}: {e})") from None
        if not isinstance(result, dict) or any(k not in result for k in PICTURED) or not result["routes"]:
            raise UserError(f"{path} is not a probe.json written by python -m tools.route_probe (it needs "
                            f"{', '.join(PICTURED)})")
        results.append((path, result))
    for path, result in results:
        plot(result, path.parent, path.stem)
        print(f"redrew {path.parent / path.stem}.png and .svg")
    return [path.parent / f"{path.stem}.png" for path, _ in results]


if __name__ == "__main__":
    report_user_errors(main)()
