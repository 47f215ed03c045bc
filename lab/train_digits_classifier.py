"""Train the digits feature network (evaluations/digits_classifier.py) on the digits 'train' split.

    python -m lab.train_digits_classifier [--out evaluations/digits_classifier.pt]
                                                  [--epochs 40] [--seed 0]

CPU, about half a minute (one thread). Augmentation (small random rotations/scalings/shifts, contrast changes,
Gaussian noise, and the uint8 quantisation of the evaluation path) lets it generalise to generated
samples. Reports the held-out ('test' split, 297 images) accuracy and exits with status 1 if it is
below 97%. The weights file (a float32 state dict, under 1 MB) is committed with the repository.
"""
from __future__ import annotations

import math
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.nn.functional as F

from data.digits import load_digits_split
from data.images import latents_to_uint8
from evaluations.digits_classifier import WEIGHTS_PATH, DigitsClassifier, accuracy
from tread_utils.errors import UserError, report_user_errors
from tread_utils.cli import ArgumentParser, positive_int

MIN_ACCURACY = 0.97


def augment(x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Random affine jitter, contrast, noise and uint8 quantisation of [-1, 1] images [B, 1, H, W]."""
    b = len(x)

    def uniform(lo, hi, *shape):
        return lo + (hi - lo) * torch.rand(*shape, generator=generator)

    angle = uniform(-12, 12, b) * math.pi / 180
    scale = uniform(0.88, 1.12, b)
    shift = uniform(-0.25, 0.25, b, 2)  # +-2 pixels of 16 (grid units span 2 / 16 per pixel)
    cos, sin = torch.cos(angle) / scale, torch.sin(angle) / scale
    theta = torch.stack([torch.stack([cos, -sin, shift[:, 0]], 1), torch.stack([sin, cos, shift[:, 1]], 1)], 1)
    grid = F.affine_grid(theta, list(x.shape), align_corners=False)
    # sample x + 1 so that zero padding is the -1 background
    x = F.grid_sample(x + 1, grid, mode="bilinear", padding_mode="zeros", align_corners=False) - 1
    x = (x + 1) * uniform(0.8, 1.15, b, 1, 1, 1) - 1
    x = x + torch.randn(x.shape, generator=generator) * uniform(0.0, 0.12, b, 1, 1, 1)
    x = x.clamp(-1, 1)
    return torch.round((x + 1) * 127.5) / 127.5 - 1  # the quantisation of latents_to_uint8


def train(epochs: int = 40, batch_size: int = 64, lr: float = 2e-3, seed: int = 0, log=print) -> DigitsClassifier:
    images, labels = load_digits_split("train", resolution=16)
    generator = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = DigitsClassifier()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=1e-4)
    steps_per_epoch = math.ceil(len(images) / batch_size)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=epochs * steps_per_epoch, pct_start=0.15)
    for epoch in range(epochs):
        model.train()
        order = torch.randperm(len(images), generator=generator)
        total, correct = 0.0, 0
        for start in range(0, len(images), batch_size):
            idx = order[start:start + batch_size]
            x, y = augment(images[idx], generator), labels[idx]
            logits = model.forward_latents(x)["logits"]
            loss = F.cross_entropy(logits, y, label_smoothing=0.05)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            total += loss.item() * len(idx)
            correct += int((logits.argmax(1) == y).sum())
        if (epoch + 1) % 10 == 0 or epoch == 0:
            log(f"epoch {epoch + 1}/{epochs}: loss {total / len(images):.4f}, augmented train acc {correct / len(images):.4f}")
    return model.eval()


def build_parser() -> ArgumentParser:
    p = ArgumentParser(description="Train the digits feature network for toy-scale FID.")
    p.add_argument("--out", default=str(WEIGHTS_PATH), help="weights file to write")
    p.add_argument("--epochs", type=positive_int, default=40)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=positive_int, default=1,
                   help="torch CPU threads (1 is fastest for this tiny network, and robust to a busy machine)")
    return p


@report_user_errors
def main(argv=None):
    args = build_parser().parse_args(argv)
    if args.epochs < 1:
        raise UserError(f"--epochs must be >= 1, got {args.epochs}")
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    t0 = time.time()
    model = train(epochs=args.epochs, seed=args.seed)
    test_images, test_labels = load_digits_split("test", resolution=16)
    acc = accuracy(model, latents_to_uint8(test_images), test_labels)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    torch.save({k: v.contiguous() for k, v in model.state_dict().items()}, out)
    print(f"held-out (test split, {len(test_labels)} images) accuracy: {acc:.4f}; "
          f"wrote {out} ({out.stat().st_size / 1e3:.0f} kB) in {time.time() - t0:.0f}s")
    if acc < MIN_ACCURACY:
        print(f"error: held-out accuracy {acc:.4f} is below {MIN_ACCURACY}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
