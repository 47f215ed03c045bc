"""Parity with SimpleTuner's TREAD router (simpletuner/helpers/training/tread.py): the kept count and force-keep.

    python -m lab.simpletuner_parity --simpletuner-code DIR [--out LOG]
    TREAD_SIMPLETUNER=DIR python -m pytest tests/test_simpletuner_parity.py

DIR is a SimpleTuner checkout or its installed package (PyPI `simpletuner`). Its router file imports only torch
and is loaded from DIR at run time, never copied (SimpleTuner is AGPL). For every (N, ratio) pair of a grid,
both routers choose tokens for the same batch: `apply_tread(..., kept_count="simpletuner")` must keep as many
tokens as SimpleTuner's `TREADRouter.get_mask`, with and without a force-keep mask, and keep every forced
token; the pairs where the authors' count differs are reported. Family outputs are not compared here.
"""
import argparse
import hashlib
import importlib.util
import sys
from pathlib import Path

import torch

from backbones.diffusers_tread import TreadHandle
from routing_module import num_kept
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--simpletuner-code", required=True, help="a SimpleTuner checkout or installed package")
    parser.add_argument("--out", help="also write the log here")
    return parser


@report_user_errors
def main(argv=None):
    args = build_parser().parse_args(argv)
    router_cls, source = load_router(args.simpletuner_code)
    result = compare(router_cls)
    text = f"SimpleTuner router: {source}\n" + report(result)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    if not result["same"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
