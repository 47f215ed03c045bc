"""The digits feature network: shipped weights, held-out accuracy, interface, FID sanity."""
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from data.digits import load_digits_split  # noqa: E402
from data.decoders import decoder_for  # noqa: E402
from evaluations.digits_classifier import (WEIGHTS_PATH, accuracy, class_accuracy, digits_fid,  # noqa: E402
                                           digits_reference_statistics, evaluate_digits, load_digits_classifier)
from data.images import latents_to_uint8  # noqa: E402


@pytest.fixture(scope="module")
def classifier():
    return load_digits_classifier(device="cpu")


@pytest.fixture(scope="module")
def reference(classifier):
    return digits_reference_statistics(classifier)


def test_shipped_weights_are_small_and_safe_to_load():
    assert WEIGHTS_PATH.is_file() and WEIGHTS_PATH.stat().st_size < 1_000_000
    state = torch.load(WEIGHTS_PATH, map_location="cpu", weights_only=True)
    assert all(torch.is_tensor(v) for v in state.values())


def test_held_out_accuracy_of_the_shipped_weights(classifier):
    """The shipped weights read 295 of the 297 held-out digits correctly: pinned, so other weights or a
    changed preprocessing show."""
    images, labels = load_digits_split("test", resolution=16)
    assert len(labels) == 297
    assert accuracy(classifier, latents_to_uint8(images), labels) * 297 == pytest.approx(295)


def test_interface_and_spatial_order(classifier):
    images = latents_to_uint8(load_digits_split("test")[0][:5])
    captured = {}
    handle = classifier.conv3.register_forward_hook(lambda m, i, o: captured.__setitem__("map", o))
    try:
        with torch.no_grad():
            out = classifier(images)
    finally:
        handle.remove()
    assert out["pool"].shape == (5, 128) and out["logits"].shape == (5, 10) and out["spatial"].shape == (5, 256)
    manual = torch.relu(captured["map"])[:, :4].permute(0, 2, 3, 1).reshape(5, -1)  # (h, w, c)
    torch.testing.assert_close(out["spatial"], manual)
    # channel 0 only: other channels are ignored; p / 127.5 - 1 maps uint8 back to [-1, 1]
    scrambled = images.clone()
    scrambled[..., 1:] = 7
    torch.testing.assert_close(classifier(scrambled)["logits"], out["logits"])
    x = classifier.uint8_to_input(torch.full((1, 8, 8, 3), 255, dtype=torch.uint8))  # other sizes: resized
    assert x.shape == (1, 1, 16, 16) and torch.allclose(x, torch.ones_like(x))


def test_reference_statistics_and_fid_sanity(classifier, reference):
    assert reference["mu"].shape == (128,) and reference["sigma"].shape == (128, 128)
    assert reference["pool"].shape == (297, 128) and reference["mu_s"].shape == (256,)
    train = load_digits_split("train")[0]
    fid_train = digits_fid(train, classifier, reference)
    fid_noise = digits_fid(torch.rand(300, 1, 16, 16) * 2 - 1, classifier, reference)
    assert fid_train < 10 and fid_noise > 10 * fid_train
    metrics = evaluate_digits(train[:300], classifier, reference)
    assert metrics["precision"] > 0.8 and metrics["recall"] > 0.6 and metrics["inception_score"] > 7
    # uint8 images give the same numbers as the latents they come from
    assert digits_fid(latents_to_uint8(train), classifier, reference) == pytest.approx(fid_train, rel=1e-9)
    assert np.isfinite(metrics["sfid"])


def test_class_accuracy_of_held_out_digits_and_of_shuffled_labels(classifier):
    """Held-out digits, decoded the way generated digits are, score the classifier's accuracy; with their
    labels shuffled they score chance. For a near-perfect classifier a random permutation scores
    sum_c (n_c / N)^2, about 0.1 for ten balanced classes, with a standard deviation near
    sqrt(0.1 * 0.9 / 297) = 0.017: the band 0.04-0.17 is about four of those either side."""
    latents, labels = load_digits_split("test", resolution=16)
    images = decoder_for({"kind": "digits"}).decode(latents).numpy()
    assert class_accuracy(images, labels, classifier) * 297 == pytest.approx(295)  # as accuracy() above
    shuffled = np.random.default_rng(0).permutation(labels.numpy())
    assert 0.04 <= class_accuracy(images, shuffled, classifier) <= 0.17


def test_the_digits_are_scikit_learns():
    """The embedded digits are read from the file the scikit-learn wheel ships without importing scikit-learn: the
    same images and labels as its own loader."""
    from sklearn.datasets import load_digits

    from data.digits import read_digits

    images, labels = read_digits()
    theirs = load_digits()
    assert np.array_equal(images, theirs.images) and np.array_equal(labels, theirs.target)
