"""Sample grids to look at: one row per class, cells enlarged with nearest-neighbour (pixels stay sharp)
until the grid is at least `MIN_WIDTH` wide, and a caption strip (step, metrics) in PIL's built-in font.

    save_image_grid("grid.png", images, labels, num_classes=10, caption="step 800: fid 21.3")

With labels and at most `MAX_CLASS_ROWS` classes (the digits), row c holds the first `per_class` samples
of class c, labelled at its left; a class with fewer samples leaves grey cells, a class with none has no
row. With more classes (ImageNet) or no labels: a plain near-square grid of the first `max_images`
samples in seed order.
"""
import math
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from tread_utils.files import atomic_write

MAX_CLASS_ROWS = 10
MIN_WIDTH = 512
GAP = 2                    # pixels between cells, in the background colour
BACKGROUND = (96, 96, 96)  # grey: unlike any digit's black background, so an empty cell reads as empty
TEXT = (255, 255, 255)
FONT_SIZE = 14


def grid_rows(images: np.ndarray, labels=None, num_classes=None, per_class: int = 8, max_images: int = 64):
    """The layout: (rows as [(row name or None, uint8 [k, H, W, 3])], columns)."""
    if labels is not None:
        labels = np.asarray(labels)
        classes = np.unique(labels)
        if len(classes) <= MAX_CLASS_ROWS and (num_classes or 0) <= MAX_CLASS_ROWS:
            per_class = max(int(per_class), 1)
            return [(str(c), images[np.flatnonzero(labels == c)[:per_class]]) for c in classes], per_class
    shown = images[:max(int(max_images), 1)]
    cols = math.ceil(math.sqrt(len(shown)))
    return [(None, shown[i:i + cols]) for i in range(0, len(shown), cols)], cols


def _wrap(text: str, font, width: int) -> list:
    """`text` broken after its commas into lines no wider than `width` pixels, so `name value` pairs stay
    whole (a longer piece keeps its own line)."""
    parts = text.split(", ")
    lines, line = [], ""
    for word in [p + "," for p in parts[:-1]] + parts[-1:]:
        trial = f"{line} {word}".strip()
        if line and font.getlength(trial) > width:
            lines.append(line)
            line = word
        else:
            line = trial
    return lines + [line] if line else lines


def render_grid(images, labels=None, *, num_classes=None, per_class: int = 8, max_images: int = 64,
                caption: str = "", min_width: int = MIN_WIDTH) -> Image.Image:
    """The grid of uint8 [N, H, W, 3] `images` as an RGB PIL image (layout: see the module docstring)."""
    images = np.asarray(images, dtype=np.uint8)
    rows, cols = grid_rows(images, labels, num_classes, per_class, max_images)
    h, w = images.shape[1:3]
    scale = max(1, math.ceil(min_width / (cols * w)))
    cell_w, cell_h = w * scale, h * scale
    font = ImageFont.load_default(size=FONT_SIZE)
    names = [name for name, _ in rows if name is not None]
    margin = int(max(font.getlength(name) for name in names)) + 2 * GAP if names else 0
    width = margin + cols * (cell_w + GAP) + GAP
    lines = _wrap(caption, font, width - 2 * GAP)
    line_h = FONT_SIZE + 4
    top = len(lines) * line_h + (GAP if lines else 0)
    canvas = Image.new("RGB", (width, top + len(rows) * (cell_h + GAP) + GAP), BACKGROUND)
    draw = ImageDraw.Draw(canvas)
    if lines:
        draw.rectangle([0, 0, width, top - 1], fill=(0, 0, 0))
    for i, line in enumerate(lines):
        draw.text((GAP, i * line_h + 2), line, font=font, fill=TEXT)
    for r, (name, row) in enumerate(rows):
        y = top + GAP + r * (cell_h + GAP)
        if name is not None:
            draw.text((GAP, y + cell_h // 2), name, font=font, fill=TEXT, anchor="lm")
        for k, image in enumerate(row):
            tile = Image.fromarray(image).convert("RGB").resize((cell_w, cell_h), Image.NEAREST)
            canvas.paste(tile, (margin + GAP + k * (cell_w + GAP), y))
    return canvas


def save_image_grid(path, images, labels=None, **options) -> Path:
    """`render_grid(images, labels, **options)` written atomically as a PNG at `path`."""
    grid = render_grid(images, labels, **options)
    return atomic_write(Path(path), lambda f: grid.save(f, format="PNG"))
