"""FLOP and memory report for a backbone and its routes.

    python -m training.flops model=tread dataset=imagenet256          # the configured model, per-GPU batch 1
    python -m training.flops model=tread model.backbone_type=DiT-XL/2 model.params.routes.0.end_layer_idx=24
    python -m training.flops dataset=imagenet256 model.backbone_type=DiT-XL/2 repa.enabled=true repa.block=7

Two independent counts of one training step (forward + backward): `training_step_flops` measures it
with torch.utils.flop_counter on meta tensors (no memory, no compute), `analytic_training_flops`
adds up the matmuls of every block from the token count it sees. The report also gives the bound on
the speed-up routing can bring and an estimate of the activation memory it saves. FLOPs, not MACs:
the paper's "Gflops" are MACs (a training step costs about 3 x 2 x those).
"""
from typing import Optional

import hydra
import torch
from omegaconf import OmegaConf
from torch.utils.flop_counter import FlopCounterMode

from dit import BLOCK_TYPES, FUSIONS, DiT_models, drops_deep_path, get_model, model_kwargs
from routing_module import num_kept, resolve_routes
from training import config_schema  # noqa: F401  (stores the schema the YAML extends in Hydra's ConfigStore)
from training.repa import projector_training_flops
from training.repa_teachers import TEACHERS, teacher_forward_flops
from tread_utils.errors import UserError, exit_with
from tread_utils.user_imports import import_user_modules


def training_step_flops(backbone_type: str, params: dict, batch_size: int, routing: bool = True,
                        step: Optional[int] = None) -> int:
    """FLOPs of forward + backward for one batch, measured; `routing=False` counts the model unrouted;
    `step`: the training step a ratio schedule is at (None: its start)."""
    params = dict(params, enable_routing=routing)
    with torch.device("meta"):
        model = get_model(backbone_type, params).to("meta")
    model.train()
    if step is not None:
        model.router.set_step(step)
    C, H = params["in_channels"], params["input_size"]
    x = torch.randn(batch_size, C, H, H, device="meta")
    t = torch.randn(batch_size, device="meta")
    y = torch.zeros(batch_size, dtype=torch.long, device="meta")
    with FlopCounterMode(display=False) as counter:
        model(x, t, y).sum().backward()
    return counter.get_total_flops()


def sampling_forward_flops(backbone_type: str, params: dict, drop_deep_path: bool = False) -> int:
    """FLOPs of one network evaluation of one sample at inference (no token dropped), measured;
    `drop_deep_path`: path-drop guidance's weak branch (the deep path of every route whose fusion drops it skipped)."""
    with torch.device("meta"):
        model = get_model(backbone_type, params).to("meta").eval()
    C, H = params["in_channels"], params["input_size"]
    x, t = torch.randn(1, C, H, H, device="meta"), torch.randn(1, device="meta")
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(x, t, torch.zeros(1, dtype=torch.long, device="meta"), drop_deep_path=drop_deep_path)
    return counter.get_total_flops()


def tokens_per_block(depth: int, num_tokens: int, routes, routing: bool = True, step: Optional[int] = None) -> list:
    counts = [num_tokens] * depth
    for r in (routes if routing else []):
        for i in range(r.start_layer_idx, r.end_layer_idx + 1):
            counts[i] = num_kept(num_tokens, r.ratio_at(step))
    return counts


def architecture(backbone_type: str, params: dict) -> dict:
    arch = {**DiT_models[backbone_type], **{k: v for k, v in params.items() if v is not None and k in
                                           ("depth", "hidden_size", "num_heads", "mlp_ratio", "patch_size",
                                            "block_type")}}
    arch.setdefault("mlp_ratio", 4.0)
    arch.setdefault("block_type", "attention")
    arch["num_tokens"] = (params["input_size"] // arch["patch_size"]) ** 2
    return arch


def block_forward_flops(a: dict, n: int) -> int:
    """Forward FLOPs of one block over n tokens, one sample (`a` from `architecture`); a block class that counts
    its own (`forward_flops(hidden_size, mlp_ratio, n)`, LightningDiT's) is asked."""
    counted = getattr(BLOCK_TYPES[a["block_type"]], "forward_flops", None)
    if counted is not None:
        return counted(a["hidden_size"], a["mlp_ratio"], n)
    D = a["hidden_size"]
    mlp = 2 * n * D * int(D * a["mlp_ratio"]) * 2
    ada = 2 * D * 6 * D
    if a["block_type"] == "ssm":
        return 2 * n * D * 2 * D + 2 * n * n * D + 2 * n * D * D + mlp + ada
    return 2 * n * D * 3 * D + 2 * 2 * n * n * D + 2 * n * D * D + mlp + ada


def placed_routes(backbone_type: str, params: dict) -> list:
    """The routes of `params` placed in the model (routing_module.resolve_routes: resolved routes come back as
    they are, so a launch's pass through unchanged)."""
    return resolve_routes(params.get("routes"), architecture(backbone_type, params)["depth"], FUSIONS)


def fp32_blocks(depth: int, routes, fp32_after_route) -> list:
    """The blocks that run in float32 under autocast: the one right after each route ends, when
    `fp32_after_route` is on (null: DiT's default, true; the authors')."""
    if fp32_after_route is False:
        return []
    return [r.end_layer_idx + 1 for r in routes if r.end_layer_idx + 1 < depth]


def analytic_training_flops(backbone_type: str, params: dict, batch_size: int, routing: bool = True) -> int:
    """The same count from formulas: backward costs twice the forward for every matmul, except the
    patch embedding and the timestep MLP's first layer, whose inputs need no gradient."""
    a = architecture(backbone_type, params)
    D, p, C = a["hidden_size"], a["patch_size"], params["in_channels"]
    N, S = a["num_tokens"], 16
    routes = placed_routes(backbone_type, params)
    counts = tokens_per_block(a["depth"], N, routes, routing)
    per_sample = sum(block_forward_flops(a, n) for n in counts)
    # the SSM's convolution kernels (forward and backward scan) are built once per batch, not per sample
    per_batch = sum(2 * 2 * D * S * n for n in counts) if a["block_type"] == "ssm" else 0
    per_sample += sum(FUSIONS[r.fusion].flops(D, N) for r in routes if r.fusion != "none")
    per_sample += 2 * D * D                               # timestep MLP, second layer
    per_sample += 2 * D * 2 * D + 2 * N * D * p * p * C   # final adaLN and linear
    no_input_grad = 2 * N * C * p * p * D + 2 * 256 * D   # patch embedding, timestep MLP's first layer
    return batch_size * (3 * per_sample + 2 * no_input_grad) + 3 * per_batch


def activation_memory_fraction(backbone_type: str, params: dict) -> float:
    """Estimated block activation memory with routing as a fraction of dense: activations stored for
    backward grow with the tokens a block sees (linearly with SDPA's flash/efficient kernels)."""
    a = architecture(backbone_type, params)
    counts = tokens_per_block(a["depth"], a["num_tokens"], placed_routes(backbone_type, params))
    return sum(counts) / (a["depth"] * a["num_tokens"])


def routing_flop_report(backbone_type: str, params: dict, batch_size: int, repa: Optional[dict] = None,
                        dataset_kind: str = "digits") -> dict:
    """Training-step FLOPs with and without the configured routes and what they imply; with `repa` (the
    config node) enabled, also REPA's extra FLOPs. `params["routes"]`: a launch's resolved `Route`s (or the
    config's, resolved here)."""
    params = dict(params, routes=placed_routes(backbone_type, params))
    routes, a = params["routes"], architecture(backbone_type, params)
    routed = training_step_flops(backbone_type, params, batch_size, routing=True)
    dense = training_step_flops(backbone_type, params, batch_size, routing=False)
    fp32 = fp32_blocks(a["depth"], routes, params.get("fp32_after_route"))
    fp32_flops = batch_size * 3 * block_forward_flops(a, a["num_tokens"]) * len(fp32)
    tokens = tokens_per_block(a["depth"], a["num_tokens"], routes)
    return {"flops_per_step_dense": dense, "flops_per_step_routed": routed, "flop_speedup_bound": dense / routed,
            "fp32_blocks": fp32, "fp32_flop_fraction": fp32_flops / routed,
            "analytic_flops_dense": analytic_training_flops(backbone_type, params, batch_size, routing=False),
            "analytic_flops_routed": analytic_training_flops(backbone_type, params, batch_size, routing=True),
            "activation_memory_fraction": sum(tokens) / (a["depth"] * a["num_tokens"]),
            "tokens_per_block": tokens,
            **schedule_end_flops(backbone_type, params, batch_size),
            **guidance_flops(backbone_type, params),
            **repa_flops(backbone_type, params, batch_size, repa, dataset_kind)}


# pixels per latent side: the SD-VAE's downsampling (latent shards); the digits are their own images
IMAGE_SCALE = {"shards": 8, "digits": 1}


def repa_flops(backbone_type: str, params: dict, batch_size: int, repa: Optional[dict], dataset_kind: str) -> dict:
    """REPA's extra FLOPs per training step: its projector (forward + backward over the tokens the aligned block
    holds: the kept ones inside a route) and the teacher's forward pass on the clean images (measured)."""
    if not repa or not repa.get("enabled"):
        return {}
    a = architecture(backbone_type, params)
    tokens = tokens_per_block(a["depth"], a["num_tokens"], placed_routes(backbone_type, params))
    kept = tokens[int(repa["block"])]
    teacher_dim = TEACHERS[repa["encoder"]].dim
    resolution = params["input_size"] * IMAGE_SCALE[dataset_kind]
    channels = 3 if dataset_kind == "shards" else params["in_channels"]
    return {"repa_tokens": kept, "repa_block": int(repa["block"]), "repa_encoder": repa["encoder"],
            "repa_projector_flops": batch_size * projector_training_flops(a["hidden_size"], int(repa["projector_dim"]),
                                                                         teacher_dim, kept),
            "repa_teacher_flops": teacher_forward_flops(repa["encoder"], batch_size, channels, resolution)}


def guidance_flops(backbone_type: str, params: dict) -> dict:
    """With a route whose fusion can drop its deep path: one guided sampling step of one sample under
    classifier-free guidance (two full passes) and under path-drop guidance (a full pass and one without the deep
    paths)."""
    if not any(drops_deep_path(r) for r in placed_routes(backbone_type, params)):
        return {}
    full = sampling_forward_flops(backbone_type, params)
    return {"cfg_step_flops": 2 * full, "pdg_step_flops": full + sampling_forward_flops(backbone_type, params, True)}


def schedule_end_flops(backbone_type: str, params: dict, batch_size: int) -> dict:
    """With a ratio schedule, the routed step's FLOPs at its end (the report's other counts are at its start)."""
    ends = [r.schedule.end_step for r in placed_routes(backbone_type, params) if r.schedule.kind != "constant"]
    if not ends:
        return {}
    return {"schedule_end_step": max(ends),
            "flops_per_step_routed_end": training_step_flops(backbone_type, params, batch_size, step=max(ends))}


def _fp32_line(r: dict, mixed_precision) -> str:
    where = f"block(s) {r['fp32_blocks']} after the route"
    share = f"{r['fp32_flop_fraction']:.1%} of the routed step's FLOPs"
    if mixed_precision == "no":  # without autocast every block is float32: the marking changes nothing
        return (f"\n  every block runs in float32 (train.mixed_precision=no); under bf16 or fp16 {where} would "
                f"stay in float32 ({share})")
    return (f"\n  {where} run in float32 under mixed precision (TF32 matmuls on CUDA unless train.tf32=false): "
            f"{share}")


def format_report(backbone_type: str, report: dict, batch_size: int, mixed_precision=None) -> str:
    """`mixed_precision`: the run's train.mixed_precision (no: the float32 note says every block is float32)."""
    r, routed = report, report["flops_per_step_routed"]
    return (f"FLOPs per training step ({backbone_type}, batch {batch_size}, forward + backward): dense "
            f"{r['flops_per_step_dense'] / 1e9:.2f} G, routed {r['flops_per_step_routed'] / 1e9:.2f} G -> speed-up "
            f"bound {r['flop_speedup_bound']:.3f}x; block activation memory ~{r['activation_memory_fraction']:.0%} "
            f"of dense; tokens per block {r['tokens_per_block']}" + (
                _fp32_line(r, mixed_precision) if r["fp32_blocks"] else "") + (
                f"\n  ratio schedule: routed {r['flops_per_step_routed'] / 1e9:.2f} G per step at its start, "
                f"{r['flops_per_step_routed_end'] / 1e9:.2f} G from step {r['schedule_end_step']} on"
                if "schedule_end_step" in r else "") + (
                f"\n  guidance per sample and sampling step: classifier-free {r['cfg_step_flops'] / 1e9:.3f} G, "
                f"path-drop {r['pdg_step_flops'] / 1e9:.3f} G ({r['pdg_step_flops'] / r['cfg_step_flops']:.1%} of it: "
                f"the weak pass skips the deep path)"
                if "pdg_step_flops" in r else "") + (
                f"\n  REPA: projector {r['repa_projector_flops'] / 1e9:.3f} G (forward + backward over the "
                f"{r['repa_tokens']} tokens after block {r['repa_block']}), {r['repa_encoder']} teacher forward "
                f"{r['repa_teacher_flops'] / 1e9:.3f} G per step: {r['repa_projector_flops'] / routed:.1%} and "
                f"{r['repa_teacher_flops'] / routed:.1%} of the routed step"
                if "repa_teacher_flops" in r else ""))


def main():
    @hydra.main(config_path="../configs", config_name="config", version_base="1.3")
    def report(cfg):
        try:
            import_user_modules(cfg.imports)  # a size, block, rule or fusion registered in the user's own module
            params = OmegaConf.to_container(cfg.model.params, resolve=True)
            model_kwargs(cfg.model.backbone_type, params)  # the one-line refusal of a bad backbone or route
            params["enable_routing"] = True
            repa = OmegaConf.to_container(cfg.repa, resolve=True)
            report = routing_flop_report(cfg.model.backbone_type, params, 1, repa, cfg.dataset.kind)
            print(format_report(cfg.model.backbone_type, report, 1))
        except UserError as e:
            exit_with(str(e))

    report()


if __name__ == "__main__":
    main()
