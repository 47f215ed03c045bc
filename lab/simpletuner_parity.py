"""Parity with SimpleTuner's TREAD: its router's kept counts, and its own transformer files run beside ours.

    python -m lab.simpletuner_parity --simpletuner DIR [--out LOG] [--families flux,sd3,...]
    TREAD_SIMPLETUNER=DIR python -m pytest tests/test_simpletuner_parity.py

DIR is a SimpleTuner checkout or its installed package (PyPI `simpletuner`), imported from DIR at run time, never
copied (SimpleTuner is AGPL). Three comparisons:
- the router (simpletuner/helpers/training/tread.py): for every (N, ratio) pair of a grid, both choose tokens for the
  same batch: `apply_tread(..., kept_count="simpletuner")` must keep as many tokens as `TREADRouter.get_mask`, with
  and without a force-keep mask, and keep every forced token; the pairs where the authors' count differs are listed;
- the transformers (lab/simpletuner_models.py): per family both route, the same tiny model on both sides fed the same
  kept tokens over several route layouts: outputs, input gradients, kept counts and the blocks each side routes,
  and SimpleTuner's --tread_config strings against `routes_from_config`. Where SimpleTuner fails, its error is logged;
  where it runs with other values, the causes (lab/simpletuner_families.py, WHY_IT_DIFFERS), each isolated by a row;
- mask images (lab/simpletuner_masks.py): its model_predict run on the same masks as `mask_to_tokens`, token by token.
The command exits non-zero when a kept count, a mask token or a family not listed with its causes differs.
"""
import argparse
import hashlib
import importlib.util
import subprocess
import sys
from pathlib import Path

import torch

from lab.simpletuner_families import FAMILIES, NOT_COMPARED, WHY_IT_DIFFERS, WHY_IT_FAILS
from lab.simpletuner_joint import SEQUENCE_FAMILIES, compare_sequence_family
from lab.simpletuner_masks import MASK_CODE, OTHER_RULE, compare_masks
from lab.simpletuner_models import STUBS, compare_configs, compare_family
from routing_module import num_kept
from tread_diffusers.tread import TreadHandle
from tread_utils.errors import UserError, report_user_errors

ROUTER_FILES = ("simpletuner/helpers/training/tread.py", "helpers/training/tread.py")
TOKENS = (16, 64, 77, 256, 1024, 4096)
RATIOS = (0.1, 0.25, 0.3, 0.35, 0.5, 0.55, 0.6, 0.7, 0.75, 0.9)


def load_router(code_dir) -> tuple:
    """SimpleTuner's TREADRouter class, loaded from a checkout or an installed package directory, and the
    file's path in that directory and its sha256 (which version ran; no machine path in the log)."""
    for relative in ROUTER_FILES:
        path = Path(code_dir) / relative
        if path.is_file():
            spec = importlib.util.spec_from_file_location("simpletuner_tread", path)
            module = importlib.util.module_from_spec(spec)
            try:
                spec.loader.exec_module(module)
            except Exception as err:
                raise UserError(f"--simpletuner-code: importing {path} failed ({type(err).__name__}: {err})") from None
            return module.TREADRouter, f"{relative} sha256 {hashlib.sha256(path.read_bytes()).hexdigest()[:16]}"
    raise UserError(f"--simpletuner-code {code_dir}: no {' or '.join(ROUTER_FILES)}; pass a SimpleTuner checkout or "
                    f"its installed package directory")


def our_kept(num_tokens: int, ratio: float, kept_count: str) -> int:
    handle = TreadHandle.__new__(TreadHandle)  # only the kept-count rule: no model needed
    handle.kept_count = kept_count
    return num_kept(num_tokens, handle._ratio(ratio, num_tokens))


def compare(router_cls, batch: int = 2, seed: int = 0) -> dict:
    """Per (N, ratio): SimpleTuner's and our kept counts (plain and with a force-keep mask), and the authors'."""
    rows, generator = [], torch.Generator().manual_seed(seed)
    for n in TOKENS:
        for ratio in RATIOS:
            x = torch.randn(batch, n, 4, generator=generator)
            force = torch.rand(batch, n, generator=generator) < 0.3
            router = router_cls(seed=seed)
            theirs = router.get_mask(x, ratio).ids_keep.shape[1]
            theirs_forced = router.get_mask(x, ratio, force_keep=force)
            ours = our_kept(n, ratio, "simpletuner")
            ours_forced = max(ours, int(force.sum(1).max()))
            kept_forced = torch.zeros_like(force).scatter(1, theirs_forced.ids_keep, True)
            rows.append(dict(tokens=n, ratio=ratio, simpletuner=theirs, ours=ours, authors=our_kept(n, ratio, "authors"),
                             simpletuner_forced=theirs_forced.ids_keep.shape[1], ours_forced=ours_forced,
                             they_keep_forced=bool((kept_forced | ~force).all())))
    return {"rows": rows, "same": all(r["simpletuner"] == r["ours"] and r["simpletuner_forced"] == r["ours_forced"]
                                      and r["they_keep_forced"] for r in rows),
            "authors_differ": sum(r["authors"] != r["ours"] for r in rows)}


def report(result: dict) -> str:
    lines = ["tokens ratio simpletuner ours(kept_count=simpletuner) authors | forced: simpletuner ours"]
    lines += [f"{r['tokens']:6d} {r['ratio']:5.2f} {r['simpletuner']:11d} {r['ours']:28d} {r['authors']:7d} | "
              f"{r['simpletuner_forced']:19d} {r['ours_forced']:4d}" for r in result["rows"]]
    equal = sum(r["simpletuner"] == r["ours"] and r["simpletuner_forced"] == r["ours_forced"] for r in result["rows"])
    lines.append(f"kept counts equal, with and without force-keep, in {equal} of {len(result['rows'])} (N, ratio) "
                 f"pairs; SimpleTuner keeps every forced token: {all(r['they_keep_forced'] for r in result['rows'])}; "
                 f"the authors' count differs in {result['authors_differ']}")
    return "\n".join(lines)


def version_of(code_dir) -> str:
    """The checkout's commit, or the installed package's version."""
    git = subprocess.run(["git", "-C", str(code_dir), "rev-parse", "--short=9", "HEAD"], capture_output=True, text=True)
    if git.returncode == 0:
        return f"commit {git.stdout.strip()}"
    init = next((p for p in (Path(code_dir) / "simpletuner" / "__init__.py", Path(code_dir) / "__init__.py")
                 if p.is_file()), None)
    version = [line for line in init.read_text().splitlines() if line.startswith("__version__")] if init else []
    return version[0] if version else "version unknown"


def file_hash(code_dir, relative: str) -> str:
    root = Path(code_dir) if (Path(code_dir) / "simpletuner").is_dir() else Path(code_dir).parent
    return hashlib.sha256((root / relative).read_bytes()).hexdigest()[:16]


def report_family(result: dict, code_dir) -> list:
    lines = [f"{result['family']}: {result['file']} sha256 {file_hash(code_dir, result['file'])}; unrouted "
             f"difference output {result['baseline'][0]:.2g}, gradients {result['baseline'][1]:.2g} (tolerance "
             f"{result['tolerance'][0]:.2g} / {result['tolerance'][1]:.2g})"
             + (f"; config keys SimpleTuner's class does not take: {sorted(result['dropped'])}" if result["dropped"]
                else "")]
    for r in result["rows"]:
        if r["error"]:
            lines.append(f"  {r['layout']:42s} SimpleTuner fails: {r['error']}; ours routes blocks {r['blocks'][0]}")
            continue
        lines.append(f"  {r['layout']:42s} output {r['diff'][0]:.2g}  gradients {r['diff'][1]:.2g}  kept "
                     f"{[c[0] for c in r['counts']]} / {[c[1] for c in r['counts']]}  blocks {r['blocks'][0]} / "
                     f"{r['blocks'][1]}  {'same' if r['same'] else 'DIFFERENT'}"
                     + (f"  (its own choice drops {sum(c[2] for c in r['counts'])} of the tokens we never route)"
                        if any(c[2] for c in r["counts"]) else ""))
    if any(r["error"] for r in result["rows"]):
        lines.append(f"  SimpleTuner fails because {WHY_IT_FAILS.get(result['family'], 'of an error not read yet')}; "
                     f"ours routes there, as the paper's rule asks")
    if result["family"] in WHY_IT_DIFFERS:
        lines.append(f"  where the kept counts or values differ: {WHY_IT_DIFFERS[result['family']]}")
    return lines


def report_masks(rows: list, code_dir) -> list:
    """The mask-image tokenisation rows, and the count of tokens that differ per family."""
    files = [f"simpletuner/helpers/models/{MASK_CODE[f][0]}/model.py" for f in dict.fromkeys(r["family"] for r in rows)]
    lines = ["mask images to force-keep tokens: SimpleTuner's model_predict (run, its transformer a stand-in that "
             "records force_keep_mask) / ours (read_mask, mask_to_tokens); forced tokens over the batch, differing; "
             "files: " + ", ".join(f"{f} sha256 {file_hash(code_dir, f)}" for f in files),
             f"  {'family':7s} {'image':>9s} {'grid':>10s} {'mask':13s} {'form':40s} {'rule':4s} ours theirs differ"]
    size = lambda r: f"  {r['family']:7s} {'x'.join(map(str, r['size'])):>9s}"  # noqa: E731
    lines += [f"{size(r)} not run: {r['error']}" if r["error"] else
              f"{size(r)} {'x'.join(map(str, r['grid'])):>10s} {r['mask']:13s} {r['form']:40s} {r['rule']:4s} "
              f"{r['ours']:4d} {r['theirs']:6d} {r['differ']:6d} of {r['tokens']}" for r in rows]
    for family in dict.fromkeys(r["family"] for r in rows):
        mine = [r for r in rows if r["family"] == family and not r["error"]]
        lines.append(f"  {family}: {sum(r['differ'] == 0 for r in mine)} of {len(mine)} cases token-identical, "
                     f"{sum(r['differ'] for r in mine)} tokens differ" + (f"; {MASK_NOTES[family]}" if family in
                                                                          MASK_NOTES else ""))
    return lines


_AS_IS = ("its formula reads a [0, 1] image handed to it as it is as [-1, 1] (0 is the middle), so any covered "
          "pixel keeps the token: our rule 'any', not 'half'")
MASK_NOTES = {"flux": _AS_IS, "chroma": _AS_IS, "flux2": _AS_IS, **OTHER_RULE}


def compare_transformers(code_dir, families) -> tuple:
    """The log lines of every family and the config strings, and whether everything SimpleTuner runs agrees."""
    lines, agree = [], True
    for name in families:
        result = (compare_sequence_family if name in SEQUENCE_FAMILIES else compare_family)(name, code_dir)
        lines += report_family(result, code_dir)
        agree &= name in WHY_IT_DIFFERS or all(r["same"] for r in result["rows"] if not r["error"])
    lines += [f"{name}: not compared: {why}" for name, why in NOT_COMPARED.items()]
    masks = compare_masks(code_dir)
    lines += report_masks(masks, code_dir)
    agree &= all(r["differ"] == 0 for r in masks if not r["error"] and r["family"] not in OTHER_RULE)
    lines.append("config strings (SimpleTuner reads them with ast.literal_eval; blocks routed, ours / SimpleTuner's "
                 "FLUX of 2 + 2 blocks):")
    for row in compare_configs(code_dir):
        lines.append(f"  {row['config']}\n    ours {row['ours']} / SimpleTuner {row['theirs']}")
    return lines, agree


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--simpletuner", "--simpletuner-code", dest="simpletuner", required=True,
                        help="a SimpleTuner checkout or its installed package directory")
    parser.add_argument("--families", default=",".join(FAMILIES),
                        help=f"comma-separated transformer families to run (default all: {','.join(FAMILIES)})")
    parser.add_argument("--out", help="also write the log here")
    return parser


@report_user_errors
def main(argv=None):
    args = build_parser().parse_args(argv)
    families = [f for f in args.families.split(",") if f]
    unknown = [f for f in families if f not in FAMILIES]
    if unknown:
        raise UserError(f"--families {','.join(unknown)}: unknown; choose from {','.join(FAMILIES)}")
    router_cls, source = load_router(args.simpletuner)
    result = compare(router_cls)
    lines, agree = compare_transformers(args.simpletuner, families)
    stubs = ", ".join(f"{m} ({', '.join(n)})" for m, n in STUBS.items()
                      if m in sys.modules and getattr(sys.modules[m], "__file__", None) is None) or "none"
    import diffusers
    text = "\n".join([f"SimpleTuner {version_of(args.simpletuner)}; router: {source}; diffusers "
                      f"{diffusers.__version__}, torch {torch.__version__}", report(result), "",
                      f"transformers, same kept tokens on both sides (modules stubbed, not installed: {stubs})",
                      *lines])
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    if not (result["same"] and agree):
        sys.exit(1)


if __name__ == "__main__":
    main()
