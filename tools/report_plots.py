"""The plots of tools/report.py and lab/study_report.py: FID curves and the route-placement chart, each
written as PNG and SVG (matplotlib, loaded only when a plot is drawn; SVGs are reproducible byte for byte)."""


def new_figure(width, height):
    import matplotlib  # loaded only when plotting: the backend must be chosen before pyplot is imported

    matplotlib.use("Agg")
    matplotlib.rcParams["svg.fonttype"] = "none"  # SVG text stays text (searchable, editable)
    matplotlib.rcParams["svg.hashsalt"] = "tread"  # the same figure gives the same SVG: committed plots diff cleanly
    import matplotlib.pyplot as plt

    return plt, *plt.subplots(figsize=(width, height))


def labels(runs):
    """Short legend labels from the config (model, routes, ratio, seed), or the run names if those repeat."""
    short = [f"{r['model']}" + (f" {r['routes']} @ {r['ratio']}" if r["route_list"] else "") +
             (f" {r['variant']}" if r.get("variant") else "") + f", seed {r['seed']}"
             for r in runs]
    return short if len(set(short)) == len(short) else [r["run"] for r in runs]


def save(plt, fig, out, stem):
    fig.tight_layout()
    for ext in ("png", "svg"):
        fig.savefig(out / f"{stem}.{ext}", dpi=120, metadata={"Date": None} if ext == "svg" else None)
    plt.close(fig)


def plot_curves(runs, out, stem, x_index):
    with_fid = [r for r in runs if r["fid"]]
    plt, fig, ax = new_figure(9, 5)
    longest = max((p[1] for r in with_fid for p in r["fid"]), default=0)
    scale, unit = (1.0, "") if x_index == 0 else (3600.0, "hours") if longest > 7200 else (60.0, "minutes")
    for i, (r, label) in enumerate(zip(with_fid, labels(with_fid))):
        ax.plot([p[x_index] / scale for p in r["fid"]], [p[2] for p in r["fid"]], marker="o", ms=3, label=label,
                linestyle=["-", "--", ":", "-."][i // 10 % 4])  # 10 colours per line style
    if with_fid:
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1), borderaxespad=0)
        ax.set(xlabel="training step" if x_index == 0 else f"training wall-clock ({unit})", ylabel="FID")
        ax.grid(alpha=0.3)
    else:
        ax.text(0.5, 0.5, f"no run has FID records yet ({len(runs)} run(s) read)", ha="center", transform=ax.transAxes)
        ax.set(xticks=[], yticks=[])
    if with_fid and len(with_fid) < len(runs):
        fig.text(0.01, 0.01, f"{len(runs) - len(with_fid)} run(s) without FID records not shown", fontsize=8)
    ax.set_title("FID against " + ("training step" if x_index == 0 else "training wall-clock"))
    save(plt, fig, out, stem)


def plot_routes(runs, out, base, stem="route_placement"):
    import matplotlib as mpl  # see new_figure

    rows = sorted((r for r in runs if r["route_list"] and r["final_fid"] is not None),
                  key=lambda r: (r["route_list"], str(r["seed"]), r["run"]))
    plt, fig, ax = new_figure(9, 1.6 + 0.32 * max(len(rows) + len(base), 3))
    if not rows:
        ax.text(0.5, 0.5, "no routed run has FID records yet", ha="center", transform=ax.transAxes)
        ax.set_axis_off()
        return save(plt, fig, out, stem)
    fids = [r["final_fid"] for r in rows] + [v for v, _ in base.values()]
    norm = mpl.colors.Normalize(min(fids), max(fids) if max(fids) > min(fids) else min(fids) + 1)
    cmap = mpl.colormaps["RdYlGn_r"]
    depth = max((r["depth"] or max(e for _, e, _ in r["route_list"]) + 1) for r in rows)
    several_backbones = len({r["backbone"] for r in rows}) > 1
    for y, r in enumerate(rows):
        for s, e, _ in r["route_list"]:
            ax.barh(y, e - s + 1, left=s - 0.5, height=0.7, color=cmap(norm(r["final_fid"])), edgecolor="0.2")
        ref = base.get((r["backbone"], r["dataset"]))
        diff = f" ({r['final_fid'] - ref[0]:+.2f})" if ref else ""
        ax.text(depth - 0.3, y, f"{r['final_fid']:.2f}{diff}", va="center", fontsize=8)
    ax.set_xticks(range(depth))
    ax.set_xlim(-0.7, depth + 2.2)
    ax.set_xlabel("block (a route skips tokens from its start block through its end block)")
    ticks = [f"{label}, {r['backbone']}" if several_backbones else label for r, label in zip(rows, labels(rows))]
    for y, ((backbone, _), (value, n)) in enumerate(base.items(), start=len(rows)):  # the baseline: no bar to draw
        ax.text(depth / 2 - 0.5, y, "no block skipped", ha="center", va="center", fontsize=8, color="0.3")
        ax.text(depth - 0.3, y, f"{value:.2f}", va="center", fontsize=8,
                bbox=dict(facecolor=cmap(norm(value)), edgecolor="0.2", boxstyle="square,pad=0.2"))
        ticks.append(f"no routing, {backbone} (mean of {n})")
    if base:
        ax.axhline(len(rows) - 0.5, color="0.5", linewidth=0.8)
    ax.set_yticks(range(len(ticks)), ticks, fontsize=8)
    ax.set_ylim(len(ticks) - 0.5, -0.5)  # first row on top
    bar = fig.colorbar(mpl.cm.ScalarMappable(norm=norm, cmap=cmap), ax=ax, label="final FID")
    for value, _ in base.values():  # and marked on the FID scale
        bar.ax.axhline(value, color="black", linewidth=2)
    refs = ", ".join(f"{b}: {v:.2f} (mean of {n})" for (b, _), (v, n) in base.items())
    ax.set_title("Route placement: final FID" + (f" and difference to the no-routing baseline [{refs}]"
                                                 if refs else " (no no-routing baseline run with FID)"), fontsize=9)
    skipped = sum(1 for r in runs if r["route_list"] and r["final_fid"] is None)
    if skipped:
        fig.text(0.01, 0.01, f"{skipped} routed run(s) without FID records not shown", fontsize=8)
    save(plt, fig, out, stem)
