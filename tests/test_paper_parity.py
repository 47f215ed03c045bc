"""Parity with the authors' code: one training step (loss, gradients, AdamW, EMA), the routed forward and EDM
sampling.

Needs a clone of https://github.com/CompVis/tread outside this repo:
    TREAD_PAPER_CODE=../tread python -m pytest tests/test_paper_parity.py
"""
import os

import pytest

from lab.paper_parity import (TOLERANCE, failures, routed_forward_parity, sampler_parity, saved_for_backward,
                              training_step_parity)

PAPER_CODE = os.environ.get("TREAD_PAPER_CODE")
pytestmark = pytest.mark.skipif(not PAPER_CODE, reason="set TREAD_PAPER_CODE=<clone of CompVis/tread>")


@pytest.mark.parametrize("routed", [False, True], ids=["dit", "tread"])
def test_one_training_step_matches_the_paper_code(routed):
    row = {"backbone": "DiT-S/2", "model": "tread" if routed else "dit",
           **training_step_parity(PAPER_CODE, "DiT-S/2", routed)}
    assert not failures([row]), row
    assert {"loss", "grad", "params_after_adamw", "ema_after_update"} <= set(row)
    assert row["kept_token_draws"] == ([1, 1] if routed else [0, 0]), "both routed, with the same kept tokens"


def test_routed_forward_matches_the_paper_code():
    """Same weights and kept tokens: the same output in training mode and with routing forced at inference,
    and that output is not the dense one (each side drew kept tokens once per routed forward)."""
    row = {"backbone": "DiT-S/2", "model": "tread forward", **routed_forward_parity(PAPER_CODE, "DiT-S/2")}
    assert not failures([row]), row
    assert {"routed_train_forward", "routed_forced_forward"} <= set(row) <= set(TOLERANCE) | {
        "backbone", "model", "routing_effect", "kept_token_draws"}
    assert row["kept_token_draws"] == [2, 2] and row["routing_effect"] > 1e-3, row


def test_edm_sampler_matches_the_paper_code():
    row = {"backbone": "DiT-S/2", "model": "sampler", **sampler_parity(PAPER_CODE, "DiT-S/2")}
    assert not failures([row]), row


def test_compiled_per_block_our_step_keeps_what_theirs_keeps():
    """train.compile_scope=blocks against their published @torch.compile (inductor, bf16 on the CPU): the forward
    keeps as many tensors, of as many bytes, for backward (their final layer is compiled too)."""
    row = saved_for_backward(PAPER_CODE, "DiT-S/2")
    assert row["saved_tensors"][0] == row["saved_tensors"][1] and row["saved_bytes_over_theirs"] <= 0, row
