"""REPA's frozen teachers: clean images in [-1, 1] -> patch features [B, N_t, D] on a (h, w) grid.

* `dinov2_vitb14`: DINOv2 ViT-B/14 through timm (`vit_base_patch14_dinov2`), REPA's usual teacher. Its input
  is prepared as REPA prepares it: [0, 1], ImageNet mean/std, bicubic resize to 224 * (resolution // 256)
  (at least 224), so a 256-px image gives a 16 x 16 grid, the token grid of DiT-*/2 on 32 x 32 latents.
  Weights come from `repa.encoder_weights` (a file, or a folder holding model.safetensors or
  pytorch_model.bin) or else from the Hugging Face cache; nothing is downloaded at run time.
* `digits_classifier`: the shipped digits classifier's last spatial map (conv4 after ReLU, 8 x 8 x 64, before
  its pooling), so REPA runs on a fresh CPU machine; 8 x 8 is DiT-D/2's token grid on the 16 x 16 digits (the
  digits preset's DiT-D/4 has 4 x 4 tokens: the map is resized to it).
"""
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from evaluations.digits_classifier import RESOLUTION as DIGITS_RESOLUTION
from evaluations.digits_classifier import DigitsClassifier, load_digits_classifier
from tread_utils.errors import UserError

DINOV2_MODEL = "vit_base_patch14_dinov2"
DINOV2_HUB_ID = "timm/vit_base_patch14_dinov2.lvd142m"
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")


def dinov2_weights_file(weights=None) -> Path:
    """The weights file: `weights` (a file or a folder) or the Hugging Face cache; else one line saying what to
    download and where to put it."""
    if weights:
        path = Path(str(weights)).expanduser()
        found = [path / name for name in WEIGHT_FILES if (path / name).is_file()] if path.is_dir() else [path]
        if found and found[0].is_file():
            return found[0]
        raise UserError(f"repa.encoder_weights={weights} holds no DINOv2 weights (a file, or a folder with "
                        f"{' or '.join(WEIGHT_FILES)}); download {DINOV2_HUB_ID} from huggingface.co into it")
    from huggingface_hub import try_to_load_from_cache  # only on this path: the digits teacher needs no hub

    for name in WEIGHT_FILES:
        cached = try_to_load_from_cache(DINOV2_HUB_ID, name)
        if isinstance(cached, str):
            return Path(cached)
    raise UserError(f"DINOv2 ViT-B/14 weights not found offline: download {DINOV2_HUB_ID} (model.safetensors) into "
                    f"the Hugging Face cache (`huggingface-cli download {DINOV2_HUB_ID}`) or put the file anywhere "
                    f"and set repa.encoder_weights=/path/to/model.safetensors")


class DinoV2Teacher(nn.Module):
    dim = 768
    patch_size = 14

    def __init__(self, weights=None, load: bool = True):
        """`load=False`: random weights (tests, FLOP counts on the meta device)."""
        import timm  # here, not at the top: timm loads torchvision's model zoo, two seconds on every command
        from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD

        super().__init__()
        kwargs = dict(img_size=224, num_classes=0, dynamic_img_size=True)
        if load:
            kwargs.update(pretrained=True, pretrained_cfg_overlay=dict(file=str(dinov2_weights_file(weights))))
        self.model = timm.create_model(DINOV2_MODEL, **kwargs)
        self.register_buffer("mean", torch.tensor(IMAGENET_DEFAULT_MEAN).view(1, 3, 1, 1), persistent=False)
        self.register_buffer("std", torch.tensor(IMAGENET_DEFAULT_STD).view(1, 3, 1, 1), persistent=False)

    @staticmethod
    def input_size(resolution: int) -> int:
        return 224 * max(1, resolution // 256)

    def forward(self, images: torch.Tensor):
        x = (images.float() + 1) / 2
        x = x.expand(-1, 3, -1, -1) if x.shape[1] == 1 else x
        size = self.input_size(x.shape[-1])
        x = F.interpolate((x - self.mean) / self.std, size=(size, size), mode="bicubic", align_corners=False)
        tokens = self.model.forward_features(x)[:, self.model.num_prefix_tokens:]
        grid = size // self.patch_size
        return tokens, (grid, grid)


class DigitsTeacher(nn.Module):
    dim = 64

    def __init__(self, weights=None, load: bool = True):
        super().__init__()
        self.model = load_digits_classifier(weights, device="cpu") if load else DigitsClassifier()

    def forward(self, images: torch.Tensor):
        x = images[:, :1].float()
        if x.shape[-2:] != (DIGITS_RESOLUTION, DIGITS_RESOLUTION):
            x = F.interpolate(x, size=(DIGITS_RESOLUTION, DIGITS_RESOLUTION), mode="bilinear", align_corners=False)
        fmap = self.model.feature_maps(x)[1]
        return fmap.flatten(2).transpose(1, 2), tuple(fmap.shape[-2:])


TEACHERS = {"dinov2_vitb14": DinoV2Teacher, "digits_classifier": DigitsTeacher}


def build_teacher(name: str, weights=None, load: bool = True) -> nn.Module:
    """A frozen teacher in eval mode (its forward never builds a graph: REPA's teacher is not trained)."""
    return TEACHERS[name](weights, load).requires_grad_(False).eval()


def teacher_forward_flops(name: str, batch_size: int, channels: int, resolution: int) -> int:
    """The teacher's forward FLOPs for one batch, counted on the meta device (no weights, no compute)."""
    from torch.utils.flop_counter import FlopCounterMode

    with torch.device("meta"):
        teacher = build_teacher(name, load=False)
        images = torch.zeros(batch_size, channels, resolution, resolution)
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        teacher(images)
    return counter.get_total_flops()
