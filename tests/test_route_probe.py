"""The route probe (tools/route_probe.py) on tiny models: a DiT exported folder trained for nothing (random
weights, the digits at 8 x 8) and a tiny FLUX-architecture transformer built from its config."""
import json
import statistics
import subprocess
import sys

import pytest
import torch
from omegaconf import OmegaConf

from data import build_dataset
from dit import DiT, get_model
from tools.diffusers_toy import random_flux
from tools.route_probe import main
from tools.route_probe_measure import Candidate, default_candidates
from tools.route_probe_report import annotate, pareto_front, suggest, suggestion_line
from training.checkpoint import build_objective, save_checkpoint
from training.exported import write_export
from tread_utils.errors import report_user_errors

RUN_CFG = {"model": {"backbone_type": "DiT-T/4",
                     "params": {"depth": 6, "hidden_size": 32, "num_heads": 2, "input_size": 8, "in_channels": 1,
                                "num_classes": 10, "enable_routing": False, "routes": []}},
           "diffuser": {"name": "edm", "P_mean": -1.2, "P_std": 1.2, "sigma_data": 0.64},
           "dataset": {"name": "digits", "kind": "digits", "in_channels": 1, "input_size": 8, "num_classes": 10},
           "train": {"general": {"class_drop_prob": 0.1}}}
SMALL = ["--batches", "2", "--batch-size", "8"]


@pytest.fixture(scope="module")
def dit_folder(tmp_path_factory):
    torch.manual_seed(0)
    model = get_model(RUN_CFG["model"]["backbone_type"], RUN_CFG["model"]["params"])
    return write_export(model, RUN_CFG, 0, tmp_path_factory.mktemp("probe") / "tiny")


def train_tiny(root, routes, steps=40):
    """A tiny DiT (16 tokens) trained `steps` steps on the 8 x 8 digits in-process, with `routes` in training,
    saved as train.py saves a run (root/run/checkpoints/ckpt_*.pt with its config) and exported (root/exported)."""
    cfg = json.loads(json.dumps(RUN_CFG))
    cfg["model"]["backbone_type"] = "DiT-T/2"
    cfg["model"]["params"].update(enable_routing=bool(routes), routes=routes)
    torch.manual_seed(0)
    model = get_model(cfg["model"]["backbone_type"], cfg["model"]["params"])
    net, loss_fn = build_objective(OmegaConf.create(cfg["diffuser"]), model)
    digits = build_dataset(OmegaConf.create(cfg["dataset"]), 0)
    images = torch.stack([digits[i][0] for i in range(len(digits))]).float()
    labels = torch.tensor([int(digits[i][1]) for i in range(len(digits))])
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    net.train()
    for step in range(steps):
        batch = torch.randint(len(images), (64,), generator=torch.Generator().manual_seed(step))
        loss = loss_fn(net, images[batch], labels[batch], routing_seed=step).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    state = model.state_dict()
    ckpt = save_checkpoint({"model": state, "ema": state, "step": steps, "config": cfg}, root / "run" / "checkpoints",
                           steps)
    return {"run": root / "run", "ckpt": ckpt, "exported": write_export(model, cfg, steps, root / "exported")}


TRAINED_ROUTE = {"start_layer_idx": 1, "end_layer_idx": 4, "selection_ratio": 0.5}


@pytest.fixture(scope="module")
def tread_run(tmp_path_factory):
    return train_tiny(tmp_path_factory.mktemp("tread"), [TRAINED_ROUTE])


@pytest.fixture(scope="module")
def dense_probe(tmp_path_factory):
    """A probe of a tiny DiT trained without routes, and its folder."""
    root = tmp_path_factory.mktemp("dense")
    run = train_tiny(root, [])["run"]
    return main([str(run), "--out", str(root / "probe"), "--routes", "1:3:0.75,4:4:0.25,2:3:0.5,0:1:0",
                 "--batches", "2", "--batch-size", "32"]), root / "probe"


@pytest.fixture(scope="module")
def flux_inputs(tmp_path_factory):
    """A config-only FLUX folder (random weights at probe time) and its inputs: 16 packed tokens per sample."""
    root = tmp_path_factory.mktemp("flux")
    random_flux(1, 32, 2, 1, 2, 16).save_config(root / "transformer")
    g = torch.Generator().manual_seed(0)
    torch.save({"latents": torch.randn(8, 16, 4, generator=g), "text": torch.randn(8, 5, 16, generator=g),
                "pooled": torch.randn(8, 16, generator=g)}, root / "inputs.pt")
    return root


def probe(folder, out, *extra):
    return main([str(folder), "--out", str(out), *SMALL, *extra])


def by_route(result):
    return {r["route"]: r for r in result["routes"]}


def test_ratio_zero_has_exactly_zero_damage(dit_folder, tmp_path):
    rows = by_route(probe(dit_folder, tmp_path, "--routes", "1:3:0,0:4:0,1:3:0.5", "--time-steps", "1"))
    for name in ("1->3 @ 0", "0->4 @ 0"):
        assert rows[name]["damage"] == 0.0 and rows[name]["damage_ci"] == [0.0, 0.0]
        assert rows[name]["flop_speedup_bound"] == 1.0 and rows[name]["activation_memory_fraction"] == 1.0
    assert rows["1->3 @ 0.5"]["damage"] != 0.0  # a route that drops tokens changes the loss
    assert rows["1->3 @ 0.5"]["flop_speedup_bound"] > 1.0
    assert all(r["step_ms"] > 0 and r["unrouted_step_ms"] > 0 and r["measured_speedup"] > 0 for r in rows.values())
    assert "| measured speed-up |" in (tmp_path / "probe.md").read_text()


def test_flux_ratio_zero_has_exactly_zero_damage(flux_inputs, tmp_path):
    result = main([str(flux_inputs / "transformer"), "--data", str(flux_inputs / "inputs.pt"), "--out", str(tmp_path),
                   "--batches", "2", "--batch-size", "4", "--routes", "0:1:0,1:2:0.5", "--time-steps", "1"])
    rows = by_route(result)
    assert result["depth"] == 3 and len(result["block_similarity"]) == 3
    assert rows["0->1 @ 0"]["damage"] == 0.0 and rows["0->1 @ 0"]["flop_speedup_bound"] == 1.0
    assert rows["1->2 @ 0.5"]["damage"] != 0.0 and rows["1->2 @ 0.5"]["flop_speedup_bound"] > 1.0
    assert 0 < rows["1->2 @ 0.5"]["activation_memory_fraction"] < 1
    assert rows["1->2 @ 0.5"]["step_ms"] > 0 and rows["1->2 @ 0.5"]["measured_speedup"] > 0


def test_deterministic_for_a_seed(dit_folder, tmp_path):
    routes = ["--routes", "1:3:0.5,0:2:0.25"]
    first = probe(dit_folder, tmp_path / "a", *routes)
    again = probe(dit_folder, tmp_path / "b", *routes)
    other = probe(dit_folder, tmp_path / "c", *routes, "--seed", "1")
    keys = ("loss", "damage", "damage_ci", "flop_speedup_bound")
    assert [[r[k] for k in keys] for r in first["routes"]] == [[r[k] for k in keys] for r in again["routes"]]
    assert first["block_similarity"] == again["block_similarity"]
    assert first["routes"][0]["damage"] != other["routes"][0]["damage"]
    saved = json.loads((tmp_path / "a" / "probe.json").read_text())
    assert saved["routes"] == first["routes"] and (tmp_path / "a" / "probe.png").stat().st_size > 0


def test_suggestion_meets_the_target(dit_folder, tmp_path):
    result = probe(dit_folder, tmp_path, "--target-speedup", "1.3", "--routes", "0:1:0.25,1:3:0.5,1:4:0.75,3:5:0.5,0:5:0.5")
    meeting = [r for r in result["routes"] if r["flop_speedup_bound"] >= 1.3]
    assert meeting and len(meeting) < len(result["routes"])  # the target excludes some routes
    chosen = by_route(result)[result["suggestion"]]
    assert chosen["flop_speedup_bound"] >= 1.3
    assert chosen["damage"] == min(r["damage"] for r in meeting)
    assert "Suggested route" in (tmp_path / "probe.md").read_text()
    memory = annotate(result, None, 0.7)
    assert by_route(memory)[memory["suggestion"]]["activation_memory_fraction"] <= 0.7
    assert annotate(result, 9.0)["suggestion"] is None and "No candidate meets" in suggestion_line(result)


def test_default_grid_from_the_depth():
    grid = default_candidates(12)
    assert {(c.start, c.end) for c in grid} == {(s, e) for s in (0, 2, 3) for e in (6, 8, 10)}
    assert Candidate(2, 8, 0.5) in grid and {c.ratio for c in grid} == {0.25, 0.5, 0.75}
    assert all(0 <= c.start <= c.end < 4 for c in default_candidates(4))


def test_pareto_front_and_suggestion_on_known_rows():
    rows = [{"route": "a", "flop_speedup_bound": 1.2, "damage": 0.1, "activation_memory_fraction": 0.8},
            {"route": "b", "flop_speedup_bound": 1.5, "damage": 0.3, "activation_memory_fraction": 0.6},
            {"route": "c", "flop_speedup_bound": 1.4, "damage": 0.4, "activation_memory_fraction": 0.7},
            {"route": "d", "flop_speedup_bound": 1.0, "damage": 0.0, "activation_memory_fraction": 1.0}]
    assert pareto_front(rows) == {0, 1, 3}
    assert suggest(rows, 1.3)["route"] == "b" and suggest(rows, None, 0.75)["route"] == "b"
    assert suggest(rows, 1.6) is None


@pytest.mark.parametrize("args, words", [
    (["/nonexistent/run"], "does not exist"),
    (["{dit}", "--routes", "2:8"], "START:END:RATIO"),
    (["{dit}", "--routes", "0:9:0.5"], "outside a model of depth 6"),
    (["{dit}", "--target-speedup", "0.5"], "--target-speedup"),
    (["{dit}", "--batches", "0"], "--batches"),
    (["{flux}"], "--data"),
    (["{flux}", "--data", "{inputs}", "--batch-size", "99"], "fewer than --batches x --batch-size"),
    (["{flux}", "--data", "{inputs}", "--exclude-inside-trained"], "does not record the routes"),
    (["{tread}", "--routes", "2:3:0.5,1:4:0", "--exclude-inside-trained"], "every candidate lies inside"),
])
def test_bad_arguments_give_one_line(dit_folder, flux_inputs, tread_run, tmp_path, capsys, args, words):
    args = [a.format(dit=dit_folder, flux=flux_inputs / "transformer", inputs=flux_inputs / "inputs.pt",
                     tread=tread_run["run"]) for a in args]
    with pytest.raises(SystemExit) as stop:
        report_user_errors(main)([*args, "--out", str(tmp_path / "out")])
    lines = capsys.readouterr().err.strip().splitlines()
    assert stop.value.code == 2 and len(lines) == 1 and lines[0].startswith("error:") and words in lines[0], lines
    assert not (tmp_path / "out").exists()


def test_bad_arguments_from_the_command_line(dit_folder, tmp_path):
    done = subprocess.run([sys.executable, "-m", "tools.route_probe", str(dit_folder), "--routes", "4:1:0.5",
                           "--out", str(tmp_path / "out")], capture_output=True, text=True, timeout=120)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and "comes after end block" in lines[0], done.stderr
    assert "Traceback" not in done.stderr and not (tmp_path / "out").exists()


def test_spearman_exact_permutation_p():
    from scipy import stats

    from lab.route_probe_validate import spearman_exact

    assert spearman_exact([1, 2, 3, 4, 5], [10, 20, 30, 40, 50]) == (pytest.approx(1.0), pytest.approx(2 / 120))
    x, y = [0.3, 0.1, 0.5, 0.2, 0.9, 0.4], [3.0, 1.0, 2.0, 6.0, 5.0, 4.0]
    rho, p = spearman_exact(x, y)
    assert rho == pytest.approx(stats.spearmanr(x, y)[0]) and 0.05 < p < 1


def test_docs_tables_are_the_validation_json():
    """docs/route_probe.md quotes the committed validation as printed."""
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    found = json.loads((repo / "docs/results/route_probe/validation/validation.json").read_text())
    doc = (repo / "docs/route_probe.md").read_text()
    for r in found["placement"]:
        assert f"| {r['step']} | {r['rho']:.3f} | {r['p']:.3f} | {r['rho_speedup']:.3f} | {r['p_speedup']:.3f} |" in doc
    for r in found["ratio"]:
        assert r["ratios"] == [0.25, 0.5, 0.75] and r["damage_rises"]
        assert f"| {r['step']} | " + " | ".join(f"{d:+.3f}" for d in r["damage"]) + " |" in doc
        assert "| final FID of the sweep | " + " | ".join(f"{f:.2f}" for f in r["fid"]) + " |" in doc


def test_finetune_check_runs_accumulate_in_chunks(tmp_path):
    """The fine-tuning check's runs at equal FLOPs: a route trains budget x its FLOP bound steps, runs from
    several commands (one route each) end in one table with the samples' scores, a finished run is not redone and
    other settings are refused rather than mixed in."""
    from lab import route_probe_finetune

    route_probe_finetune.main(["pretrain", "--out", str(tmp_path), "--steps", "1"])
    args = ["lora", "--model", str(tmp_path / "transformer"), "--seeds", "0", "--budget", "2", "--batch-size", "4",
            "--samples-per-class", "2", "--sample-steps", "2", "--out", str(tmp_path / "ft")]
    route_probe_finetune.main([*args, "--routes", "2:10:0.5"])
    route_probe_finetune.main([*args, "--routes", "3:8:0"])
    route_probe_finetune.main([*args, "--routes", "3:8:0"])  # resumed: already there, nothing redone
    saved = json.loads((tmp_path / "ft" / "finetune.json").read_text())
    routed, unrouted = saved["runs"]
    assert (routed["route"], unrouted["route"]) == ("2->10 @ 0.5", "3->8 @ 0") and len(saved["commands"]) == 2
    assert routed["flop_speedup_bound"] > 1.2 and routed["steps"] == round(2 * routed["flop_speedup_bound"]) > 2
    assert unrouted["flop_speedup_bound"] == 1.0 and unrouted["steps"] == 2
    assert unrouted["eval_loss_after"] != unrouted["eval_loss_before"]  # the LoRA weights moved
    for scores in (routed, unrouted, saved["before"]["pretrained"]):
        assert scores["class_accuracy"] in {k / 10 for k in range(11)} and scores["fid"] > 0  # 2 x 5 samples
    assert saved["before"]["real_train_digits"]["class_accuracy"] >= 0.9
    table = (tmp_path / "ft" / "finetune.md").read_text()
    assert "| route | speed-up bound | steps | held-out loss after | per seed | difference | p |" in table
    assert ("| model | class accuracy | per seed | difference | p | FID | per seed | difference | p |" in table
            and "| pretrained, before fine-tuning |" in table and "| real training digits (10) |" in table)
    assert sum(line.startswith("| 3->8 @ 0 |") for line in table.splitlines()) == 2  # a loss row, a samples row
    assert torch.load(tmp_path / "inputs.pt")["latents"].shape[1:] == (64, 4)
    with pytest.raises(SystemExit) as stop:
        report_user_errors(route_probe_finetune.main)([*args, "--routes", "3:8:0", "--sample-steps", "3"])
    assert stop.value.code == 2 and json.loads((tmp_path / "ft" / "finetune.json").read_text()) == saved


def test_digits_sampled_from_a_tiny_flux_are_deterministic_for_a_seed():
    from tools.diffusers_toy import FixedTextEncoder, pack
    from lab.route_probe_samples import sample_digits, unpack

    x = torch.randn(3, 1, 16, 16)
    assert torch.equal(unpack(pack(x)), x)
    model, encoder, labels = random_flux(1, 32, 2, 1, 1, 16), FixedTextEncoder(16, 16), torch.tensor([5, 7, 9])
    first = sample_digits(model, encoder, labels, 64, seed=3, steps=2, batch_size=2)
    assert first.shape == (3, 1, 16, 16) and first.abs().max() <= 1
    assert torch.equal(first, sample_digits(model, encoder, labels, 64, seed=3, steps=2, batch_size=2))
    batched = sample_digits(model, encoder, labels, 64, seed=3, steps=2)  # the noise does not depend on batching
    assert torch.allclose(first, batched, atol=1e-5)
    assert not torch.equal(first, sample_digits(model, encoder, labels, 64, seed=4, steps=2))


class TopLeftPixel(torch.nn.Module):
    """A stub classifier: reads the top-left pixel p of a uint8 image as the class p // 20."""

    def forward(self, images):
        return {"logits": torch.nn.functional.one_hot(images[:, 0, 0, 0].long() // 20, 13).float()}


def test_class_accuracy_and_fid_of_known_images():
    from data.digits import load_digits_split
    from evaluations.digits_classifier import class_accuracy, load_digits_classifier
    from lab.route_probe_samples import class_reference, score

    images = torch.zeros(4, 16, 16, 3, dtype=torch.uint8)
    images[:, 0, 0] = torch.tensor([100, 120, 140, 160])[:, None]  # classes 5, 6, 7, 8
    assert class_accuracy(images, torch.tensor([5, 6, 7, 9]), TopLeftPixel()) == 0.75
    classifier = load_digits_classifier(device="cpu")
    real, labels = load_digits_split("test", 16)
    keep = labels >= 5
    reference = class_reference(classifier, (5, 6, 7, 8, 9))
    assert reference["count"] == int(keep.sum())
    own = score(real[keep], labels[keep], classifier, reference)
    assert own["class_accuracy"] >= 0.97 and abs(own["fid"]) < 1e-2  # the reference itself: FID 0
    wrong = score(real[keep], 5 + (labels[keep] - 4) % 5, classifier, reference)  # every label another digit's
    assert wrong["class_accuracy"] <= 0.03 and wrong["fid"] == pytest.approx(own["fid"])
    assert score(real[~keep], labels[~keep], classifier, reference)["fid"] > 10  # digits 0-4 are far from 5-9


def test_docs_finetune_tables_are_the_committed_runs():
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    found = json.loads((repo / "docs/results/route_probe/finetune/finetune.json").read_text())
    runs, before = found["runs"], found["before"]
    probe = by_route(json.loads((repo / "docs/results/route_probe/finetune_probe/probe.json").read_text()))
    doc = (repo / "docs/route_probe.md").read_text()

    def spread(name, key, spec):
        values = [r[key] for r in runs if r["route"] == name]
        assert len(values) == 3
        return f"| {statistics.mean(values):{spec}} ± {statistics.stdev(values):{spec}} |"

    for name, label in (("3->8 @ 0.75", "3 -> 8 at 0.75"), ("2->10 @ 0.5", "2 -> 10 at 0.5"),
                        ("3->8 @ 0.4", "3 -> 8 at 0.4"), ("0->0 @ 0", "no routing")):
        loss, samples = [line for line in doc.splitlines() if line.startswith(f"| {label}")]
        assert spread(name, "eval_loss_after", ".4f") in loss
        if name != "0->0 @ 0":
            assert f"| {probe[name]['damage']:+.3f} |" in loss
        assert spread(name, "class_accuracy", ".3f") in samples and spread(name, "fid", ".2f") in samples
    pretrained = next(line for line in doc.splitlines() if line.startswith("| pretrained, before fine-tuning"))
    assert f"| {before['pretrained']['class_accuracy']:.3f} |" in pretrained
    assert f"| {before['pretrained']['fid']:.2f} |" in pretrained


def test_a_family_without_an_objective_is_refused_before_its_weights_load(flux_inputs, tmp_path, capsys):
    folder = tmp_path / "pixart"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"_class_name": "PixArtTransformer2DModel"}))
    (folder / "diffusion_pytorch_model.safetensors").write_bytes(b"not loaded")
    with pytest.raises(SystemExit) as stop:
        report_user_errors(main)([str(folder), "--data", str(flux_inputs / "inputs.pt"), "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err.strip()
    assert stop.value.code == 2 and "objective covers FluxTransformer2DModel, SD3Transformer2DModel" in err, err


def test_damage_is_the_routed_minus_the_unrouted_loss_row_by_row(dense_probe):
    result, _ = dense_probe
    for row in result["routes"]:
        rise = row["loss"] - result["unrouted_loss"]
        assert row["damage"] == pytest.approx(rise, abs=1e-6), row["route"]
        assert row["damage_ci"][0] <= rise <= row["damage_ci"][1], row["route"]


def test_a_heavy_route_damages_a_trained_model(dense_probe):
    result, _ = dense_probe
    heavy = by_route(result)["1->3 @ 0.75"]
    assert heavy["damage"] > 0 and heavy["damage_ci"][0] > 0 and heavy["relative_damage"] > 0


def test_a_run_trained_without_routes_says_so(dense_probe):
    result, folder = dense_probe
    assert result["trained_routes"]["routes"] == [] and "inside_trained_route" in result["routes"][0]
    assert "Trained routes: none (the run config in" in (folder / "probe.md").read_text()


@pytest.mark.parametrize("source", ["run", "ckpt", "exported"])
def test_the_trained_routes_are_recorded_and_qualify_the_suggestion(tread_run, tmp_path, source):
    result = probe(tread_run[source], tmp_path, "--routes", "2:3:0.5,0:5:0.75")
    trained = result["trained_routes"]
    assert trained["routes"] == [{"route": "1->4 @ 0.5", "start": 1, "end": 4, "ratio": 0.5}]
    assert str(tread_run[source]) in trained["source"]
    rows = by_route(result)
    assert rows["2->3 @ 0.5"]["inside_trained_route"] == "1->4 @ 0.5"
    assert rows["0->5 @ 0.75"]["inside_trained_route"] is None
    assert json.loads((tmp_path / "probe.json").read_text())["trained_routes"] == trained
    doc = (tmp_path / "probe.md").read_text()
    assert "Trained routes: 1->4 @ 0.5" in doc and "The 1 candidate(s) inside it show the damage" in doc
    assert result["suggestion"] == "2->3 @ 0.5"
    assert "It lies inside the trained route 1->4 @ 0.5" in suggestion_line(result)
    assert "| inside trained route |" in doc and "| 1->4 @ 0.5 |" in doc


def test_candidates_inside_the_trained_route_can_be_left_out(tread_run, tmp_path):
    result = probe(tread_run["run"], tmp_path, "--routes", "2:3:0.5,1:4:0.25,0:5:0.5,3:5:0.25",
                   "--exclude-inside-trained")
    assert [r["route"] for r in result["routes"]] == ["0->5 @ 0.5", "3->5 @ 0.25"]
    assert result["excluded_inside_trained"] == ["2->3 @ 0.5", "1->4 @ 0.25"]
    doc = (tmp_path / "probe.md").read_text()
    assert "The 2 candidate(s) inside it were left out (--exclude-inside-trained)" in doc
    assert "lies inside" not in suggestion_line(result)


def test_an_exported_folder_that_cannot_tell_says_unknown(dit_folder, tread_run, tmp_path, capsys):
    assert probe(dit_folder, tmp_path / "dense", "--routes", "1:3:0.5")["trained_routes"]["routes"] == []
    DiT.from_pretrained(tread_run["exported"], routes=[], enable_routing=False).save_pretrained(tmp_path / "plain")
    result = probe(tmp_path / "plain", tmp_path / "out", "--routes", "1:3:0.5")
    assert result["trained_routes"]["routes"] is None
    assert "re-saved with routes=[]" in result["trained_routes"]["source"]
    doc = (tmp_path / "out" / "probe.md").read_text()
    assert "Trained routes: unknown" in doc and "The trained routes are unknown" in doc
    capsys.readouterr()
    with pytest.raises(SystemExit) as stop:
        report_user_errors(main)([str(tmp_path / "plain"), "--out", str(tmp_path / "no"), "--exclude-inside-trained"])
    err = capsys.readouterr().err.strip()
    assert stop.value.code == 2 and "trained with are unknown" in err and "\n" not in err
    assert not (tmp_path / "no").exists()
