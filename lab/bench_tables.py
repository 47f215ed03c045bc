"""Markdown tables of lab/bench.py's sections, written beside its JSON record."""
from tread_utils.attention import DEFAULT as DEFAULT_ATTENTION


def simple_table(header, rows, cells):
    """Markdown: the `header` names, then one line of `cells(row)` strings per row."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(cells(r)) + " |" for r in rows])


def _model(r):
    """'dit', 'tread', or 'tread, bf16 after route' for the variant without the authors' float32 block; an
    attention kernel other than torch's choice (--attention, --attention-fp32) is named after it."""
    kernels = [f"{what} {r[key]}" for key, what in (("attention", "attention"), ("attention_fp32", "float32 attention"))
               if r.get(key, DEFAULT_ATTENTION) != DEFAULT_ATTENTION]
    return ", ".join([r["model"] + (", bf16 after route" if r.get("fp32_after_route") is False else ""), *kernels])


def variant_mode(r):
    """'compiled (blocks)' for our variants compiled block by block (train.compile_scope), else the mode; shapes
    other than torch's default (train.compile_dynamic) after the scope: 'compiled (blocks, static shapes)'."""
    scope = r.get("compile_scope")
    if r["code"] != "ours" or not scope:
        return r["mode"]
    shapes = {None: "", False: ", static shapes", True: ", dynamic shapes"}[r.get("compile_dynamic")]
    return f"{r['mode']} ({scope}{shapes})"


def _training_cells(r):
    batch = f"{r['batch']}" + (f" ({r['batch'] // r['micro_batch']} x {r['micro_batch']})"
                               if r.get("micro_batch", r["batch"]) != r["batch"] else "")
    head = [r["backbone"], batch, r["code"], variant_mode(r), _model(r)]
    if r.get("oom"):
        return head + ["out of memory", "", "", f"{r['peak_mem_mb']:.0f}", "", "", "", "", ""]
    extra = ([f"{r['speedup']:.3f}x", f"{r['flop_bound']:.3f}x", f"{r['speedup_vs_bound']:.3f}"] if "speedup" in r
             else ["", "", ""])
    mfu = f"{r['mfu']:.1%}" + (f" (HFU {r['hfu']:.1%})" if "hfu" in r else "")
    return head + [f"{r['step_s'] * 1e3:.1f}", f"{r['warmup_s']:.1f}", f"{r['images_per_s']:.1f}",
                   f"{r['peak_mem_mb']:.0f}", f"{r['flops_per_step'] / 1e9:.1f}", mfu, *extra]


def training_table(rows, device_name, dtype_name, ceiling, grad_checkpointing=False):
    memory = ("peak memory per variant" if "CPU" not in device_name else
              "peak memory is the process's peak RSS so far, not per variant; MFU on a CPU is indicative only "
              "(the ceiling of a shared CPU varies from run to run; above 100% means it was under-measured)")
    notes = [f"Device: {device_name}, {dtype_name}, matmul ceiling {ceiling / 1e12:.2f} TFLOP/s (measured); {memory}; "
             f"warm-up: the untimed first steps, compilation included."]
    if grad_checkpointing:
        notes.append("Activation checkpointing: MFU counts the model's FLOPs only; HFU adds the recomputed forward.")
    header = ("backbone", "batch", "code", "mode", "model", "step (ms)", "warm-up (s)", "images/s", "peak mem (MB)",
              "GFLOP/step", "MFU", "speed-up", "FLOP bound", "speed-up / bound")
    return "\n".join(notes) + "\n\n" + simple_table(header, rows, _training_cells) + paper_comparison_table(rows)


def paper_comparison_table(rows):
    """Our fastest step against the paper code's fastest, per backbone x batch x model (> 1: ours faster)."""
    groups = {}
    for r in rows:
        if not r.get("oom"):
            key = (r["backbone"], r["batch"], r["model"], r.get("fp32_after_route"))
            groups.setdefault(key, {}).setdefault(r["code"], []).append(r)
    lines = []
    for (backbone, batch, model, _), by_code in groups.items():
        if "paper" not in by_code or "ours" not in by_code:
            continue
        ours, paper = (min(by_code[c], key=lambda r: r["step_s"]) for c in ("ours", "paper"))
        lines.append(f"| {backbone} | {batch} | {model} | {ours['step_s'] * 1e3:.1f} ({variant_mode(ours)}) | "
                     f"{paper['step_s'] * 1e3:.1f} ({paper['mode']}) | {paper['step_s'] / ours['step_s']:.2f}x | "
                     f"{paper['max_abs_output_difference']:.1e} |")
    if not lines:
        return ""
    return ("\n\nSame run, same model, batch and data: our fastest step against the paper code's fastest "
            "(> 1x: ours is faster).\n\n| backbone | batch | model | ours (ms) | paper code (ms) | paper / ours | "
            "max abs output difference |\n|---|---|---|---|---|---|---|\n" + "\n".join(lines))


def sampling_table(rows):
    return simple_table(("backbone", "guidance", "batch", "Heun steps", "images/s", "NFE/image"), rows, lambda r: (
        r["backbone"], r["guidance"], str(r["batch"]), str(r["num_steps"]), f"{r['images_per_s']:.3f}",
        f"{r['nfe_per_image']:.0f}"))


def _seconds(r, key):
    return f"{r[key]:.1f}" if key in r else "-"


def suite_table(rows):
    return "ADM suite (`python -m evaluations.evaluator`, one process, start-up included):\n\n" + simple_table(
        ("samples", "reference images", "batch", "writing batches (s)", "seconds", "images/s",
         "peak host memory (MB)"), rows, lambda r: (
            str(r["samples"]), str(r["reference"]), str(r["batch"]), _seconds(r, "writing_s"), _seconds(r, "seconds"),
            f"{r['images_per_s']:.1f}" if "images_per_s" in r else "-",
            f"{r['peak_host_mb']:.0f}" if "peak_host_mb" in r else "-"))


def metrics_table(rows):
    return "ADM metric stage alone (random features, own process):\n\n" + simple_table(
        ("samples", "reference", "seconds", "peak host memory (MB)"), rows, lambda r: (
            str(r["samples"]), str(r["reference"]), f"{r['seconds']:.1f}", f"{r['peak_host_mb']:.0f}"))


FID_STAGES = ("sampling", "decoding", "features", "statistics", "distance")


def training_fid_table(rows):
    return ("In-training FID (EDM Heun, unguided; SD-VAE decoding; Inception; Frechet distance):\n\n" +
            simple_table(("backbone", "samples", "Heun steps", "compiled", "total (s)",
                          *(f"{s} (s)" for s in FID_STAGES), "first sampling batch (s)"), rows, lambda r: (
                r["backbone"], str(r["samples"]), str(r["heun_steps"]), "yes" if r.get("compiled") else "no",
                _seconds(r, "seconds"), *(_seconds(r, f"{s}_s") for s in FID_STAGES),
                _seconds(r, "sampling_first_batch_s"))))


def loader_table(rows):
    return "Data loader alone:\n\n" + simple_table(("data", "workers", "batch", "samples/s", "first batch (s)"), rows,
                                                     lambda r: (r["path"], str(r["workers"]), str(r["batch"]),
                                                                f"{r['samples_per_s']:.0f}", f"{r['first_batch_s']:.2f}"))
