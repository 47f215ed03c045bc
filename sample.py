"""Sample images from a trained checkpoint (EMA weights) into an ADM-layout .npz for evaluation.

    python sample.py ckpt=results/tread-digits num_samples=500 out=samples.npz grid=grid.png
    accelerate launch sample.py ckpt=results/run/checkpoints/ckpt_00400000.pt seeds=0-49999 out=fid50k.npz
    python sample.py ckpt=run num_samples=500 cfg_scale=1.5 guidance_interval=[0.3,5] sampler.num_steps=32
    python sample.py ckpt=run num_samples=500 sampler=ablation sampler.solver=euler sampler.discretization=vp
    python sample.py ckpt=run num_samples=500 routing_guidance.scale=1.5 routing_guidance.weak_ratio=0.7
    python sample.py ckpt=run num_samples=500 path_drop_guidance.scale=1.5   # a model with SPRINT routes (fusion: sprint)

Options are Hydra overrides of configs/sample.yaml (`python sample.py --help` lists them with defaults).
The output holds `arr_0` uint8 [N, H, W, 3] and `arr_1` int64 labels in seed order; every seed has its
own generator, so a seed gives the same latents and label whatever the batch size or number of processes
(`accelerate launch` splits the seeds, only the main process writes). Bad input is reported in one line
before any sampling, and the output file is written atomically (nothing half-written is ever left).
"""
import os
import sys
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.errors import HydraException
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from training.config_check import check_sample_config
from tread_utils.errors import UserError, exit_with

CONFIG_DIR = Path(__file__).resolve().parent / "configs"
CONFIG_NAME = "sample"


def _override_key(arg: str) -> str:
    return arg.partition("=")[0].lstrip("+~")


def prepare_overrides(argv) -> list:
    """Friendly spellings -> Hydra overrides, and unknown keys -> one-line errors (before Hydra sees them).

    `sampler=euler` means `sampler.name=euler`; `seeds=0,5,7` is quoted (Hydra would read it as a sweep).
    """
    base = OmegaConf.load(CONFIG_DIR / f"{CONFIG_NAME}.yaml")
    out = []
    for arg in argv:
        if arg.startswith("-"):
            raise UserError(f"unknown flag {arg}; options are key=value overrides (see python sample.py --help)")
        key, sep, value = arg.partition("=")
        if not sep:
            raise UserError(f"cannot read {arg!r}; options are key=value, e.g. ckpt=PATH num_samples=100")
        if key == "sampler" and value and not value.startswith("{"):
            key, arg = "sampler.name", f"sampler.name={value}"
        if key == "seeds" and "," in value and value[:1] not in "[\"'":
            arg = f"seeds='{value}'"
        if not key.startswith(("+", "~", "hydra.")):
            node, parts = base, key.split(".")
            for i, part in enumerate(parts):
                if not OmegaConf.is_dict(node) or part not in list(node.keys()):
                    where = ".".join(parts[:i])
                    valid = ", ".join(str(k) for k in node.keys()) if OmegaConf.is_dict(node) else "none"
                    raise UserError(f"unknown option {key!r}; {where + ' ' if where else ''}options: {valid}")
                node = node._get_node(part)
        out.append(arg)
    return out


def compose_config(argv):
    overrides = prepare_overrides(argv)
    GlobalHydra.instance().clear()  # a CLI entry point: ours is the only Hydra configuration
    try:
        with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3", job_name="sample"):
            cfg = compose(CONFIG_NAME, overrides=overrides)
    except (HydraException, OmegaConfBaseException, ValueError) as e:
        lines = [line.strip() for line in str(e).splitlines() if line.strip()]
        raise UserError(f"cannot read the options: {' '.join(lines[:2])}") from None
    check_sample_config(cfg)  # types and sampler ranges (training.config_schema.SampleSchema)
    return cfg


def _positive_int(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise UserError(f"{name} must be a positive integer, got {value!r}")
    return value


def resolve_seeds(num_samples, seeds) -> list:
    from generation import parse_seeds  # loads torch: kept out of --help, like the imports of run()

    if num_samples is not None:
        num_samples = _positive_int(num_samples, "num_samples")
    if seeds is None:
        if num_samples is None:
            raise UserError("give num_samples=N (seeds 0..N-1) or seeds=e.g. 0-49999")
        return list(range(num_samples))
    seed_list = parse_seeds(seeds)
    if num_samples is not None and num_samples != len(seed_list):
        raise UserError(f"num_samples={num_samples} does not match the {len(seed_list)} seeds of seeds={seeds}; "
                        f"give one of them, or make them agree")
    return seed_list


def run(cfg) -> None:
    # torch, accelerate and the model code load here, not at the top, so that --help answers at once
    import torch
    import generation
    from data.decoders import decoder_for
    from evaluations.digits_classifier import class_accuracy
    from training import checkpoint as ckpt
    from tread_utils.distributed import check_cuda_processes, start_processes
    from tread_utils.files import check_output_path
    from tread_utils.precision import set_precision_policy
    check_cuda_processes()

    if OmegaConf.is_missing(cfg, "ckpt") or cfg.ckpt in (None, ""):
        raise UserError("ckpt is required: ckpt=PATH (a checkpoint file or a run directory)")
    seeds = resolve_seeds(cfg.num_samples, OmegaConf.to_object(cfg.seeds) if OmegaConf.is_list(cfg.seeds)
                          else cfg.seeds)
    batch_size = _positive_int(cfg.batch_size, "batch_size")
    class_labels = cfg.class_labels
    if class_labels is not None and (isinstance(class_labels, bool) or not isinstance(class_labels, int)):
        raise UserError(f"class_labels must be null (random per seed) or a class index, got {class_labels!r}")
    grid_images = _positive_int(cfg.grid_images, "grid_images")
    grid_per_class = _positive_int(cfg.grid_per_class, "grid_per_class")

    out = check_output_path(cfg.out, ".npz", "out")
    grid = check_output_path(cfg.grid, ".png", "grid") if cfg.grid else None
    given = {k: v for k, v in OmegaConf.to_container(cfg.sampler, resolve=True).items() if v is not None}
    sampler_kwargs = {**generation.DEFAULT_SAMPLER, **given}
    generation.make_sampler(sampler_kwargs)  # unknown sampler, setting or value: refused before loading anything
    path = ckpt.resolve_checkpoint(cfg.ckpt)
    accelerator = start_processes(cpu=not torch.cuda.is_available())
    set_precision_policy(bool(cfg.tf32))
    state = ckpt.read_checkpoint(path)
    net, run_cfg = ckpt.net_from_state(state, path, accelerator.device)
    if class_labels is not None and not 0 <= class_labels < net.num_classes:
        raise UserError(f"class_labels={class_labels} is not a class of this model (0..{net.num_classes - 1})")
    drop_prob = run_cfg.get("train", {}).get("general", {}).get("class_drop_prob")
    guided = generation.build_guided_net(net, OmegaConf.to_container(cfg, resolve=True), class_drop_prob=drop_prob)
    decoder = decoder_for(run_cfg.get("dataset", {}), vae=cfg.vae, device=accelerator.device)
    main = accelerator.is_main_process
    if main:
        print(f"sampling {len(seeds)} images from {path} (step {state['step']}, EMA) with {accelerator.num_processes} "
              f"process(es) on {accelerator.device}: sampler {sampler_kwargs['name']}, {sampler_kwargs['num_steps']} "
              f"steps, cfg_scale {cfg.cfg_scale}, routing guidance "
              f"{'off' if cfg.routing_guidance.scale is None else cfg.routing_guidance.scale}, path-drop guidance "
              f"{'off' if cfg.path_drop_guidance.scale is None else cfg.path_drop_guidance.scale}", flush=True)
    step = state["step"]
    del state
    images, labels = generation.generate(guided, seeds, sampler_kwargs=sampler_kwargs, decoder=decoder,
                                       batch_size=batch_size, device=accelerator.device, accelerator=accelerator,
                                       class_labels=class_labels, progress=bool(cfg.progress))
    if main:
        generation.save_samples_npz(out, images, labels)
        print(f"wrote {out}: arr_0 {images.dtype} {list(images.shape)}, arr_1 {labels.dtype} {list(labels.shape)}")
        caption = (f"{path.name}: step {step}, {sampler_kwargs['name']} {sampler_kwargs['num_steps']} steps, "
                   f"cfg_scale {cfg.cfg_scale}")
        if run_cfg.get("dataset", {}).get("kind") == "digits":
            acc = class_accuracy(images, labels)
            caption += f", class_acc {acc:.3f}"
            print(f"class_acc {acc:.3f}: the shipped digits classifier reads that fraction of the samples as "
                  f"the digit they were conditioned on")
        if grid is not None:
            generation.save_image_grid(grid, images, labels, num_classes=net.num_classes, per_class=grid_per_class,
                                       max_images=grid_images, caption=caption)
            print(f"wrote {grid}")
    accelerator.end_training()


def _fail(message: str):
    """One line from the main process; the other processes of a launch exit quietly with the same code."""
    if int(os.environ.get("RANK", "0")) != 0:
        sys.exit(2)
    exit_with(message)


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    if any(a in ("-h", "--help") for a in argv):
        options = (CONFIG_DIR / f"{CONFIG_NAME}.yaml").read_text()
        print(f"{__doc__.strip()}\n\nOptions (configs/sample.yaml):\n{options}")
        return
    try:
        run(compose_config(argv))
    except UserError as e:
        _fail(str(e))
    except OmegaConfBaseException as e:
        _fail(f"configuration: {str(e).splitlines()[0]}")
    except KeyboardInterrupt:
        _fail("interrupted; no output was written")


if __name__ == "__main__":
    main()
