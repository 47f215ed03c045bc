"""The plots of tools/report.py and lab/study_report.py: FID curves and the route-placement chart, each
written as PNG and SVG (matplotlib, loaded only when a plot is drawn; SVGs are reproducible byte for byte)."""
import math
import statistics
import textwrap


def new_figure(width, height):
    import matplotlib  # loaded only when plotting: the backend must be chosen before pyplot is imported

    matplotlib.use("Agg")
    matplotlib.rcParams["svg.fonttype"] = "none"  # SVG text stays text (searchable, editable)
    matplotlib.rcParams["svg.hashsalt"] = "tread"  # the same figure gives the same SVG: committed plots diff cleanly
    import matplotlib.pyplot as plt

    return plt, *plt.subplots(figsize=(width, height))


def run_label(run):
    """A run's configuration in short: model, routes @ ratio and its settings (tools.report sets them)."""
    return f"{run['model']}" + (f" {run['routes']} @ {run['ratio']}" if run["route_list"] else "") + \
        (f" {run['settings']}" if run.get("settings") else "")


def labels(runs):
    """Short legend labels (configuration and seed), or the run names if those repeat."""
    short = [f"{run_label(r)}, seed {r['seed']}" for r in runs]
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


SEEDED, NEUTRAL = "RdYlGn_r", "Blues"  # the colour scales of the placement chart (see fid_noise)


def pooled_std(spreads):
    """The pooled sample std of several configurations' seeds ([(std or None, n)]) and its degrees of freedom."""
    seeded = [(std, n) for std, n in spreads if std is not None]
    dof = sum(n - 1 for _, n in seeded)
    return (math.sqrt(sum((n - 1) * std ** 2 for std, n in seeded) / dof), dof) if dof else (None, 0)


def fid_noise(rows, base, samples):
    """What the placement chart can say about noise. rows: [(mean, std or None, n)] per configuration; base:
    {key: (mean, n, std or None)}; samples: the FID sample counts. Returns the colour scale, a caption and the
    seed std a single-seed side of a difference is given (None: not measured here). Red to green only when every
    value is a mean over seeds; otherwise one hue, and the caption states the seed std measured in these runs."""
    spreads = [(std, n) for _, std, n in rows] + [(std, n) for _, n, std in base.values()]
    pooled, dof = pooled_std(spreads)
    at = f" at {'-'.join(str(n) for n in sorted({min(samples), max(samples)}))} samples" if samples else ""
    single = sum(1 for std, _ in spreads if std is None)
    if not single:
        return SEEDED, f"FID{at}: mean ± std over seeds; difference to the baseline ± its standard error.", pooled
    if pooled is None:
        return NEUTRAL, (f"One seed per configuration and none with several, so one colour hue: the seed noise of "
                         f"FID{at} is not measured here and the differences carry no error."), None
    measured = sum(1 for std, _ in spreads if std is not None)
    return NEUTRAL, (f"{single} of {len(spreads)} value(s) without a seed spread, so one colour hue. FID{at} varies "
                     f"between seeds by {pooled:.2f} (sample std pooled over the {measured} configuration(s) here with "
                     f"several seeds, {dof} dof); a difference's ± uses it for a single-seed side."), pooled


def value_text(mean, std, n, ref, pooled):
    """'16.41 (+4.39 ± 0.49)': the FID (± its std over seeds) and its difference to the baseline ref (mean, n, std)
    ± the standard error of that difference, a single-seed side counted with the pooled seed std."""
    text = f"{mean:.2f}" + (f" ± {std:.2f}" if std is not None else "")
    if not ref:
        return text
    side, other = std if std is not None else pooled, ref[2] if ref[2] is not None else pooled
    if side is None or other is None:
        return f"{text} ({mean - ref[0]:+.2f})"
    return f"{text} ({mean - ref[0]:+.2f} ± {math.sqrt(side ** 2 / n + other ** 2 / ref[1]):.2f})"


def plot_routes(groups, out, base, stem="route_placement"):
    """groups: [(name, runs of one configuration)]; base: {(backbone, dataset): (mean, n, std or None)} of the
    no-routing runs. One row per routed configuration with FID, by route: a bar over its blocks, its FID (mean ±
    std over seeds) and difference to the baseline, the noise of both stated (fid_noise)."""
    import matplotlib as mpl  # see new_figure

    rows = sorted(((name, [r for r in members if r["final_fid"] is not None]) for name, members in groups
                   if members[0]["route_list"] and any(r["final_fid"] is not None for r in members)),
                  key=lambda row: (row[1][0]["route_list"], row[0]))
    skipped = sum(1 for _, members in groups for r in members if r["route_list"] and r["final_fid"] is None)
    if not rows:
        plt, fig, ax = new_figure(9, 2.5)
        ax.text(0.5, 0.5, "no routed run has FID records yet", ha="center", transform=ax.transAxes)
        ax.set_axis_off()
        return save(plt, fig, out, stem)
    stats = [(statistics.mean(f), statistics.stdev(f) if len(f) > 1 else None, len(f))
             for f in ([r["final_fid"] for r in members] for _, members in rows)]
    samples = {r["fid_samples"] for _, members in rows for r in members if r.get("fid_samples")}
    cmap_name, caption, pooled = fid_noise(stats, base, samples)
    several_backbones = len({m[0]["backbone"] for _, m in rows}) > 1
    ticks = [f"{name}" + (f", {m[0]['backbone']}" if several_backbones else "")
             + (f" ({n} seeds)" if n > 1 else f", seed {m[0]['seed']}") for (name, m), (_, _, n) in zip(rows, stats)]
    ticks += [f"no routing, {backbone} ({n} run{'s' if n > 1 else ''})" for (backbone, _), (_, n, _) in base.items()]
    values = [value_text(mean, std, n, base.get((m[0]["backbone"], m[0]["dataset"])), pooled)
              for (_, m), (mean, std, n) in zip(rows, stats)] + [value_text(v, std, n, None, None)
                                                               for v, n, std in base.values()]
    # three columns: the bars (5 in), each row's FID and difference, the colour bar; the row names on the left and
    # the values take what they need (about 0.055-0.065 in a character at size 8)
    value_width = 0.055 * max(map(len, values)) + 0.1
    plt, fig, _ = new_figure(max(9.0, 6.6 + 0.065 * max(map(len, ticks)) + value_width), 2.6 + 0.32 * max(len(ticks), 3))
    fig.clf()
    ax, column, cax = fig.subplots(1, 3, gridspec_kw=dict(width_ratios=[5.0, value_width, 0.2]))
    cmap = mpl.colormaps[cmap_name]
    if cmap_name == NEUTRAL:  # its lightest end would be a white bar on the white axes
        cmap = mpl.colors.ListedColormap([cmap(0.15 + 0.85 * i / 255) for i in range(256)], name=NEUTRAL)
    base_means = [v[0] for v in base.values()]
    fids = [m for m, _, _ in stats] + base_means
    norm = mpl.colors.Normalize(min(fids), max(fids) if max(fids) > min(fids) else min(fids) + 1)
    depth = max((m[0]["depth"] or max(e for _, e, _ in m[0]["route_list"]) + 1) for _, m in rows)
    for y, ((_, members), (mean, _, _)) in enumerate(zip(rows, stats)):
        for s, e, _ in members[0]["route_list"]:
            ax.barh(y, e - s + 1, left=s - 0.5, height=0.7, color=cmap(norm(mean)), edgecolor="0.2")
    for y in range(len(rows), len(ticks)):  # the baselines: no bar to draw
        ax.text((depth - 1) / 2, y, "no block skipped", ha="center", va="center", fontsize=8, color="0.3")
    if base:
        ax.axhline(len(rows) - 0.5, color="0.5", linewidth=0.8)
    ax.set_yticks(range(len(ticks)), ticks, fontsize=8)
    for axis in (ax, column):
        axis.set_ylim(len(ticks) - 0.5, -0.5)  # first row on top
    column.set_axis_off()
    for y, text in enumerate(values):  # a baseline's value boxed in its colour: it has no bar
        column.text(0.05, y, text, va="center", fontsize=8, bbox=dict(
            facecolor=cmap(norm(base_means[y - len(rows)])), edgecolor="0.2", boxstyle="square,pad=0.2")
            if y >= len(rows) else None)
    ax.set_xticks(range(depth))
    ax.set_xlim(-0.7, depth - 0.3)
    notes = [caption] + ([f"{skipped} routed run(s) without FID records not shown."] if skipped else [])
    ax.set_xlabel("block (a route skips tokens from its start block through its end block)\n"
                  + "\n".join(textwrap.wrap(" ".join(notes), 95)), fontsize=8)
    bar = fig.colorbar(mpl.cm.ScalarMappable(norm=norm, cmap=cmap), cax=cax, label="final FID")
    for value in base_means:  # and marked on the FID scale
        bar.ax.axhline(value, color="black", linewidth=2)
    refs = ", ".join(f"{b}: {value_text(v, std, n, None, None)} ({n} run{'s' if n > 1 else ''})"
                     for (b, _), (v, n, std) in base.items())
    ax.set_title("\n".join(textwrap.wrap("Route placement: final FID" + (
        f" and difference to the no-routing baseline [{refs}]" if refs else " (no no-routing baseline run with FID)"),
        75)), fontsize=9)
    save(plt, fig, out, stem)
