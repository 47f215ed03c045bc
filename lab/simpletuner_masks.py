"""SimpleTuner's mask-image tokenisation, run, beside `tread_diffusers.masks`, token by token.

SimpleTuner turns a conditioning mask image (its `conditioning_pixel_values`, [-1, 1], for `loss_mask_type` mask or
segmentation) into TREAD force-keep tokens inline in its model classes' `model_predict`: FLUX and Chroma (the
three channels summed and divided by 3, mapped to [0, 1], area-resized to the latents' grid halved, > 0.5),
FLUX.2 (the same onto the latents' own grid) and Wan (trilinear, not area, onto frames x rows / 2 x columns / 2).
Here each of those classes is built with `__new__` and the few attributes `model_predict` reads; its transformer
is a stand-in that records the `force_keep_mask` it is handed and stops the step. Ours is
`mask_to_tokens(read_mask(mask), grid, N, rule)`. Kandinsky 5 and LTX-2 take a token mask as it is (a reshape),
Wan's first-frame conditioning keeps the conditioned latents' tokens: neither tokenises an image.
"""
import importlib
import types

import torch
import torch.nn.functional as F

from lab.simpletuner_models import import_simpletuner
from tread_diffusers.masks import mask_to_tokens, read_mask

B = 2


class _Recorded(Exception):
    """Raised by the stand-in transformer once it has the step's inputs: nothing after the call is needed."""


class RecordingTransformer(torch.nn.Module):
    """Stands in for the transformer `model_predict` calls: keeps its keyword inputs, then stops the step."""

    def __init__(self, patch_size=None):
        super().__init__()
        self.config = types.SimpleNamespace(guidance_embeds=False, patch_size=patch_size)
        self.seen = {}

    def forward(self, *args, **kwargs):
        self.seen = kwargs
        raise _Recorded


# model_predict's SimpleTuner class per family: (models/<folder>/model.py, class, latents per token along each grid
# axis, latent channels). FLUX and Chroma pack 2 x 2 latents into a token; FLUX.2's latents (packed by its VAE) are
# a token each; Wan's tokens are 1 x 2 x 2 latents (frames, rows, columns).
MASK_CODE = {"flux": ("flux", "Flux", (2, 2), 16), "chroma": ("chroma", "Chroma", (2, 2), 16),
             "flux2": ("flux2", "Flux2", (1, 1), 128), "wan": ("wan", "Wan", (1, 2, 2), 16)}


def their_model(code_dir, family: str):
    """SimpleTuner's model class for `family`, built without its __init__, with what model_predict reads."""
    import_simpletuner(code_dir, "flux/transformer")  # its stubs and sys.path
    folder, cls_name, _, _ = MASK_CODE[family]
    cls = getattr(importlib.import_module(f"simpletuner.helpers.models.{folder}.model"), cls_name)
    model = cls.__new__(cls)
    model.config = types.SimpleNamespace(
        base_weight_dtype=torch.float32, weight_dtype=torch.float32, tread_config={"routes": []},
        flux_guidance_mode="constant", flux_guidance_value=1.0, flux_attention_masked_training=False,
        model_flavour=None, controlnet=False, distillation_method=None)
    model.accelerator = types.SimpleNamespace(device=torch.device("cpu"), unwrap_model=lambda m, **k: m)
    model.model = RecordingTransformer()
    model.controlnet = None
    model.noise_schedule = types.SimpleNamespace(config=types.SimpleNamespace(num_train_timesteps=1000))
    return model


def their_tokens(model, family: str, mask_image: torch.Tensor, grid: tuple) -> torch.Tensor:
    """The force_keep_mask SimpleTuner's model_predict hands its transformer for this conditioning image."""
    _, _, per_token, channels = MASK_CODE[family]
    latents = torch.randn(mask_image.shape[0], channels, *(g * p for g, p in zip(grid, per_token)))
    text = torch.randn(len(latents), 5, 16)
    batch = dict(latents=latents, noisy_latents=latents.clone(), timesteps=torch.rand(len(latents)) * 1000,
                 prompt_embeds=text, encoder_hidden_states=text, add_text_embeds=torch.randn(len(latents), 16),
                 encoder_attention_mask=torch.ones(len(latents), 5), conditioning_pixel_values=mask_image,
                 loss_mask_type="mask")
    try:
        model.model_predict(batch)
    except _Recorded:
        return model.model.seen["force_keep_mask"]
    raise AssertionError("SimpleTuner's model_predict finished without calling its transformer")


def disc(h: int, w: int, radius: float) -> torch.Tensor:
    """[B, H, W] in {0, 1}: a disc at the centre, the second sample's shifted by a quarter of the width."""
    rows, cols = torch.arange(h)[:, None] + 0.5, torch.arange(w)[None] + 0.5
    return torch.stack([((rows - h / 2) ** 2 + (cols - w / 2 - shift) ** 2 <= radius ** 2).float()
                        for shift in (0, w / 4)])


def line(h: int, w: int, width: int = 3) -> torch.Tensor:
    """[B, H, W] in {0, 1}: a horizontal line `width` px thick (through token centres for the first sample, on a
    token border for the second) and a vertical one."""
    mask = torch.zeros(B, h, w)
    mask[0, h // 2 - 8 - width // 2:h // 2 - 8 - width // 2 + width] = 1
    mask[1, h // 2 - width // 2:h // 2 - width // 2 + width] = 1
    mask[1, :, w // 3:w // 3 + width] = 1
    return mask


def blobs(h: int, w: int, seed: int = 0) -> torch.Tensor:
    """[B, H, W] in {0, 1}: random blobs (coarse noise, bilinearly upsampled, thresholded)."""
    noise = torch.randn(B, 1, max(h // 24, 2), max(w // 24, 2), generator=torch.Generator().manual_seed(seed))
    return (F.interpolate(noise, size=(h, w), mode="bilinear", align_corners=False)[:, 0] > 0.3).float()


def soft_blobs(h: int, w: int, seed: int = 1) -> torch.Tensor:
    """[B, H, W] in [0, 1]: blobs with soft edges (a feathered segmentation mask, 0 and 1 away from them)."""
    noise = torch.randn(B, 1, max(h // 24, 2), max(w // 24, 2), generator=torch.Generator().manual_seed(seed))
    return (F.interpolate(noise, size=(h, w), mode="bilinear", align_corners=False)[:, 0] * 1.5 + 0.5).clamp(0, 1)


SHAPES = {"disc r=40px": lambda h, w: disc(h, w, 40), "line 3px": line, "random blobs": blobs,
          "soft blobs": soft_blobs}
# (family, mask image height x width, token grid): FLUX and FLUX.2's 16 px tokens at three sizes, a mask image at
# another resolution than the latents' (area resizing at a non-integer ratio), Chroma's copy of FLUX's rule, and
# Wan's video (5 frames onto 2 latent frames).
SIZES = (("flux", (128, 128), (8, 8)), ("flux", (256, 192), (16, 12)), ("flux", (200, 120), (8, 6)),
         ("chroma", (128, 192), (8, 12)), ("flux2", (128, 128), (8, 8)), ("flux2", (96, 160), (6, 10)),
         ("wan", (128, 128), (2, 8, 8)))
# Where SimpleTuner's rule is not FLUX's (its formula, run above) and why; ours keeps FLUX's for every family.
OTHER_RULE = {
    "wan": "its rule resizes the mask video with trilinear interpolation (align_corners=False), not area: at 16 px "
           "per token it reads the few pixels around each token's centre, so a thin line through the centre keeps "
           "the token, and a token more than half covered keeps it only if its centre is. Ours keeps the FLUX rule "
           "(more than half of the token's area) for every family",
}
_RGB = lambda m: m[:, None].expand(-1, 3, *m.shape[1:])  # noqa: E731
# The mask image as each side is handed it, from a [0, 1] mask [B, H, W]: (ours, theirs, our rule). SimpleTuner's
# data loader hands it [-1, 1] three-channel images; its formula divides the channels' sum by 3 whatever their
# number. The last form is a [0, 1] image handed to SimpleTuner as it is (its formula reads it as [-1, 1]).
FORMS = {"[-1, 1], 3 channels": (lambda m: 2 * _RGB(m) - 1, lambda m: 2 * _RGB(m) - 1, "half"),
         "[-1, 1], 1 channel": (lambda m: 2 * m[:, None] - 1, lambda m: 2 * m[:, None] - 1, "half"),
         "[0, 1], 1 channel (theirs: as [-1, 1])": (lambda m: m[:, None], lambda m: 2 * m[:, None] - 1, "half"),
         "[0, 1], 3 channels, theirs as is": (_RGB, _RGB, "any")}


def _video(mask: torch.Tensor, frames: int) -> torch.Tensor:
    return mask[:, :, None].expand(-1, -1, frames, -1, -1)


def compare_masks(code_dir) -> list:
    """Per (family, size, mask, form): the forced tokens of each side and how many tokens differ."""
    models, rows = {}, []
    for family, (h, w), grid in SIZES:
        model = models.setdefault(family, their_model(code_dir, family))
        for shape, make in SHAPES.items():
            image = make(h, w)
            for form, (to_ours, to_theirs, rule) in FORMS.items():
                if family == "wan" and rule == "any":
                    continue  # Wan's rule is a point sample, not FLUX's formula (lab.simpletuner_parity's notes)
                ours_in, theirs_in = to_ours(image), to_theirs(image)
                if family == "wan":
                    theirs_in, ours_in = _video(theirs_in, 5), _video(ours_in, 5)
                row = dict(family=family, size=(h, w), grid=grid, mask=shape, form=form, rule=rule)
                try:
                    theirs = their_tokens(model, family, theirs_in, grid)
                except RuntimeError as err:  # FLUX.2's latent packing needs einops, stubbed when not installed
                    rows.append({**row, "error": str(err)})
                    continue
                ours = mask_to_tokens(read_mask(ours_in), grid, theirs.shape[1], rule)
                rows.append({**row, "ours": int(ours.sum()), "theirs": int(theirs.sum()), "tokens": theirs.numel(),
                             "differ": int((ours != theirs).sum()), "error": None})
    return rows
