"""Sample images from a trained checkpoint (EMA weights) into an ADM-layout .npz for evaluation.

    python sample.py ckpt=results/tread-digits num_samples=500 out=samples.npz grid=grid.png
    accelerate launch -q sample.py ckpt=results/run/checkpoints/ckpt_00400000.pt seeds=0-49999 out=fid50k.npz
    python sample.py ckpt=run num_samples=500 cfg_scale=1.5 guidance_interval=[0.3,5] sampler.num_steps=32
    python sample.py ckpt=run num_samples=500 sampler.name=ablation sampler.solver=euler sampler.discretization=vp
    python sample.py ckpt=run seeds=[0-9,20-29,7] class_labels=3   # ranges and single seeds (or seeds='0-9,20-29')
    python sample.py ckpt=run num_samples=500 routing_guidance.scale=1.5 routing_guidance.weak_ratio=0.7
    python sample.py ckpt=run num_samples=500 path_drop_guidance.scale=1.5   # a model with SPRINT routes (fusion: sprint)

Options are Hydra overrides of configs/sample.yaml, as for train.py (`python sample.py --help` lists them
with defaults); they are checked by training.config_check.check_sample_config. The run's `imports` (the modules
of the user's own it was trained with) are imported again before its model is built.
The output holds `arr_0` uint8 [N, H, W, 3] and `arr_1` int64 labels in seed order; every seed has its
own generator, so a seed gives the same latents and label whatever the batch size or number of processes
(`accelerate launch` splits the seeds, only the main process writes). Bad input is reported in one line
before any sampling (the last line of the output, under `accelerate launch -q`), and the output file is
written atomically (nothing half-written is ever left).
"""
import os
import sys
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.errors import HydraException
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from training.config_check import check_guidance_has_dropout, check_sample_config, hydra_error_line
from training.config_schema import SampleSchema
from tread_utils.errors import UserError, exit_with

CONFIG_DIR = Path(__file__).resolve().parent / "configs"
CONFIG_NAME = "sample"
VAE_OPTION = "vae=DIR"  # how this command is given a VAE, for the errors that ask for one


def resolve_seeds(num_samples, seeds) -> list:
    """The seeds to sample, from num_samples and seeds (their ranges are checked by check_sample_config)."""
    from generation import parse_seeds  # loads torch: only for options that passed the schema

    if seeds is None:
        if num_samples is None:
            raise UserError("give num_samples=N (seeds 0..N-1) or seeds=e.g. 0-49999")
        return list(range(num_samples))
    seed_list = parse_seeds(OmegaConf.to_object(seeds) if OmegaConf.is_list(seeds) else seeds)
    if num_samples is not None and num_samples != len(seed_list):
        raise UserError(f"num_samples={num_samples} does not match the {len(seed_list)} seeds of seeds={seeds}; "
                        f"give one of them, or make them agree")
    return seed_list


def checked(cfg):
    """The options checked before any side effect: the schema and ranges, then the seeds."""
    cfg = check_sample_config(cfg)
    return cfg, resolve_seeds(cfg.num_samples, cfg.seeds)


def composed(argv, hydra_node: bool = False):
    """configs/sample.yaml with the overrides `argv`, composed by Hydra's compose API (no working directory,
    logging or command-line state of its own); `hydra_node`: with Hydra's node (the help text)."""
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3", job_name="sample"):
            return compose(CONFIG_NAME, overrides=list(argv), return_hydra_config=hydra_node)
    except (HydraException, OmegaConfBaseException) as e:
        raise UserError(hydra_error_line(e, SampleSchema)) from None
    finally:
        GlobalHydra.instance().clear()


def compose_config(argv):
    """The checked options of a command line, without running it (for the checker of the documented commands)."""
    return checked(composed(argv))[0]


def help_text() -> str:
    template = composed([], hydra_node=True).hydra.help.template  # configs/sample.yaml's hydra.help
    return template.replace("$CONFIG", OmegaConf.to_yaml(composed([])))


def run(cfg, seeds: list) -> None:
    # torch, accelerate and the model code load here, not at the top: --help and bad options answer at once
    import torch
    import generation
    from data.decoders import decoder_for
    from data.latent_vae import decoding_vae
    from evaluations.digits_classifier import class_accuracy
    from training import checkpoint as ckpt
    from tread_utils.distributed import check_cuda_processes, start_processes
    from tread_utils.files import check_output_path
    from tread_utils.precision import set_precision_policy
    check_cuda_processes()

    class_labels = cfg.class_labels
    out = check_output_path(cfg.out, ".npz", "out")
    grid = check_output_path(cfg.grid, ".png", "grid") if cfg.grid else None
    given = {k: v for k, v in OmegaConf.to_container(cfg.sampler, resolve=True).items() if v is not None}
    sampler_kwargs = {**generation.DEFAULT_SAMPLER, **given}
    path = ckpt.resolve_checkpoint(cfg.ckpt)
    accelerator = start_processes(cpu=not torch.cuda.is_available())
    set_precision_policy(bool(cfg.tf32))
    state = ckpt.read_checkpoint(path)
    net, run_cfg = ckpt.net_from_state(state, path, accelerator.device)
    if class_labels is not None and not 0 <= class_labels < net.num_classes:
        raise UserError(f"class_labels={class_labels} is not a class of this model (0..{net.num_classes - 1})")
    drop_prob = run_cfg.get("train", {}).get("general", {}).get("class_drop_prob")
    check_guidance_has_dropout("cfg_scale", cfg.cfg_scale, drop_prob)
    guided = generation.build_guided_net(net, OmegaConf.to_container(cfg, resolve=True), class_drop_prob=drop_prob)
    vae, vae_note = decoding_vae(run_cfg.get("dataset", {}), given=cfg.vae, option="vae")  # the latents' own
    decoder = decoder_for(run_cfg.get("dataset", {}), vae=vae, device=accelerator.device, vae_option=VAE_OPTION)
    main = accelerator.is_main_process
    if main:
        print(f"sampling {len(seeds)} images from {path} (step {state['step']}, EMA) with {accelerator.num_processes} "
              f"process(es) on {accelerator.device}: sampler {sampler_kwargs['name']}, {sampler_kwargs['num_steps']} "
              f"steps, cfg_scale {cfg.cfg_scale}, routing guidance "
              f"{'off' if cfg.routing_guidance.scale is None else cfg.routing_guidance.scale}, path-drop guidance "
              f"{'off' if cfg.path_drop_guidance.scale is None else cfg.path_drop_guidance.scale}", flush=True)
        if vae_note:
            print(vae_note, flush=True)
    step = state["step"]
    del state
    images, labels = generation.generate(guided, seeds, sampler_kwargs=sampler_kwargs, decoder=decoder,
                                       batch_size=cfg.batch_size, device=accelerator.device, accelerator=accelerator,
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
            generation.save_image_grid(grid, images, labels, num_classes=net.num_classes, per_class=cfg.grid_per_class,
                                       max_images=cfg.grid_images, caption=caption)
            print(f"wrote {grid}")
    accelerator.end_training()


def _fail(message: str):
    """One line from the main process; the other processes of a launch exit with the same code, silently."""
    exit_with(message, quiet=int(os.environ.get("RANK", "0")) != 0)


def main(argv=None) -> None:
    """The command: `argv` (default: the command line) are Hydra overrides of configs/sample.yaml."""
    argv = [str(a) for a in (sys.argv[1:] if argv is None else argv)]
    if argv[:1] in (["--help"], ["-h"]):
        print(help_text())
        return
    try:
        flags = [a for a in argv if a.startswith("-")]
        if flags:
            raise UserError(f"unknown flag {flags[0]}; options are key=value overrides, e.g. {VAE_OPTION} "
                            f"(see --help)")
        run(*checked(composed(argv)))
    except UserError as e:
        _fail(str(e))
    except OmegaConfBaseException as e:
        _fail(f"configuration: {str(e).splitlines()[0]}")
    except KeyboardInterrupt:
        _fail("interrupted; no output was written")


if __name__ == "__main__":
    main()
