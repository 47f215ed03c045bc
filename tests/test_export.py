"""Exported models (tools/export.py): safetensors + config.json, loaded by DiT.from_pretrained, sample.py and
init_from exactly as the run they came from, and refused in one line when config and weights disagree."""
import json
import os
import pickle
import shutil

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

import generation
import sample
from conftest import REPO, tiny_overrides
from data.decoders import IdentityDecoder
from dit import DiT, get_model
from tools import export
from training.checkpoint import load_checkpoint, load_model_state, load_sampling_net, save_checkpoint
from tread_utils.errors import UserError


def run_config(model):
    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base="1.3"):
        cfg = compose("config", overrides=tiny_overrides(model))
    return OmegaConf.to_container(cfg, resolve=True)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A run directory with one checkpoint of a tiny TREAD model whose model and EMA weights differ."""
    root = tmp_path_factory.mktemp("export_run")
    cfg = run_config("tread")
    torch.manual_seed(0)
    model = get_model(cfg["model"]["backbone_type"], cfg["model"]["params"])
    ema = {k: v + 0.01 * torch.randn_like(v) for k, v in model.state_dict().items()}
    save_checkpoint({"model": model.state_dict(), "ema": ema, "step": 7, "config": cfg, "optimizer": {}},
                    root / "checkpoints", 7)
    return root


@pytest.fixture(scope="module")
def exported(run, tmp_path_factory):
    out = tmp_path_factory.mktemp("exported") / "tiny"
    export.main([str(run), "--out", str(out)])
    return out


def samples(source, seeds=(0, 1, 2, 5)):
    net, _ = load_sampling_net(source)
    return generation.generate(net, list(seeds), sampler_kwargs={**generation.DEFAULT_SAMPLER, "num_steps": 4},
                               decoder=IdentityDecoder(), batch_size=2, device="cpu", progress=False)


def test_the_folder_holds_safetensors_and_the_whole_config(exported, run):
    assert sorted(p.name for p in exported.iterdir()) == ["README.md", "config.json", "model.safetensors"]
    umask = os.umask(0)
    os.umask(umask)
    assert {p.stat().st_mode & 0o777 for p in exported.iterdir()} == {0o666 & ~umask}  # readable as shared files
    config = json.loads((exported / "config.json").read_text())
    tread = config["tread"]
    source = load_checkpoint(next((run / "checkpoints").glob("ckpt_*.pt")))["config"]
    assert tread["backbone_type"] == source["model"]["backbone_type"] and tread["step"] == 7
    assert tread["diffuser"]["sigma_data"] == source["diffuser"]["sigma_data"]
    assert tread["data"]["shape"] == [source["dataset"]["in_channels"], source["dataset"]["input_size"],
                                      source["dataset"]["input_size"]]
    assert config["routes"] == [dict(r) for r in source["model"]["params"]["routes"]] and config["enable_routing"]
    assert config["hidden_size"] == 32 and config["depth"] == 4


def test_export_then_load_gives_identical_samples(exported, run, tmp_path):
    images, labels = samples(run)
    images_exported, labels_exported = samples(exported)
    assert np.array_equal(images, images_exported) and np.array_equal(labels, labels_exported)
    assert images.std() > 0
    # sample.py ckpt=DIR, through the same loader, writes the same file as ckpt=RUN
    for name, source in (("run", run), ("exported", exported)):
        sample.main([f"ckpt={source}", "seeds=0-3", f"out={tmp_path / name}.npz", "sampler.num_steps=4",
                     "progress=false"])
    with np.load(tmp_path / "run.npz") as a, np.load(tmp_path / "exported.npz") as b:
        assert np.array_equal(a["arr_0"], b["arr_0"]) and np.array_equal(a["arr_1"], b["arr_1"])


def test_from_pretrained_routed_or_unrouted(exported, run):
    ema = load_checkpoint(next((run / "checkpoints").glob("ckpt_*.pt")))["ema"]
    routed = DiT.from_pretrained(exported)
    unrouted = DiT.from_pretrained(exported, routes=[], enable_routing=False)
    assert len(routed.router.routes) == 1 and routed.router.enable_routing
    assert len(unrouted.router.routes) == 0 and not unrouted.router.enable_routing
    for model in (routed, unrouted):
        assert not model.training and all(torch.equal(v, ema[k]) for k, v in model.state_dict().items())
    x, t, y = torch.randn(2, 1, 16, 16), torch.tensor([0.3, 1.2]), torch.tensor([1, 4])
    with torch.no_grad():
        assert torch.equal(routed(x, t, y), unrouted(x, t, y))  # eval: every token through every block
        routed.train()
        assert not torch.equal(routed(x, t, y, routing_seed=0), unrouted(x, t, y))  # training: tokens routed
    # init_from=DIR into a model=dit run: the EMA weights load into the unrouted backbone
    plain = run_config("dit")["model"]
    state = load_checkpoint(exported)
    target = get_model(plain["backbone_type"], plain["params"])
    load_model_state(target, state["model"], exported)
    assert all(torch.equal(v, ema[k]) for k, v in target.state_dict().items())
    with pytest.raises(UserError, match="no optimizer state") as info:
        state["optimizer"]
    assert "\n" not in str(info.value)


def test_save_pretrained_round_trip(tmp_path):
    torch.manual_seed(1)
    model = get_model("DiT-T/4", {"input_size": 16, "in_channels": 1, "num_classes": 3, "depth": 2})
    model.save_pretrained(tmp_path / "m")
    loaded = DiT.from_pretrained(tmp_path / "m")
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in loaded.state_dict().items())


def test_from_pretrained_then_save_pretrained_keeps_the_whole_config(exported, tmp_path):
    """What push_to_hub uploads: the same config.json, sampling information included."""
    DiT.from_pretrained(exported).save_pretrained(tmp_path / "again")
    assert json.loads((tmp_path / "again" / "config.json").read_text()) == json.loads((exported / "config.json").read_text())
    assert (tmp_path / "again" / "model.safetensors").read_bytes() == (exported / "model.safetensors").read_bytes()
    DiT.from_pretrained(exported, routes=[], enable_routing=False).save_pretrained(tmp_path / "plain")
    plain = json.loads((tmp_path / "plain" / "config.json").read_text())
    assert plain["routes"] == [] and not plain["enable_routing"] and plain["tread"]["step"] == 7


def test_a_config_that_does_not_match_its_weights_is_refused(exported, tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "model.safetensors").write_bytes((exported / "model.safetensors").read_bytes())
    config = json.loads((exported / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**config, "hidden_size": 64, "num_heads": 2}))
    for load in (lambda: load_sampling_net(bad), lambda: DiT.from_pretrained(bad)):
        with pytest.raises(UserError, match="does not match its model.safetensors") as info:
            load()
        assert "\n" not in str(info.value) and "has shape" in str(info.value)
    (bad / "config.json").write_text(json.dumps({**config, "depth": 3}))
    with pytest.raises(UserError, match=r"does not match its model.safetensors \(missing \[\], unexpected"):
        load_sampling_net(bad)
    (bad / "model.safetensors").write_bytes(b"\x00" * 16)
    with pytest.raises(UserError, match="cannot be read as safetensors"):
        DiT.from_pretrained(bad)


def test_nothing_pickled_is_loaded_from_an_exported_folder(exported, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("an exported folder must not be unpickled")

    for module, name in ((torch, "load"), (pickle, "load"), (pickle, "loads")):
        monkeypatch.setattr(module, name, refuse)
    net, config = load_sampling_net(exported)
    assert config["model"]["params"]["hidden_size"] == 32 and net.sigma_data == config["diffuser"]["sigma_data"]
    DiT.from_pretrained(exported)
    load_checkpoint(exported)


def test_hub_id_without_network_is_one_line(tmp_path):
    with pytest.raises(UserError, match="hf download nobody/no-such-tread-model") as info:
        DiT.from_pretrained("nobody/no-such-tread-model", local_files_only=True, cache_dir=tmp_path)
    assert "\n" not in str(info.value)


def test_export_cli_errors_are_one_line(run, tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("x")
    for args, needle in (([str(run), "--out", str(tmp_path / "file")], "is a file"),
                         ([str(run), "--out", str(tmp_path / "busy")], "holds other files"),
                         ([str(tmp_path / "nothing"), "--out", str(tmp_path / "o")], "does not exist")):
        with pytest.raises(SystemExit) as info:
            export.main(args)
        assert info.value.code == 2
        err = capsys.readouterr().err.strip()
        assert needle in err and "\n" not in err


def test_the_model_card_says_what_the_model_is_and_how_to_use_it(exported):
    card = (exported / "README.md").read_text()
    assert "More Information Needed" not in card
    for needle in ("DiT-D/4 (tread-digits, step 7)", "depth 4, width 32, 2 heads", "trained for 7 steps with TREAD "
                   "token routing (0.5 of the tokens skip blocks 1 to 2", "sigma_data 0.64",
                   "python sample.py ckpt=MODEL_DIR", "init_from=MODEL_DIR", "library_name: tread"):
        assert needle in card, needle


def test_export_never_replaces_another_model_or_another_runs_export(run, exported, tmp_path, capsys):
    """--out holding another model's files, or another run's export, is refused with its files unchanged; the
    same run's export is replaced (a newer step), another run's with --replace."""
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    for name, text in (("config.json", '{"_class_name": "UNet2DModel"}'), ("model.safetensors", "x"),
                       ("README.md", "their card")):
        (foreign / name).write_text(text)
    other = tmp_path / "other"
    shutil.copytree(exported, other)
    config = json.loads((other / "config.json").read_text())
    config["tread"]["run_name"] = "another-run"
    (other / "config.json").write_text(json.dumps(config))
    for out, needle in ((foreign, "holds another model"),
                        (other, "holds an export of run 'another-run' (step 7), not of 'tread-digits'")):
        before = {p.name: p.read_bytes() for p in out.iterdir()}
        with pytest.raises(SystemExit) as info:
            export.main([str(run), "--out", str(out)])
        err = capsys.readouterr().err.strip()
        assert info.value.code == 2 and needle in err and "\n" not in err
        assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    export.main([str(run), "--out", str(other), "--replace"])
    again = tmp_path / "again"
    shutil.copytree(exported, again)
    export.main([str(run), "--out", str(again)])  # the same run: replaced without a flag
    assert json.loads((other / "config.json").read_text())["tread"]["run_name"] == "tread-digits"


def test_config_json_values_are_checked_by_one_rule_for_every_loader(exported, tmp_path):
    """A string where an integer belongs, or an unknown key, in an exported config.json: the same one line from
    DiT.from_pretrained and from the loaders of sample.py and init_from, naming the key and the file."""
    config = json.loads((exported / "config.json").read_text())
    for change, needle in (({"depth": "4"}, "depth in {}/config.json must be an integer, got '4'"),
                           ({"qk_norm": 1}, "qk_norm in {}/config.json must be true or false"),
                           ({"dropout": 0.1}, "unknown {}/config.json key(s) ['dropout']")):
        bad = tmp_path / f"bad{len(change)}{next(iter(change))}"
        shutil.copytree(exported, bad)
        (bad / "config.json").write_text(json.dumps({**config, **change}))
        for load in (lambda: DiT.from_pretrained(bad), lambda: load_sampling_net(bad), lambda: load_checkpoint(bad)):
            with pytest.raises(UserError) as info:
                load()
            assert needle.format(bad) in str(info.value) and "\n" not in str(info.value)


def test_a_missing_local_folder_is_said_at_once_not_looked_up_on_the_hub(exported, monkeypatch):
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", lambda *a, **k: pytest.fail("no Hub lookup"))
    typo = exported.parent / (exported.name + "-typo")
    for name in (str(typo), "./no-such-folder", "~/no-such-folder-here"):
        with pytest.raises(UserError, match="no such folder") as info:
            DiT.from_pretrained(name)
        assert "\n" not in str(info.value)
    with pytest.raises(UserError, match=f"holds: .*{exported.name}"):
        DiT.from_pretrained(typo)
