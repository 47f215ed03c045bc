"""The VAE that decodes latents: the one the user names, else manifest.json's, else ft-EMA; one line says
which, and a VAE that cannot be had offline, or makes latents of another channel count, is one error line
naming the calling command's option."""
import json
import time

import pytest

from data.latent_vae import decoding_vae
from tread_utils.errors import UserError


def vae_folder(path, channels=4):
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"latent_channels": channels}))
    return path


@pytest.fixture
def shards(tmp_path):
    data = tmp_path / "latents"
    data.mkdir()
    made = vae_folder(tmp_path / "made")
    (data / "manifest.json").write_text(json.dumps({"vae": str(made)}))
    return {"kind": "shards", "train_path": str(data), "in_channels": 4, "vae": None}, made


def test_the_manifest_vae_decodes_by_default(shards):
    cfg, made = shards
    vae, note = decoding_vae(cfg)
    assert vae == str(made) and note.startswith(f"decoding with VAE {made}, which made the latents")


def test_a_named_vae_wins_and_the_line_names_both(shards, tmp_path):
    cfg, made = shards
    other = vae_folder(tmp_path / "copy")
    vae, note = decoding_vae(cfg, given=str(other), option="vae")
    assert vae == str(other) and "(vae)" in note and f"manifest.json names {made}" in note
    vae, note = decoding_vae({**cfg, "vae": str(other)}, option="vae")
    assert vae == str(other) and "the run's dataset.vae" in note


def test_no_manifest_means_ft_ema_and_says_so(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    start = time.time()
    with pytest.raises(UserError) as e:  # not cached, offline: at once, with this command's spelling
        decoding_vae({"kind": "shards", "train_path": str(tmp_path), "in_channels": 4}, option="vae")
    assert time.time() - start < 5
    message = str(e.value)
    assert "stabilityai/sd-vae-ft-ema" in message and "HF_HUB_OFFLINE=1" in message and "vae=DIR" in message


def test_a_vae_of_another_channel_count_is_refused(shards, tmp_path):
    cfg, made = shards
    wide = vae_folder(tmp_path / "wide", channels=16)
    with pytest.raises(UserError, match=rf"16-channel latents, the dataset's have 4.*set dataset.vae=.*{made}"):
        decoding_vae({**cfg, "vae": str(wide)})


def test_digits_need_no_vae():
    assert decoding_vae({"kind": "digits"}) == (None, "")
