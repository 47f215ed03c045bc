"""Where the host's time goes in an eager FLUX LoRA training step, routed and unrouted, split by whose code runs.

    python -m lab.flux_host_profile --out docs/perf/flux_host_profile_cpu.json   # a .md table beside it

The step is the FLUX.1-dev LoRA bench's CPU proxy (lab/bench_flux_lora.py, `proxy`: FLUX.1-dev's 19 + 38 blocks
at width 64, 16 image and 16 text tokens, batch 1, LoRA r16 on the attention projections, gradient
checkpointing, AdamW; the route {0.5, 2, -2}): its arithmetic is tiny, so its time is what the host spends, as
at batch 1 on a GPU. Each step runs under cProfile on one thread; the medians over the profiled steps are
reported per owner, with the median step without the profiler beside it, in the process's CPU time
(time.process_time: on a CPU shared with other jobs, waiting for a core is not counted). The profiler costs
the same per call wherever it is, so the owners making many small calls (torch's checkpoint hooks) are inflated
most; the calls are exact.

Owners, by the file a function is in: ours (tread_diffusers/, routing_module.py), the step's own code (the loss
and loop in tools/, lab/), peft, diffusers, torch. torch is split into nn.Module's call machinery (module.py),
its layers (nn.Linear, LayerNorm, torch.nn.functional), torch.utils.checkpoint (the pack and unpack hooks, the
recomputation's bookkeeping), the autograd engine (backward's ops, run in C++ under `run_backward`), the
optimizer (torch/optim) and the rest of torch.
Time in a C function (a torch op, a builtin) and in the standard library's Python counts for the owner of its
caller, split by caller as cProfile records it: so an owner's `C` column is the torch ops its code calls.
Calls per step (Python functions and C functions, by the same rule) do not depend on the machine's load.
"""
import cProfile
import json
import os
import platform
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

from lab.bench_flux_lora import batches, build
from tools.diffusers_toy import training_step
from tread_diffusers import apply_tread
from tread_utils.cli import ArgumentParser, non_negative_int, positive_int

REPO = Path(__file__).resolve().parent.parent
ROUTES = {"routes": [{"selection_ratio": 0.5, "start_layer_idx": 2, "end_layer_idx": -2}]}
OWNERS = ("ours", "the step (tools/, lab/)", "peft", "diffusers", "torch: nn.Module calls", "torch: layers",
          "torch: checkpoint", "torch: autograd engine", "torch: optimizer", "torch: other")
UNOWNED = "the profiler's own"  # cProfile's enable/disable: outside the step
OUR_FUNCTIONS = 10  # the record's list of our most costly functions


def owner(func: tuple):
    """The owner of a cProfile function key (file, line, name), or None where its caller's owner counts."""
    file, _, name = func
    if "run_backward" in name:
        return "torch: autograd engine"
    if file.startswith(str(REPO)):
        rel = Path(file).relative_to(REPO).as_posix()
        if rel.startswith("tread_diffusers/") or rel == "routing_module.py":
            return "ours"
        return "the step (tools/, lab/)"
    for package in ("peft", "diffusers"):
        if f"/site-packages/{package}/" in file:
            return package
    if "/site-packages/torch/" in file:
        rel = file.split("/site-packages/torch/", 1)[1]
        for prefix, who in (("nn/modules/module.py", "torch: nn.Module calls"), ("nn/", "torch: layers"),
                            ("utils/checkpoint.py", "torch: checkpoint"), ("optim/", "torch: optimizer")):
            if rel.startswith(prefix):
                return who
        return "torch: other"
    return None  # a builtin, a C function or the standard library: its caller's


def split_by_owner(stats: pstats.Stats) -> tuple:
    """({owner: [python seconds, C seconds, calls]}, {our function: [seconds, calls]}) of one profile: a function
    of ours counts its own time and that of the C and standard-library functions it calls directly."""
    table = {who: [0.0, 0.0, 0] for who in (*OWNERS, UNOWNED)}
    ours = {}
    memo = {}

    def shares(func, seen=()) -> dict:
        """{owner: fraction} of a function's calls, through unowned callers up to an owned one."""
        who = owner(func)
        if who is not None:
            return {who: 1.0}
        if func in memo:
            return memo[func]
        callers = {c: v for c, v in stats.stats[func][4].items() if c not in seen}
        total = sum(v[1] for v in callers.values())
        if not total:
            return {UNOWNED: 1.0}
        out = {}
        for caller, (_, calls, _, _) in callers.items():
            for who, share in shares(caller, (*seen, func)).items():
                out[who] = out.get(who, 0.0) + share * calls / total
        memo[func] = out
        return out

    for func, (_, calls, tottime, _, callers) in stats.stats.items():
        who = owner(func)
        column = 1 if func[0] == "~" else 0  # a C function (cProfile files them under ~), else Python
        if who is not None:
            table[who][column] += tottime
            table[who][2] += calls
            if who == "ours":
                _count(ours, func, tottime, calls)
            continue
        for caller, (_, n, tt, _) in callers.items():
            for whose, share in shares(caller, (func,)).items():
                table[whose][column] += tt * share
                table[whose][2] += n * share
            if owner(caller) == "ours":
                _count(ours, caller, tt, 0)
    return table, ours


def _count(functions: dict, func: tuple, seconds: float, calls: int) -> None:
    entry = functions.setdefault(f"{Path(func[0]).name}:{func[2]}", [0.0, 0])
    entry[0] += seconds
    entry[1] += calls


def profiled_step(step) -> tuple:
    profile = cProfile.Profile()
    profile.enable()
    step()
    profile.disable()
    return split_by_owner(pstats.Stats(profile))


def measure(steps: int, warmup: int) -> dict:
    """Per variant (unrouted, routed): the medians over `steps` profiled steps per owner (ms, calls), the median
    profiled step, and the median step without the profiler; the variants alternate step by step."""
    torch.set_num_threads(1)
    device = torch.device("cpu")
    model, optimizer = build("proxy", device)
    step = training_step(model, batches("proxy", 1, device, torch.float32), optimizer)
    results = {False: ([], []), True: ([], [])}
    for i in range(warmup + 2 * steps):
        for routed in (False, True):
            handle = apply_tread(model, ROUTES) if routed else None
            if i < warmup:
                step()
            elif i < warmup + steps:
                results[routed][0].append(profiled_step(step))
            else:
                start = time.process_time()
                step()
                results[routed][1].append(time.process_time() - start)
            if handle:
                handle.remove()
    out = {}
    for routed, (profiles, wall) in results.items():
        tables = [table for table, _ in profiles]
        owners = {who: dict(python_ms=statistics.median(t[who][0] for t in tables) * 1e3,
                            c_ms=statistics.median(t[who][1] for t in tables) * 1e3,
                            calls=round(statistics.median(t[who][2] for t in tables)))
                  for who in OWNERS}
        profiled = statistics.median(sum(v[0] + v[1] for w, v in t.items() if w != UNOWNED) for t in tables) * 1e3
        names = {name for _, ours in profiles for name in ours}
        ours = {name: dict(ms=statistics.median(f.get(name, [0.0, 0])[0] for _, f in profiles) * 1e3,
                           calls=round(statistics.median(f.get(name, [0.0, 0])[1] for _, f in profiles)))
                for name in names}
        top = dict(sorted(ours.items(), key=lambda item: -item[1]["ms"])[:OUR_FUNCTIONS])
        out["routed" if routed else "unrouted"] = dict(owners=owners, profiled_step_ms=profiled,
                                                       step_ms=statistics.median(wall) * 1e3, ours=top)
    return out


def to_markdown(record: dict) -> str:
    lines = [f"Command: `{record['command']}`", "", f"Machine: {record['machine']}", "",
             "| owner | unrouted: Python ms | C ms | calls | routed: Python ms | C ms | calls |",
             "|---|---|---|---|---|---|---|"]
    u, r = record["unrouted"]["owners"], record["routed"]["owners"]
    for who in OWNERS:
        lines.append(f"| {who} | {u[who]['python_ms']:.1f} | {u[who]['c_ms']:.1f} | {u[who]['calls']} | "
                     f"{r[who]['python_ms']:.1f} | {r[who]['c_ms']:.1f} | {r[who]['calls']} |")
    lines.append(f"| step, profiled | {record['unrouted']['profiled_step_ms']:.0f} | | | "
                 f"{record['routed']['profiled_step_ms']:.0f} | | |")
    lines.append(f"| step, not profiled (CPU time) | {record['unrouted']['step_ms']:.0f} | | | "
                 f"{record['routed']['step_ms']:.0f} | | |")
    lines += ["", "Ours in the routed step, by function (its own time and the C calls it makes), ms per step (calls):",
              "", "| function | ms | calls |", "|---|---|---|"]
    lines += [f"| {name} | {f['ms']:.1f} | {f['calls']} |" for name, f in record["routed"]["ours"].items()]
    return "\n".join(lines) + "\n"


def build_parser() -> ArgumentParser:
    p = ArgumentParser(prog="python -m lab.flux_host_profile", description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=positive_int, default=8, help="profiled steps, then as many unprofiled, per "
                                                                 "variant (default 8)")
    p.add_argument("--warmup", type=non_negative_int, default=2, help="steps per variant before the measured ones "
                                                                      "(default 2)")
    p.add_argument("--out", default=None, help="JSON record (a .md table beside it)")
    return p


def main(argv=None):
    args = build_parser().parse_args(argv)
    load_before = os.getloadavg()[0]
    record = measure(args.steps, args.warmup)
    import diffusers
    import peft
    record = dict(command="python -m lab.flux_host_profile " + " ".join(sys.argv[1:] if argv is None else argv),
                  machine=f"{platform.machine()}, {os.cpu_count()} CPU cores shared with other jobs (1-minute load "
                          f"average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after), python "
                          f"{platform.python_version()}, torch {torch.__version__}, diffusers "
                          f"{diffusers.__version__}, peft {peft.__version__}, 1 thread", **record)
    table = to_markdown(record)
    print(table, end="")
    if args.out:
        Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
        Path(args.out).with_suffix(".md").write_text(table)
    return record


if __name__ == "__main__":
    main()
