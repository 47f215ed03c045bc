"""Sample grids: one row per class with the first samples of that class, nearest-neighbour enlargement to
at least 512 px, a caption strip, and a plain grid for models with more than ten classes."""
import numpy as np
from PIL import Image

from generation import render_grid, save_image_grid
from generation.grids import GAP, grid_rows


def labelled_images(n=40, seed=0):
    """Each image a flat grey level that encodes its index, so a cell tells which sample it shows."""
    images = np.repeat(np.arange(n, dtype=np.uint8) * 5 + 10, 16 * 16 * 3)
    return images.reshape(n, 16, 16, 3), np.random.default_rng(seed).integers(0, 10, n)


def test_rows_hold_the_first_samples_of_each_class():
    images, labels = labelled_images()
    rows, cols = grid_rows(images, labels, num_classes=10, per_class=3)
    assert cols == 3 and [name for name, _ in rows] == [str(c) for c in np.unique(labels)]
    for name, row in rows:
        first = np.flatnonzero(labels == int(name))[:3]
        assert np.array_equal(row, images[first])


def test_class_grid_is_enlarged_sharp_and_captioned(tmp_path):
    images, labels = labelled_images()
    plain = render_grid(images, labels, num_classes=10, per_class=8)
    captioned = render_grid(images, labels, num_classes=10, per_class=8, caption="step 300: fid 12.5, class_acc 0.9")
    assert plain.width >= 512 and captioned.width == plain.width
    assert captioned.height > plain.height  # the caption strip sits on top
    rows, _ = grid_rows(images, labels, 10, 8)
    scale = 4  # 8 columns of 16 px -> 512 px
    pixels = np.asarray(plain)
    x0 = plain.width - 8 * (16 * scale + GAP)  # the first column, right of the row names
    y0 = GAP + 2 * (16 * scale + GAP)  # the third row
    first_of_row = rows[2][1][0]
    assert (pixels[y0:y0 + 16 * scale, x0:x0 + 16 * scale] == first_of_row[0, 0]).all()  # no blur at the edges
    path = save_image_grid(tmp_path / "g.png", images, labels, num_classes=10)
    with Image.open(path) as saved:
        assert saved.format == "PNG" and saved.width >= 512


def test_many_classes_fall_back_to_a_plain_grid():
    images, _ = labelled_images(n=30)
    labels = np.arange(30) * 30  # ImageNet-like: 30 different classes of 1000
    rows, cols = grid_rows(images, labels, num_classes=1000, max_images=25)
    assert cols == 5 and all(name is None for name, _ in rows)
    assert np.array_equal(np.concatenate([row for _, row in rows]), images[:25])  # seed order
    assert render_grid(images, labels, num_classes=1000).width >= 512
