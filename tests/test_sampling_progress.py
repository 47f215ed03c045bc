"""The sampling progress bar moves per sampler step and per decoded image, not per batch, and changes no
image."""
import sys

import numpy as np
import pytest
import torch
from tqdm import tqdm

import generation
from data.images import latents_to_uint8


@pytest.fixture(autouse=True)
def terminal(monkeypatch, request):
    """stderr is a terminal (the bar is drawn) unless a test asks for a log file."""
    if "log_file" not in request.node.name:
        monkeypatch.setattr(sys.stderr, "isatty", lambda: True)


def shown():
    """The count of the open progress bar, as the user sees it."""
    bars = list(tqdm._instances)
    assert len(bars) == 1
    return bars[0].n


class Net:
    """A cheap class-conditional denoiser that notes the bar's count at each evaluation."""
    num_classes, sigma_min, sigma_max = 10, 0.0, float("inf")

    def __init__(self, watch):
        self.watch, self.seen = watch, []

    @staticmethod
    def round_sigma(sigma):
        return torch.as_tensor(sigma)

    def __call__(self, x, sigma, class_labels=None, **kw):
        if self.watch:
            self.seen.append(shown())
        return x * 0.5


class Decoder:
    def __init__(self, watch):
        self.watch, self.calls = watch, []

    def decode(self, latents):
        self.calls.append((len(latents), shown() if self.watch else None))
        return latents_to_uint8(latents)


def run(progress, seeds=range(6), batch_size=6, watch=None):
    watch = progress if watch is None else watch
    net, decoder = Net(watch), Decoder(watch)
    images, labels = generation.generate(net, seeds, sampler_kwargs={"name": "euler", "num_steps": 4},
                                         decoder=decoder, batch_size=batch_size, device="cpu",
                                         latent_shape=(1, 2, 2), progress=progress)
    return images, labels, net, decoder


def test_one_batch_moves_the_bar_per_step_and_per_decoded_image():
    images, labels, net, decoder = run(progress=True)
    nfe = generation.count_network_evaluations({"name": "euler", "num_steps": 4})
    assert len(net.seen) == nfe >= 4
    assert net.seen[0] == 0 and all(b > a for a, b in zip(net.seen, net.seen[1:]))  # every step moves it
    sizes, counts = zip(*decoder.calls)
    assert sizes == (1,) * 6  # on a CPU: one image per decoder call
    assert counts[0] > net.seen[-1] and all(b > a for a, b in zip(counts, counts[1:])) and counts[-1] < 6
    assert not tqdm._instances  # closed at the end
    plain_images, plain_labels, _, _ = run(progress=False)
    np.testing.assert_array_equal(images, plain_images)  # the bar changes no image
    np.testing.assert_array_equal(labels, plain_labels)


def test_the_count_is_exact_at_each_batch_end():
    _, _, net, decoder = run(progress=True, seeds=range(5), batch_size=2)  # batches of 2, 2 and 1
    nfe = len(net.seen) // 3
    starts = [net.seen[i * nfe] for i in range(3)]
    assert starts == [0, 2, 4]  # each batch starts at the images done before it
    assert all(0 <= n < 5 for n in net.seen)


def test_in_a_log_file_a_plain_line_at_each_tenth_and_no_bar(capsys):
    run(progress=True, seeds=range(20), batch_size=2, watch=False)  # 10 batches: a line after each
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert [line.split()[1] for line in lines] == [f"{n}/20" for n in range(2, 21, 2)], err
    assert all(" img/s  ETA " in line for line in lines) and "\r" not in err and "|" not in err
    run(progress=False, seeds=range(4), batch_size=2)
    assert capsys.readouterr().err == ""
