"""The training section of lab/bench.py: full training steps of our DiT and TREAD (and the paper code's, in the
same run) timed alone, each against the FLOP bound, with MFU, peak memory and an optional profile."""
import contextlib
import functools

import torch

from dit import DiT_models, get_model
from edm import EDMLoss, EDMPrecond
from lab.bench_evaluation import IMAGENET_LATENT
from lab.bench_tables import variant_mode
from lab.bench_timing import time_or_out_of_memory
from lab.paper_code import build_paper_model, eager_context, load_our_weights
from training.compile import SCOPES, compile_backbone
from training.flops import training_step_flops
from training.loop import build_adamw
from tread_utils.attention import DEFAULT as DEFAULT_ATTENTION

# Micro-batch by default for global batches above this: DiT-XL/2 at batch 256 in one pass needs about 82 GiB
# (compiled, bf16) against an 80 GB GPU's 79; two micro-batches of 128 fit (DiT-L/2 is close to the limit eager).
AUTO_MICRO_BATCH = {"DiT-L/2": 128, "DiT-XL/2": 128}


def micro_batch_for(args, backbone, batch) -> int:
    """`--micro-batch`, or by default the largest divisor of `batch` within AUTO_MICRO_BATCH's cap."""
    if args.micro_batch is not None:
        return args.micro_batch
    cap = min(batch, AUTO_MICRO_BATCH.get(backbone, batch))
    return max(d for d in range(1, cap + 1) if batch % d == 0)


def model_params(backbone, routed, ratio=0.5, fp32_after_route=True, grad_checkpointing=False):
    routes = [dict(start_layer_idx=2, end_layer_idx=-4, selection_ratio=ratio)]
    return dict(IMAGENET_LATENT, enable_routing=routed, routes=routes, fp32_after_route=fp32_after_route,
                grad_checkpointing=grad_checkpointing)


def training_step(model, batch, device, dtype, context=contextlib.nullcontext, micro_batch=None):
    """A closure running one full training step of `model` on fixed data: EDM loss and backward over
    `batch // micro_batch` micro-batches (gradients accumulated, each loss scaled so the sum is the batch
    mean), then one AdamW step."""
    net, loss_fn = EDMPrecond(model), EDMLoss()
    optimizer = build_adamw([p for p in model.parameters() if p.requires_grad])
    micro_batch = micro_batch or batch
    x = torch.randn(batch, 4, 32, 32, device=device).split(micro_batch)
    y = torch.randint(0, 1000, (batch,), device=device).split(micro_batch)

    def step():
        for xm, ym in zip(x, y):
            with context():
                with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
                    loss = loss_fn(net, xm, ym).mean() / len(x)
                loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def compile_model(model, args, scope="model", **kwargs):
    """The trainer's compilation (training.compile, `scope` as train.compile_scope) with the bench's
    --compile-backend and --compile-mode (the trainer's defaults unless given)."""
    options = dict(backend=args.compile_backend, **kwargs)
    if args.compile_mode != "default":
        options["mode"] = args.compile_mode
    return compile_backbone(model, scope, **options)


def our_model(args, backbone, routed, device, mode, fp32_after_route=True, scope=None):
    torch.manual_seed(0)
    params = model_params(backbone, routed, fp32_after_route=fp32_after_route,
                          grad_checkpointing=args.grad_checkpointing)
    model = get_model(backbone, params).to(device).train()
    if mode != "compiled":
        return model
    return compile_model(model, args, scope, dynamic=COMPILE_DYNAMIC[args.compile_dynamic])


def paper_twin(paper_dit, backbone, ours, routed):
    """The paper's DiT for `backbone` holding the weights of our model `ours` (their pos_embed is
    computed identically)."""
    theirs = build_paper_model(paper_dit, backbone, DiT_models[backbone]["depth"], routed, **IMAGENET_LATENT)
    load_our_weights(theirs, ours)
    return theirs


@torch.no_grad()
def paper_output_difference(paper_dit, backbone):
    """Max |ours - theirs| of one inference forward with equal (perturbed, so non-trivial) weights: the
    comparison is only meaningful if both compute the same function."""
    torch.manual_seed(0)
    ours = get_model(backbone, model_params(backbone, False)).eval()
    for p in ours.parameters():
        p.add_(0.02 * torch.randn_like(p))
    theirs = paper_twin(paper_dit, backbone, ours, routed=False).eval()
    x, t, y = torch.randn(2, 4, 32, 32), torch.randn(2), torch.tensor([0, 999])
    with eager_context(hasattr(torch.compiler, "set_stance")):  # eager where torch can switch compilation off
        return (ours(x, t, y) - theirs(x, t, y)).abs().max().item()


FP32_AFTER_ROUTE = {"on": [True], "off": [False], "both": [True, False]}
# `both`: blocks first, so its warm-up compiles from cold, not from kernels the whole model's compilation cached
COMPILE_SCOPES = {**{s: [s] for s in SCOPES}, "both": ["blocks", "model"]}
# --compile-dynamic -> torch.compile's `dynamic`, as train.compile_dynamic's null, true and false
COMPILE_DYNAMIC = {"null": None, "true": True, "false": False}


def training_variants(args):
    """(code, mode, compile scope, model, fp32_after_route) to time: ours eager and/or compiled (per scope of
    --compile-scope), the paper's as published (each block compiled: scope `blocks`) and/or eager; `dit`, then
    `tread` with the float32 block after its route on and/or off (the paper's code has it on, its authors'
    numerics; None where no route ends). The scope is None where nothing is compiled."""
    ours = {"off": ["eager"], "on": ["compiled"], "both": ["eager", "compiled"]}[args.compile]
    modes = [("ours", m, s) for m in ours for s in (COMPILE_SCOPES[args.compile_scope] if m == "compiled" else [None])]
    modes += [("paper", m, "blocks" if m == "published" else None)
              for m in (args.paper_modes if args.paper_code else [])]
    return [(code, mode, scope, model, fp32) for code, mode, scope in modes
            for model, fp32 in [("dit", None)] + [("tread", f) for f in FP32_AFTER_ROUTE[args.fp32_after_route]]
            if code == "ours" or fp32 in (None, True)]


def variant_builder(args, paper_dit, backbone, code, mode, scope, model_name, fp32, batch, micro_batch, device,
                    dtype):
    routed = model_name == "tread"

    def build():
        if code == "ours":
            model = our_model(args, backbone, routed, device, mode, fp32_after_route=fp32 is not False, scope=scope)
            context = contextlib.nullcontext
        else:
            ours = our_model(args, backbone, routed, "cpu", "eager")  # same initial weights
            model = paper_twin(paper_dit, backbone, ours, routed).to(device).train()
            context = functools.partial(eager_context, mode == "eager")
        return training_step(model, batch, device, dtype, context, micro_batch)

    return build


def step_flops(args, backbone, batch):
    """{routed: (model FLOPs of forward + backward over the whole batch, FLOPs recomputed by activation
    checkpointing)}, counted by torch.utils.flop_counter (the recomputed forward is the difference between
    the count with checkpointing and without)."""
    flops = {}
    for routed in (False, True):
        model = training_step_flops(backbone, model_params(backbone, routed), batch, routing=routed)
        executed = training_step_flops(backbone, model_params(backbone, routed, grad_checkpointing=True), batch,
                                       routing=routed) if args.grad_checkpointing else model
        flops[routed] = (model, executed - model)
    return flops


def bench_training(args, device, dtype, ceiling, paper_dit=None, save=lambda rows: None):
    rows = []
    for backbone in args.backbones:
        paper_diff = paper_output_difference(paper_dit, backbone) if paper_dit else None
        if paper_dit:
            print(f"{backbone}: paper code vs ours, max |output difference| {paper_diff:.2e}", flush=True)
        for batch in args.batch_sizes:
            micro_batch = micro_batch_for(args, backbone, batch)
            flops = step_flops(args, backbone, batch)
            first = len(rows)
            for code, mode, scope, model_name, fp32 in training_variants(args):
                routed = model_name == "tread"
                build = variant_builder(args, paper_dit, backbone, code, mode, scope, model_name, fp32, batch,
                                        micro_batch, device, dtype)
                measured = time_or_out_of_memory(build, args.steps, args.warmup, device,
                                                 profile=args.profile and code == "ours")
                row = dict(backbone=backbone, batch=batch, micro_batch=micro_batch, code=code, mode=mode,
                           compile_scope=scope, model=model_name, fp32_after_route=fp32,
                           attention=args.attention if code == "ours" else DEFAULT_ATTENTION,
                           attention_fp32=args.attention_fp32 if code == "ours" else DEFAULT_ATTENTION,
                           compile_dynamic=COMPILE_DYNAMIC[args.compile_dynamic] if code == "ours" else None,
                           **measured)
                name = (f"{backbone} batch {batch} (micro-batch {micro_batch}) {code} {variant_mode(row)} "
                        f"{model_name}{'' if fp32 is not False else ' bf16-after-route'}")
                if code == "paper":
                    row["max_abs_output_difference"] = paper_diff
                rows.append(row)
                if measured.get("oom"):
                    print(f"{name}: out of memory ({measured['error']}); freed, going on", flush=True)
                    save(rows)
                    continue
                if mode == "compiled" and measured["graphs"] == 0:
                    raise RuntimeError(f"{backbone} {code} {mode}: dynamo compiled no graph (eager fallback)")
                s, (model_flops, recomputed) = measured["step_s"], flops[routed]
                row.update(images_per_s=batch / s, flops_per_step=model_flops, mfu=model_flops / s / ceiling)
                if args.grad_checkpointing:
                    row.update(recomputed_flops_per_step=recomputed, hfu=(model_flops + recomputed) / s / ceiling)
                hfu = f" (HFU, recomputed forward included, {row['hfu']:.1%})" if "hfu" in row else ""
                print(f"{name}: {s * 1e3:.1f} ms, MFU {row['mfu']:.1%}{hfu}, "
                      f"{measured['peak_mem_mb'] / 1024:.1f} GiB, {measured['graphs']} graph(s), "
                      f"{measured['recompiles_while_timed']} recompile(s) while timed, first {args.warmup} step(s) "
                      f"{measured['warmup_s']:.1f} s", flush=True)
                if "profile" in measured:
                    print(profile_summary(name, measured["profile"]), flush=True)
                save(rows)
            add_speedups(rows[first:], flops[False][0] / flops[True][0])
            save(rows)
    return rows


def profile_summary(name, p) -> str:
    """A profiled step in a few lines: where its time went and how much of it the device was busy."""
    gpu = "" if p["host_syncs"] is None else \
        f", {p['host_syncs']} host sync(s), float32 kernels {p['fp32_kernel_ms']:.1f} ms"
    lines = [f"{name}, one profiled step: {p['wall_ms']:.1f} ms wall, busy {p['busy_ms']:.1f} ms "
             f"({p['busy_share']:.0%}){gpu}"]
    lines += [f"    {cat:<30} {ms:9.1f} ms" for cat, ms in p["ms_by_category"].items()]
    lines += [f"    top: {t['ms']:8.1f} ms x{t['count']:<4} {t['name']}" for t in p["top"][:8]]
    return "\n".join(lines)


def add_speedups(rows, bound):
    """TREAD's measured speed-up (the `dit` step of the same code, mode and compile scope over its own) next to the
    FLOP bound."""
    def variant(r):
        return r["code"], r["mode"], r.get("compile_scope")

    dense = {variant(r): r["step_s"] for r in rows if r["model"] == "dit" and not r.get("oom")}
    for row in rows:
        if row["model"] == "tread" and not row.get("oom") and variant(row) in dense:
            speedup = dense[variant(row)] / row["step_s"]
            row.update(flop_bound=bound, speedup=speedup, speedup_vs_bound=speedup / bound)
            scope = f" ({row['compile_scope']})" if row["code"] == "ours" and row.get("compile_scope") else ""
            print(f"{row['backbone']} batch {row['batch']} {row['code']} {row['mode']}{scope}"
                  f"{'' if row['fp32_after_route'] is not False else ' bf16-after-route'}: speed-up {speedup:.3f}x, "
                  f"FLOP bound {bound:.3f}x, ratio {speedup / bound:.3f}", flush=True)
