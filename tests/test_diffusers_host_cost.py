"""What a routed diffusers step costs the host, beside the unrouted step: the per-token inputs (RoPE tables,
masks) cut once per route and block kind in a forward, reused by the other blocks and by the recomputations
in backward; and one read of the GPU's values per forward (FLUX's reference-token count), not one per check.
Either would make a routed step on a GPU wait for the host."""
import contextlib
import dataclasses

import pytest
import torch

pytest.importorskip("diffusers")
from diffusers_tiny import build  # noqa: E402
from tread_diffusers import apply_tread  # noqa: E402

ROUTE = {"routes": [{"selection_ratio": 0.5, "start_layer_idx": 1, "end_layer_idx": -2}]}


@pytest.mark.parametrize("checkpointing", [False, True])
def test_per_token_inputs_are_cut_once_per_block_kind(checkpointing):
    model, inputs, _ = build("flux", layers=3, single_layers=6)  # the route: 2 dual-stream and 5 single-stream
    if checkpointing:
        model.enable_gradient_checkpointing()
    model.train()
    handle = apply_tread(model, ROUTE)
    cuts = []
    family = handle.family
    handle.family = dataclasses.replace(family, narrow=lambda kw, keep: cuts.append(1) or family.narrow(kw, keep))
    model(**inputs)[0].square().mean().backward()
    assert len(cuts) == 2  # a dual-stream and a single-stream cut; before: one per routed block and recomputation
    torch.manual_seed(0)
    first = model(**inputs)[0]
    handle.family = family
    handle._narrowed.clear()  # cut in every block, as before
    torch.manual_seed(0)
    assert torch.equal(model(**inputs)[0], first)


@contextlib.contextmanager
def device_reads(seen: list):
    """Counts the tensor methods that copy a value to the host (each one waits for the GPU there)."""
    names = ("item", "tolist", "__int__", "__bool__", "__index__", "__float__")
    saved = {name: getattr(torch.Tensor, name) for name in names}

    def counting(name):
        def method(self, *args, **kwargs):
            seen.append(name)
            return saved[name](self, *args, **kwargs)
        return method
    for name in names:
        setattr(torch.Tensor, name, counting(name))
    try:
        yield
    finally:
        for name in names:
            setattr(torch.Tensor, name, saved[name])


def test_a_routed_flux_forward_reads_the_device_once():
    model, inputs, _ = build("flux", layers=3, single_layers=6)
    model.train()
    unrouted, routed = [], []
    with device_reads(unrouted):
        model(**inputs)
    apply_tread(model, ROUTE)
    with device_reads(routed):
        model(**inputs)
    assert len(routed) - len(unrouted) == 1, routed  # img_ids' reference-token count, checked as it is read
