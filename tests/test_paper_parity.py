"""Parity with the authors' code: one training step (loss, gradients, AdamW, EMA) and EDM sampling.

Needs a clone of https://github.com/CompVis/tread outside this repo:
    TREAD_PAPER_CODE=../tread python -m pytest tests/test_paper_parity.py
"""
import os

import pytest

from tools.paper_parity import TOLERANCE, failures, sampler_parity, training_step_parity

PAPER_CODE = os.environ.get("TREAD_PAPER_CODE")
pytestmark = pytest.mark.skipif(not PAPER_CODE, reason="set TREAD_PAPER_CODE=<clone of CompVis/tread>")


@pytest.mark.parametrize("routed", [False, True], ids=["dit", "tread"])
def test_one_training_step_matches_the_paper_code(routed):
    row = {"backbone": "DiT-S/2", "model": "tread" if routed else "dit",
           **training_step_parity(PAPER_CODE, "DiT-S/2", routed)}
    assert not failures([row]), row
    assert set(TOLERANCE) - {"samples"} <= set(row)


def test_edm_sampler_matches_the_paper_code():
    row = {"backbone": "DiT-S/2", "model": "sampler", **sampler_parity(PAPER_CODE, "DiT-S/2")}
    assert not failures([row]), row
