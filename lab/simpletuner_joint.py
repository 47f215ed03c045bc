"""SimpleTuner's Ernie and MiniMax H3 transformer files beside `apply_tread`, fed the same kept tokens (the harness of
lab/simpletuner_models.py, for the two families whose SimpleTuner file selects over the whole block sequence).

SimpleTuner's Ernie and MiniMax H3 call its router's `get_mask` on every row of the blocks' sequence, with the text
(Ernie) or every row not tagged video (MiniMax H3) forced kept. `apply_tread` selects among the image (target video)
rows only. Our kept rows are replayed into its `get_mask` as block-sequence positions, in the order our routed
blocks hold them (lab/simpletuner_families.REPLAY: Ernie's kept image rows, then the text; MiniMax H3's leading
rows, then the kept target rows), so both run the same rows; its own count is recorded beside ours. Ernie's blocks
are sequence-first ([S, B, D]): the block lengths are read on axis 0.
"""
import torch

from lab.simpletuner_families import FAMILIES, REPLAY, source_file
from lab.simpletuner_models import (B, LAYOUTS, build_pair, difference, import_simpletuner, recorded_selection,
                                    replaying_router)
from lab.simpletuner_models import run as harness_run
from tread_diffusers import apply_tread

SEQUENCE_FAMILIES = ("ernie", "minimax")  # the rows of lab/simpletuner_families.FAMILIES this module compares
TOKEN_AXIS = {"ernie": 0, "minimax": 1}  # the token axis of the blocks' sequence
def sequence_lengths(name: str, model) -> tuple:
    """A hook per block recording the length of the token sequence it is given."""
    seen, hooks = {}, []
    for i, block in enumerate(getattr(model, FAMILIES[name][2][0])):
        def record(module, args, kwargs, i=i):
            x = args[0] if args else kwargs["x" if name == "ernie" else "hidden_states"]
            seen[i] = x.shape[TOKEN_AXIS[name]]
        hooks.append(block.register_forward_pre_hook(record, with_kwargs=True))
    return seen, hooks


def run(name: str, model, inputs: dict):
    """The harness's `run`: the output and the input gradients (latents, text) of a fixed random projection."""
    return harness_run(model, inputs, ("hidden_states", "text_bth" if name == "ernie" else "encoder_hidden_states"))


def routed_blocks(name: str, model, inputs: dict, call) -> tuple:
    """`call()`'s result and the blocks whose sequence it shortened (against an unrouted pass's lengths)."""
    seen, hooks = sequence_lengths(name, model)
    try:
        model.eval()
        with torch.no_grad():
            model(**inputs)
        full = dict(seen)
        model.train()
        result = call()
    finally:
        for hook in hooks:
            hook.remove()
    return result, [i for i in sorted(seen) if seen[i] < full[i]]


def compare_layout(name: str, ours, theirs, module, inputs: dict, routes: list) -> dict:
    counts = []
    with recorded_selection() as chosen:
        handle = apply_tread(ours, {"routes": routes}, kept_count="simpletuner")
        try:
            torch.manual_seed(0)
            mine, ours_blocks = routed_blocks(name, ours, inputs, lambda: run(name, ours, inputs))
        finally:
            handle.remove()
    theirs.set_router(replaying_router(module, list(chosen), counts, REPLAY[name]), routes)
    try:
        other, their_blocks = routed_blocks(name, theirs, inputs, lambda: run(name, theirs, inputs))
        error = None
    except Exception as err:  # SimpleTuner's own failure on this layout is a finding, not ours
        other, their_blocks, error = None, None, f"{type(err).__name__}: {str(err).splitlines()[0][:120]}"
    finally:
        theirs.set_router(None, [])
    return dict(ours=mine, theirs=other, error=error, counts=counts, blocks=(ours_blocks, their_blocks))


def compare_sequence_family(name: str, code_dir, layouts: dict = LAYOUTS, padded_text: bool = False) -> dict:
    """Every layout for Ernie or MiniMax H3 (with `padded_text`, Ernie's padded text too, where SimpleTuner attends
    the padding while routed): max abs differences against the tolerance (ten times the unrouted difference, at
    least 1e-6), both sides' kept counts (theirs, ours: theirs takes the ratio of the whole sequence) and routed
    blocks."""
    module = import_simpletuner(code_dir, source_file(FAMILIES[name][0]))
    ours, theirs, inputs, dropped = build_pair(name, module)
    base = difference(run(name, ours.train(), inputs), run(name, theirs.train(), inputs))
    tolerance = tuple(max(10 * d, 1e-6) for d in base)
    cases = {label: (routes, inputs) for label, routes in layouts.items()}
    if name == "ernie" and padded_text:  # the second sample's last three text tokens padding: a mask in the attention
        padded = dict(inputs, text_lens=torch.tensor([inputs["text_bth"].shape[1], 3] + [3] * (B - 2)))
        cases["across lists 1..2, padded text"] = (layouts["across lists 1..2"], padded)
    rows = []
    for label, (routes, case_inputs) in cases.items():
        result = compare_layout(name, ours, theirs, module, case_inputs, routes)
        diff = None if result["error"] else difference(result["ours"], result["theirs"])
        rows.append(dict(layout=label, diff=diff, error=result["error"], counts=result["counts"],
                         blocks=result["blocks"],
                         same=result["error"] is None and diff[0] <= tolerance[0] and diff[1] <= tolerance[1]
                         and result["blocks"][0] == result["blocks"][1]))
    return dict(family=name, baseline=base, tolerance=tolerance, dropped=dropped, rows=rows,
                file=f"simpletuner/helpers/models/{source_file(FAMILIES[name][0])}.py")
