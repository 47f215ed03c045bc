"""Decoders: identity for the digits, SD-VAE (a tiny random AutoencoderKL saved locally) for ImageNet latents."""
import numpy as np
import pytest
import torch

from conftest import save_tiny_vae
import generation
from training import checkpoint as ckpt
from tread_utils.files import check_output_path
from data.decoders import IdentityDecoder, SDVAEDecoder, decoder_for
from dit import get_model
from edm import EDMPrecond
from tread_utils.errors import UserError

RES = 16  # the tiny VAE downsamples by 2: latents 4 x 8 x 8 -> images 16 x 16


@pytest.fixture(scope="module")
def tiny_vae(tmp_path_factory):
    return save_tiny_vae(tmp_path_factory.mktemp("tiny_vae"), RES)


def test_identity_decoder():
    x = torch.tensor([-1.0, -0.5, 0.0, 0.999, 1.0, 3.0, -7.0]).reshape(1, 1, 1, 7).repeat(2, 1, 3, 1)
    images = IdentityDecoder().decode(x)
    assert images.dtype == torch.uint8 and images.shape == (2, 3, 7, 3) and images.device.type == "cpu"
    assert images[0, 0, :, 0].tolist() == [0, 64, 128, 255, 255, 255, 0]  # round((x+1)*127.5), clamped
    assert torch.equal(images[..., 0], images[..., 1]) and torch.equal(images[..., 0], images[..., 2])
    rgb = IdentityDecoder()(torch.zeros(1, 3, 2, 2, dtype=torch.float64))
    assert rgb.shape == (1, 2, 2, 3)
    with pytest.raises(ValueError):
        IdentityDecoder().decode(torch.zeros(1, 4, 2, 2))


def test_sd_vae_decoder_from_a_local_folder(tiny_vae):
    from data.vae import decode_latents

    decoder = SDVAEDecoder(tiny_vae, decode_batch_size=2)
    latents = torch.randn(3, 4, RES // 2, RES // 2, generator=torch.Generator().manual_seed(0))
    images = decoder.decode(latents)
    assert images.dtype == torch.uint8 and images.shape == (3, RES, RES, 3)
    assert torch.equal(images, decode_latents(decoder.vae, latents))  # chunking changes nothing
    assert images.float().std() > 0


def test_decoder_for_picks_by_dataset_kind(tiny_vae):
    assert isinstance(decoder_for({"kind": "digits"}), IdentityDecoder)
    # dataset.scale_factor says how stored data becomes model latents; the model's latents are always
    # SD-VAE latents x 0.18215, so the decoder divides by that whatever the stored form
    from_arg = decoder_for({"kind": "shards", "scale_factor": 1.0, "quantize": "round"}, vae=tiny_vae)
    assert isinstance(from_arg, SDVAEDecoder) and from_arg.scale == pytest.approx(0.18215)
    assert from_arg.quantize == "round"
    from_cfg = decoder_for({"kind": "shards", "vae": tiny_vae})
    assert from_cfg.scale == pytest.approx(0.18215) and from_cfg.quantize == "truncate"  # the authors'
    assert isinstance(decoder_for({"kind": "shards"}, vae=from_cfg.vae), SDVAEDecoder)  # a loaded VAE
    with pytest.raises(UserError, match="dataset.kind"):
        decoder_for({"kind": "pixels"})


class ConstantVAE(torch.nn.Module):
    """Decodes every latent to the values `out` (in [-1, 1] units), to pin the uint8 quantisation."""

    def __init__(self, out):
        super().__init__()
        self.out, self.w = out, torch.nn.Parameter(torch.zeros(()))

    def decode(self, z):
        return type("Decoded", (), {"sample": self.out.expand(z.shape[0], 3, 1, -1)})()


def test_quantisation_truncates_like_the_authors_or_rounds():
    from data.vae import decode_latents

    vae = ConstantVAE(torch.tensor([-1.0, -0.999, 0.0, 0.5, 0.999, 1.0, 2.0]))
    z = torch.zeros(1, 4, 1, 1)
    # the authors: ((x + 1) / 2).clamp(0, 1) * 255, truncated by the uint8 cast
    assert decode_latents(vae, z)[0, 0, :, 0].tolist() == [0, 0, 127, 191, 254, 255, 255]
    assert decode_latents(vae, z, quantize="round")[0, 0, :, 0].tolist() == [0, 0, 128, 191, 255, 255, 255]
    with pytest.raises(UserError, match="dataset.quantize must be one of truncate, round"):
        SDVAEDecoder(vae, quantize="floor")


def test_missing_vae_weights_offline_is_a_user_error(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(UserError, match="not available from the Hugging Face cache"):
        decoder_for({"kind": "shards", "vae": "nobody/no-such-vae"})
    with pytest.raises(UserError, match="config.json"):
        SDVAEDecoder(str(tmp_path))


def test_generate_imagenet_style_latents_through_the_vae(tiny_vae):
    torch.manual_seed(0)
    model = get_model("DiT-T/2", dict(num_classes=3, in_channels=4, input_size=RES // 2, depth=2, hidden_size=32,
                                      num_heads=2))
    net = EDMPrecond(model).eval()
    decoder = decoder_for({"kind": "shards", "vae": tiny_vae})
    images, labels = generation.generate(net, [3, 1, 2], sampler_kwargs={"num_steps": 2}, decoder=decoder,
                                       batch_size=2, progress=False)
    assert isinstance(images, np.ndarray) and images.dtype == np.uint8 and images.shape == (3, RES, RES, 3)
    assert labels.dtype == np.int64 and set(labels.tolist()) <= {0, 1, 2}


class KeepLatents:
    """A decoder that keeps the sampled latents (and returns blank images), over all its calls."""

    def decode(self, latents):
        self.latents = torch.cat([getattr(self, "latents", latents[:0]), latents])
        return torch.zeros(len(latents), RES, RES, 3, dtype=torch.uint8)


def vae_decoded_reference(vae_path, params, weights, num_samples):
    """sample.py's images for seeds 0..n-1, written out: the EDM latents, divided by 0.18215, through the
    diffusers VAE, [-1, 1] -> [0, 1] clamped, times 255 truncated (the authors' quantisation), channels last."""
    from diffusers import AutoencoderKL

    model = get_model("DiT-T/2", params)
    model.load_state_dict(weights)
    keep = KeepLatents()
    generation.generate(EDMPrecond(model).eval(), range(num_samples), sampler_kwargs={"num_steps": 2},
                        decoder=keep, progress=False)
    with torch.no_grad():
        x = AutoencoderKL.from_pretrained(vae_path).decode(keep.latents / 0.18215).sample
    return (((x + 1) / 2).clamp(0, 1) * 255).to(torch.uint8).permute(0, 2, 3, 1).numpy()


def test_sample_cli_decodes_imagenet_style_checkpoints_with_the_vae(tiny_vae, tmp_path, monkeypatch, capsys):
    """sample.py on a 4-channel 'shards' run: the VAE comes from vae=PATH and decodes the sampled latents exactly as
    written out; offline without weights, one line."""
    import sample
    from accelerate.state import AcceleratorState

    torch.manual_seed(0)
    params = dict(num_classes=3, in_channels=4, input_size=RES // 2, depth=2, hidden_size=32, num_heads=2,
                  enable_routing=False, routes=[])
    weights = get_model("DiT-T/2", params).state_dict()
    config = {"model": {"backbone_type": "DiT-T/2", "params": params}, "diffuser": {"sigma_data": 0.5},
              "dataset": {"kind": "shards", "scale_factor": 0.18215}, "train": {"general": {"class_drop_prob": 0.1}}}
    ckpt = tmp_path / "ckpt_00000007.pt"
    torch.save({"step": 7, "model": weights, "ema": weights, "config": config}, ckpt)

    def run(*args):
        try:
            sample.main([f"ckpt={ckpt}", "num_samples=3", "sampler.num_steps=2", "progress=false", *args])
            return 0
        except SystemExit as e:
            return e.code
        finally:
            AcceleratorState._reset_state(reset_partial_state=True)

    assert run(f"vae={tiny_vae}", f"out={tmp_path}/s.npz") in (0, None)
    with np.load(tmp_path / "s.npz") as data:
        assert data["arr_0"].dtype == np.uint8 and data["arr_0"].shape == (3, RES, RES, 3)
        np.testing.assert_array_equal(data["arr_0"], vae_decoded_reference(tiny_vae, params, weights, 3))
    capsys.readouterr()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert run("vae=nobody/no-such-vae", f"out={tmp_path}/t.npz") == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and "not in the Hugging Face cache" in err and "Traceback" not in err
    assert not (tmp_path / "t.npz").exists()
