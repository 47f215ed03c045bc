"""The FID Inception port: layout, parameter count, preprocessing, outputs, weight resolution and checksums."""
import hashlib
import io
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tread_utils.errors import UserError  # noqa: E402
from evaluations import inception, inception_weights  # noqa: E402
from evaluations.inception import count_parameters, random_init_inception, tf1_resize_bilinear  # noqa: E402
from evaluations.inception_weights import load_inception  # noqa: E402


@pytest.fixture(scope="module")
def model():
    return random_init_inception(seed=0)


def _resize_by_loops(img, out_h, out_w):
    """Obviously-correct TF1 legacy bilinear: src = dst * in / out, clamp to the edge."""
    in_h, in_w, c = img.shape
    out = np.zeros((out_h, out_w, c), dtype=np.float64)
    for y in range(out_h):
        sy = y * in_h / out_h
        y0 = int(np.floor(sy))
        y1 = min(y0 + 1, in_h - 1)
        fy = sy - y0
        for x in range(out_w):
            sx = x * in_w / out_w
            x0 = int(np.floor(sx))
            x1 = min(x0 + 1, in_w - 1)
            fx = sx - x0
            top = img[y0, x0] * (1 - fx) + img[y0, x1] * fx
            bottom = img[y1, x0] * (1 - fx) + img[y1, x1] * fx
            out[y, x] = top * (1 - fy) + bottom * fy
    return out


@pytest.mark.parametrize("in_hw,out_hw", [((5, 7), (13, 11)), ((13, 9), (5, 4)), ((32, 32), (299, 299)),
                                          ((299, 299), (299, 299))])
def test_resize_equals_loop_implementation(in_hw, out_hw):
    rng = np.random.default_rng(0)
    img = rng.integers(0, 256, size=in_hw + (3,)).astype(np.float32)
    ours = tf1_resize_bilinear(torch.from_numpy(img)[None], *out_hw)[0].numpy()
    ref = _resize_by_loops(img.astype(np.float64), *out_hw)
    np.testing.assert_allclose(ours, ref, rtol=1e-5, atol=1e-5 * 255)


def test_resize_has_no_half_pixel_offset():
    # 2 -> 4 pixels: src = 0, 0.5, 1, 1.5 -> [a, (a+b)/2, b, b]; half-pixel would start at 0.25 (clamped)
    img = torch.tensor([0.0, 100.0]).view(1, 1, 2, 1)
    out = tf1_resize_bilinear(img, 1, 4).flatten().tolist()
    assert out == [0.0, 50.0, 100.0, 100.0]
    half_pixel = F.interpolate(img.permute(0, 3, 1, 2), size=(1, 4), mode="bilinear", align_corners=False).flatten().tolist()
    assert half_pixel != out


def test_parameter_count_and_torchvision_layout(model):
    assert count_parameters(model) == 23_850_960
    torchvision = pytest.importorskip("torchvision")
    tv = torchvision.models.inception_v3(weights=None, num_classes=1008, aux_logits=False, init_weights=False)
    ours = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    theirs = {k: tuple(v.shape) for k, v in tv.state_dict().items()}
    assert ours == theirs  # the published pt_inception state dict loads unchanged


def test_fid_pooling_variants(model):
    assert model.Mixed_7b.pool == "avg" and model.Mixed_7c.pool == "max"
    # the A/C/E average pools ignore padding: a corner output is the mean of 4 real pixels
    x = torch.arange(9.0).view(1, 1, 3, 3)
    pooled = inception._avg_pool_same(x)
    assert pooled[0, 0, 0, 0].item() == pytest.approx((0 + 1 + 3 + 4) / 4)
    # Mixed_7c's pool branch is a max pool: check against a manual computation
    block = model.Mixed_7c
    feats = torch.randn(1, 2048, 8, 8)
    with torch.no_grad():
        out = block(feats)
        manual = block.branch_pool(F.max_pool2d(feats, 3, 1, 1))
    torch.testing.assert_close(out[:, -192:], manual)


def test_forward_shapes_logits_and_spatial_order(model):
    torch.manual_seed(0)
    with torch.no_grad():
        model.fc.bias.normal_()  # logits must ignore the bias
    images = torch.randint(0, 256, (2, 40, 30, 3), dtype=torch.uint8)
    captured = {}
    handles = [
        model.Mixed_6d.branch1x1.register_forward_hook(lambda m, i, o: captured.__setitem__("b1", o)),
        model.Conv2d_1a_3x3.register_forward_hook(lambda m, i, o: captured.__setitem__("input", i[0])),
    ]
    try:
        out = model(images)
    finally:
        for h in handles:
            h.remove()
    assert out["pool"].shape == (2, 2048)
    assert out["spatial"].shape == (2, 2023)
    assert out["logits"].shape == (2, 1008)
    torch.testing.assert_close(out["logits"], out["pool"] @ model.fc.weight.T)
    b1 = captured["b1"]
    assert b1.shape == (2, 192, 17, 17)
    manual = b1.permute(0, 2, 3, 1)[..., :7].reshape(2, -1)  # NHWC, first 7 channels, (h, w, c)
    torch.testing.assert_close(out["spatial"], manual)
    assert not torch.equal(out["spatial"], b1[:, :7].reshape(2, -1))  # NCHW order would differ
    # the network sees resize -> (x - 128) / 128, NCHW 299x299
    expected_input = (tf1_resize_bilinear(images.float(), 299, 299) - 128) / 128
    torch.testing.assert_close(captured["input"], expected_input.permute(0, 3, 1, 2))
    assert torch.isfinite(out["pool"]).all() and out["pool"].std() > 0


def test_load_weights_from_path_and_env(tmp_path, monkeypatch, model):
    """A weights file whose sha256 has the expected prefix (patched to this file's) loads, tensor for tensor."""
    path = tmp_path / inception_weights.WEIGHTS_FILENAME
    torch.save(model.state_dict(), path)
    monkeypatch.setattr(inception_weights, "WEIGHTS_SHA256_PREFIX", hashlib.sha256(path.read_bytes()).hexdigest()[:8])
    loaded = load_inception(path, device="cpu")
    for (k, a), b in zip(model.state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(a, b), k
    monkeypatch.setenv(inception_weights.WEIGHTS_ENV, str(path))
    assert inception_weights.resolve_inception_weights() == path
    bad = tmp_path / "bad.pth"
    torch.save({"fc.weight": torch.zeros(3)}, bad)
    with pytest.raises(UserError, match="not the FID Inception state dict"):
        load_inception(bad, device="cpu", check_hash=False)


def test_weights_with_another_checksum_are_refused_in_one_line(tmp_path):
    """A local file that is not the published one (sha256 prefix 6726825d) is refused before it is read."""
    path = tmp_path / inception_weights.WEIGHTS_FILENAME
    path.write_bytes(b"not the FID Inception weights")
    with pytest.raises(UserError) as info:
        load_inception(path, device="cpu")
    msg = str(info.value)
    assert "\n" not in msg and "sha256" in msg and hashlib.sha256(path.read_bytes()).hexdigest()[:16] in msg
    assert inception_weights.WEIGHTS_SHA256_PREFIX in msg and inception_weights.WEIGHTS_URL in msg


def test_download_is_checksum_verified(tmp_path, monkeypatch):
    """A download with the wrong sha256 is refused in one line and leaves no file behind; one with the
    expected prefix (patched to the served bytes') is kept in the cache folder."""
    served = b"bytes the fake server sends"
    monkeypatch.delenv(inception_weights.WEIGHTS_ENV, raising=False)
    monkeypatch.delenv(inception_weights.OFFLINE_ENV, raising=False)
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setattr(inception_weights.urllib.request, "urlopen", lambda url, timeout: io.BytesIO(served))
    cache = tmp_path / "torch" / "hub" / "checkpoints"
    with pytest.raises(UserError, match="download is corrupt") as info:
        inception_weights.resolve_inception_weights()
    assert "\n" not in str(info.value) and not any(cache.iterdir())
    monkeypatch.setattr(inception_weights, "WEIGHTS_SHA256_PREFIX", hashlib.sha256(served).hexdigest()[:8])
    assert inception_weights.resolve_inception_weights() == cache / inception_weights.WEIGHTS_FILENAME
    assert [p.name for p in cache.iterdir()] == [inception_weights.WEIGHTS_FILENAME]
    assert (cache / inception_weights.WEIGHTS_FILENAME).read_bytes() == served


def test_cache_dir_lookup(tmp_path, monkeypatch):
    monkeypatch.delenv(inception_weights.WEIGHTS_ENV, raising=False)
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    cached = tmp_path / "torch" / "hub" / "checkpoints" / inception_weights.WEIGHTS_FILENAME
    cached.parent.mkdir(parents=True)
    cached.write_bytes(b"x")
    assert inception_weights.resolve_inception_weights() == cached


def test_missing_weights_offline_is_one_clear_line(tmp_path, monkeypatch):
    monkeypatch.delenv(inception_weights.WEIGHTS_ENV, raising=False)
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv(inception_weights.OFFLINE_ENV, "1")
    with pytest.raises(UserError) as info:
        load_inception(device="cpu", weights_option="--weights PATH")  # the caller's spelling, named by the error
    msg = str(info.value)
    assert "\n" not in msg
    for part in (inception_weights.WEIGHTS_FILENAME, inception_weights.WEIGHTS_URL, "--weights",
                 inception_weights.WEIGHTS_ENV):
        assert part in msg
    with pytest.raises(UserError, match="does not exist"):
        load_inception(tmp_path / "nope.pth", device="cpu")


def test_random_init_is_seeded_and_leaves_global_rng_alone():
    before = torch.get_rng_state()
    m1 = random_init_inception(seed=3)
    assert torch.equal(before, torch.get_rng_state())
    m2 = random_init_inception(seed=3)
    assert torch.equal(m1.Conv2d_1a_3x3.conv.weight, m2.Conv2d_1a_3x3.conv.weight)
