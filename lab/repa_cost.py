"""REPA's teacher on ImageNet 256: storage of precomputed features against the compute of an online teacher.

    python -m lab.repa_cost                      # bytes, FLOPs, and a timing on this machine (random weights)
    python -m lab.repa_cost --batch 32 --repeats 5   # on a GPU: a larger batch, the timing in bfloat16

Bytes: DINOv2-B/14 patch tokens of one 256-px image (16 x 16 x 768, float16), with its flip, against the
uint8 image itself (its flip costs nothing online). FLOPs: the teacher's forward and a DiT-XL/2 training step
(forward + backward, route 2 -> 24 at 0.5 and dense), both counted by torch.utils.flop_counter on the meta
device. Timing: the same two with random weights on this machine's device, per image.
"""
import argparse
import time

import torch

from dit import get_model
from training.flops import training_step_flops
from training.repa_teachers import build_teacher, teacher_forward_flops
from tread_utils.cli import ArgumentParser, positive_int

IMAGENET_TRAIN_IMAGES = 1_281_167
RESOLUTION, LATENT = 256, 32
XL = dict(in_channels=4, input_size=LATENT, num_classes=1000, enable_routing=True,
          routes=[dict(start_layer_idx=2, end_layer_idx=24, selection_ratio=0.5)])


def storage() -> dict:
    tokens = (224 // 14) ** 2  # REPA feeds DINOv2 224 px for 256-px images: 16 x 16 patches, one per DiT-XL/2 token
    features = tokens * build_teacher("dinov2_vitb14", load=False).dim * 2  # float16
    image = RESOLUTION * RESOLUTION * 3
    return {"features_bytes_per_image_with_flip": 2 * features, "image_bytes_per_image": image,
            "features_total_tb": 2 * features * IMAGENET_TRAIN_IMAGES / 1e12,
            "images_total_gb": image * IMAGENET_TRAIN_IMAGES / 1e9}


def flops() -> dict:
    teacher = teacher_forward_flops("dinov2_vitb14", 1, 3, RESOLUTION)
    dense = training_step_flops("DiT-XL/2", XL, 1, routing=False)
    routed = training_step_flops("DiT-XL/2", XL, 1, routing=True)
    return {"teacher_gflops": teacher / 1e9, "dit_xl_dense_gflops": dense / 1e9, "dit_xl_routed_gflops": routed / 1e9,
            "teacher_share_dense": teacher / dense, "teacher_share_routed": teacher / routed}


def seconds_per_image(fn, batch: int, repeats: int, device) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2] / batch


def timing(batch: int, repeats: int) -> dict:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    teacher = build_teacher("dinov2_vitb14", load=False).to(device)
    model = get_model("DiT-XL/2", XL).to(device).train()
    images = torch.rand(batch, 3, RESOLUTION, RESOLUTION, device=device) * 2 - 1
    x = torch.randn(batch, 4, LATENT, LATENT, device=device)
    t, y = torch.randn(batch, device=device), torch.zeros(batch, dtype=torch.long, device=device)

    def teach():
        with torch.no_grad(), torch.autocast(device.type, dtype, enabled=device.type == "cuda"):
            teacher(images)

    def step():
        with torch.autocast(device.type, dtype, enabled=device.type == "cuda"):
            loss = model(x, t, y).float().square().mean()
        loss.backward()
        model.zero_grad(set_to_none=True)

    teacher_s = seconds_per_image(teach, batch, repeats, device)
    step_s = seconds_per_image(step, batch, repeats, device)
    return {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "batch": batch,
            "teacher_ms_per_image": teacher_s * 1e3, "dit_xl_routed_step_ms_per_image": step_s * 1e3,
            "measured_teacher_share": teacher_s / step_s}


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=positive_int, default=2)
    parser.add_argument("--repeats", type=positive_int, default=3)
    parser.add_argument("--no-timing", action="store_true", help="bytes and FLOPs only")
    return parser


def main(argv=None):
    args = build_parser().parse_args(argv)
    torch.manual_seed(0)
    report = {**storage(), **flops(), **({} if args.no_timing else timing(args.batch, args.repeats))}
    for key, value in report.items():
        print(f"{key}: {value:.4g}" if isinstance(value, float) else f"{key}: {value}")


if __name__ == "__main__":
    main()
