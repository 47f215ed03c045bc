"""Export a run's EMA weights for sharing: ``model.safetensors`` and ``config.json`` (Hugging Face layout).

    python -m tools.export results/tread-digits --out exported/tread-digits
    python -m tools.export results/run/checkpoints/ckpt_00400000.pt --out exported/run-400k

The folder loads with ``dit.DiT.from_pretrained(DIR)`` (the backbone) and wherever a run is accepted:
``python sample.py ckpt=DIR``, ``init_from=DIR``. ``huggingface_hub``'s ``upload_folder`` (or
``DiT.push_to_hub``) publishes it; ``DiT.from_pretrained("user/repo")`` then reads it through the Hub cache.
The optimizer, RNG and data position stay behind: an export is for sampling and fine-tuning, not resuming.
"""
import shutil
from pathlib import Path

from training.checkpoint import net_from_state, read_checkpoint, resolve_checkpoint
from training.exported import FORMAT, write_export
from tread_utils.errors import UserError, report_user_errors
from tread_utils.cli import ArgumentParser
from tread_utils.hub import CONFIG_NAME, WEIGHTS_NAME, read_config


def build_parser():
    p = ArgumentParser(prog="python -m tools.export", description=__doc__.split("\n")[0])
    p.add_argument("run", help="a run directory (its newest checkpoint), a checkpoint file or an exported folder")
    p.add_argument("--out", required=True, help="output folder (created; must be empty or an earlier export of "
                                                "the same run, which is replaced)")
    p.add_argument("--replace", action="store_true", help="replace an export of another run in --out")
    return p


def check_out(out: Path, run_name, replace: bool) -> Path:
    """--out is new, empty, or an earlier export of the same run (a newer step replaces it); another model's
    files are never replaced, another run's export only with --replace."""
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} is a file; give a folder")
    if not out.is_dir() or not any(out.iterdir()):
        return out
    extra = sorted(p.name for p in out.iterdir() if p.name not in (CONFIG_NAME, WEIGHTS_NAME, "README.md"))
    if extra:
        raise UserError(f"--out {out} holds other files ({', '.join(extra[:3])}); give an empty or new folder")
    try:
        tread = read_config(out / CONFIG_NAME).get("tread")
    except UserError:
        tread = None
    if not isinstance(tread, dict) or tread.get("format") != FORMAT:
        raise UserError(f"--out {out} holds another model (not an export of this project); give an empty or new "
                        f"folder")
    if tread.get("run_name") != run_name and not replace:
        raise UserError(f"--out {out} holds an export of run {tread.get('run_name')!r} (step {tread.get('step')}), "
                        f"not of {run_name!r}; give another folder, or add --replace")
    return out


@report_user_errors
def main(argv=None):
    args = build_parser().parse_args(argv)
    source = resolve_checkpoint(args.run)
    out = Path(args.out).expanduser()
    if out.resolve() == source.resolve():
        raise UserError(f"--out {out} is the folder being exported; give another folder")
    state = read_checkpoint(source)
    net, run_cfg = net_from_state(state, source)  # validates the config against the EMA weights
    check_out(out, run_cfg.get("run_name"), args.replace)
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    write_export(net.model, run_cfg, state["step"], tmp)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)  # never a half-written export under the name asked for
    print(f"wrote {out}: {WEIGHTS_NAME} ({sum(p.numel() for p in net.model.parameters()):,} EMA parameters, step "
          f"{state['step']}) and {CONFIG_NAME} ({run_cfg['model']['backbone_type']}, diffuser "
          f"{run_cfg['diffuser'].get('name', 'edm')})")


if __name__ == "__main__":
    main()
