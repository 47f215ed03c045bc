"""Parity with SimpleTuner's TREAD (lab/simpletuner_parity.py, lab/simpletuner_models.py): its router's kept counts,
and its own transformer files fed the same kept tokens as apply_tread; runs when TREAD_SIMPLETUNER names a
SimpleTuner checkout or installed package."""
import os

import pytest

from lab.simpletuner_families import CAUSES, FAMILIES, WHY_IT_DIFFERS, WHY_IT_FAILS
from lab.simpletuner_joint import SEQUENCE_FAMILIES
from lab.simpletuner_parity import RATIOS, TOKENS, compare, load_router, main

SIMPLETUNER = os.environ.get("TREAD_SIMPLETUNER")
needs_simpletuner = pytest.mark.skipif(not SIMPLETUNER, reason="set TREAD_SIMPLETUNER=<SimpleTuner checkout>")


@needs_simpletuner
def test_simpletuner_kept_counts_match_theirs_with_and_without_force_keep():
    router_cls, _ = load_router(SIMPLETUNER)
    result = compare(router_cls)
    assert len(result["rows"]) == len(TOKENS) * len(RATIOS)
    bad = [r for r in result["rows"] if r["simpletuner"] != r["ours"] or r["simpletuner_forced"] != r["ours_forced"]]
    assert not bad and result["same"], bad[:3]
    assert result["authors_differ"] > 0  # the option matters: the default count is not theirs


@needs_simpletuner
@pytest.mark.parametrize("name", [name for name in FAMILIES if name not in SEQUENCE_FAMILIES])  # those: their tests
def test_simpletuner_transformer_gives_our_outputs_and_gradients_on_the_same_kept_tokens(name):
    """Every layout routes the same blocks on our side; where SimpleTuner runs, its values equal ours within the
    unrouted tolerance, unless its file is listed with the causes (WHY_IT_DIFFERS), which its CAUSES rows remove;
    where it fails, its failure is listed (WHY_IT_FAILS)."""
    from lab.simpletuner_models import LAYOUTS, compare_family

    result = compare_family(name, SIMPLETUNER)
    rows = {r["layout"]: r for r in result["rows"]}
    for layout in LAYOUTS:
        assert rows[layout]["blocks"][0], rows[layout]
    assert rows["two routes 0..0, 2..3"]["blocks"][0] == [0, 2, 3]
    assert rows["negative -3..-2"]["blocks"][0] == [1, 2]
    for row in result["rows"]:
        if row["error"]:
            assert name in WHY_IT_FAILS, row
        elif not row["same"]:
            assert name in WHY_IT_DIFFERS and row["blocks"][0] == row["blocks"][1], row
    if name in CAUSES:  # every cause removed: the same values
        assert rows[f"across lists 1..2, {list(CAUSES[name])[-1]}"]["same"]
        assert not rows["across lists 1..2"]["same"]
    if name not in WHY_IT_FAILS and name not in WHY_IT_DIFFERS:
        assert all(r["same"] for r in result["rows"])
    if name == "flux":  # per-sample masks: the same where SimpleTuner runs; it fails starting in a single block
        assert rows["across lists 1..2, per-sample mask"]["same"] and rows["first list 0..1, per-sample mask"]["same"]
        assert rows["second list 2..3, per-sample mask"]["error"] and rows["second list 2..3, per-sample mask"][
            "blocks"][0] == [2, 3]
        kontext = rows["across lists 1..2, Kontext"]  # its own count is over target and references; ours target only
        assert kontext["same"] and kontext["counts"][0][0] != kontext["counts"][0][1]
        assert kontext["counts"][0][2] > 0  # its own choice drops reference tokens; we never route them
        assert rows["across lists 1..2, Kontext, target mask"]["error"]  # its mask covers the target only
        assert rows["across lists 1..2, Kontext, mask padded"]["same"]
    if name == "wan":  # per-token timesteps: SimpleTuner fails, we route
        assert rows["across lists 1..2, per-token timesteps"]["error"]
        assert rows["across lists 1..2, per-token timesteps"]["blocks"][0] == [1, 2]


@needs_simpletuner
def test_simpletuner_mask_images_give_our_tokens_under_the_flux_rule_and_differ_under_wans():
    """Their model_predict run on the same masks: token-identical for FLUX, Chroma and FLUX.2 ('half'; a [0, 1]
    image handed to them as it is gives our 'any'); Wan's trilinear rule differs on thin lines."""
    from lab.simpletuner_masks import compare_masks

    rows = [r for r in compare_masks(SIMPLETUNER) if not r["error"]]
    flux_like = [r for r in rows if r["family"] != "wan"]
    assert len(flux_like) >= 48 and all(r["differ"] == 0 for r in flux_like)
    assert any(r["ours"] > 0 for r in flux_like) and any(r["ours"] == 0 and r["mask"] == "line 3px" for r in rows)
    wan = {(r["mask"], r["form"]): r for r in rows if r["family"] == "wan"}
    assert wan[("disc r=40px", "[-1, 1], 3 channels")]["differ"] == 0
    assert wan[("line 3px", "[-1, 1], 3 channels")]["differ"] > 0


@needs_simpletuner
def test_simpletuner_config_strings_route_the_same_blocks_and_we_refuse_what_they_ignore():
    from lab.simpletuner_models import compare_configs

    rows = compare_configs(SIMPLETUNER)
    accepted = [r for r in rows if not isinstance(r["ours"], str)]
    assert len(accepted) == 2 and all(r["ours"] == r["theirs"] and r["ours"] for r in accepted)
    refused = [r for r in rows if isinstance(r["ours"], str)]  # a float index, a boolean ratio: they route nothing
    assert len(refused) == 2 and all(r["theirs"] == [] and r["ours"].startswith("refused: route 0") for r in refused)


def test_a_missing_simpletuner_directory_is_refused_in_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--simpletuner", str(tmp_path)])
    assert exit_info.value.code != 0
    err = capsys.readouterr().err.strip()
    assert "no simpletuner/helpers/training/tread.py" in err and "\n" not in err


def test_an_unknown_family_is_refused_in_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--simpletuner", str(tmp_path), "--families", "flux,sdxl"])
    assert exit_info.value.code != 0
    err = capsys.readouterr().err.strip()
    assert "--families sdxl: unknown" in err and "\n" not in err
