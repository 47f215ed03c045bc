"""Masks for TREAD on diffusers transformers: force-keep masks as trainers hold them, and the masked loss.

A mask comes in one of two forms, as a torch tensor or a numpy array:
- a token mask [B, N], bool or 0/1, taken as it is;
- a mask image [B, H, W] or [B, C, H, W] with C = 1 or 3 ([B, F, H, W] or [B, C, F, H, W] for video), at any
  resolution, bool or with values in [0, 1] or in SimpleTuner's [-1, 1] (its conditioning images: -1 outside,
  1 inside). The range is read from the darkest pixel: a negative one means [-1, 1], a 0 means [0, 1]. A
  mask whose darkest pixel lies strictly between 0 and 1 fits neither reading (no pixel is outside) and is
  refused, as is anything outside [-1, 1]. Three channels are averaged.

An image becomes tokens by a named rule over each token's pixels (the image area-resized to the token grid):
- "half" (SimpleTuner's): the token is kept when more than half of its area is inside the mask;
- "any": the token is kept when any of its pixels is inside (above 0 on the [0, 1] scale).
"""
import numpy as np
import torch
import torch.nn.functional as F

from tread_utils.errors import UserError

MASK_RULES = ("half", "any")
LOSS_NORMALISATIONS = ("masked", "all")
FORMS = ("a [B, N] token mask (bool or 0/1), or a mask image [B, H, W] / [B, 1 or 3, H, W] ([B, F, H, W] / "
         "[B, 1 or 3, F, H, W] for video) in [0, 1] or [-1, 1], as a torch tensor or numpy array")


def read_mask(mask) -> torch.Tensor:
    """A mask in one of the accepted forms as a bool token mask [B, N] or a float image in [0, 1]."""
    if isinstance(mask, np.ndarray) and (mask.dtype == np.bool_ or np.issubdtype(mask.dtype, np.number)):
        mask = torch.from_numpy(np.ascontiguousarray(mask))
    if not isinstance(mask, torch.Tensor) or mask.is_complex() or mask.ndim < 2:
        what = (f"has shape {tuple(mask.shape)}" if isinstance(mask, torch.Tensor) and not mask.is_complex() else
                f"is a {type(mask).__name__} of dtype {mask.dtype}" if hasattr(mask, "dtype") else
                f"is a {type(mask).__name__}")
        raise UserError(f"the TREAD mask {what}; give {FORMS}")
    if mask.dtype == torch.bool:
        return mask if mask.ndim == 2 else mask.float()
    values = mask.detach().float()
    if mask.ndim == 2:
        if not ((values == 0) | (values == 1)).all():
            raise UserError(f"a [B, N] TREAD token mask must hold only 0 and 1 (or be bool); got values in "
                            f"[{values.min().item():g}, {values.max().item():g}]")
        return values.bool()
    low, high = (values.min().item(), values.max().item()) if values.numel() else (0.0, 0.0)
    if not (-1 <= low <= high <= 1):
        raise UserError(f"the TREAD mask image has values in [{low:g}, {high:g}]; give it in [0, 1] or "
                        f"SimpleTuner's [-1, 1] (a 0-255 image divided by 255)")
    if 0 < low < 1:
        raise UserError(f"the TREAD mask image's darkest value is {low:g}, so it reads as neither [0, 1] (0 "
                        f"outside) nor [-1, 1] (-1 outside); give the outside pixels 0 or -1")
    return (values + 1) / 2 if low < 0 else values


def _image_parts(mask: torch.Tensor, spatial: int) -> torch.Tensor:
    """A [B, (C,) *image] float mask as [B, 1, *image], channels averaged; None when it has another shape."""
    if mask.ndim == spatial + 1:
        return mask[:, None]
    if mask.ndim == spatial + 2 and mask.shape[1] in (1, 3):
        return mask.mean(1, keepdim=True)
    return None


def mask_to_tokens(mask: torch.Tensor, grid: tuple, num_tokens: int, rule: str = "half") -> torch.Tensor:
    """A mask from `read_mask` as a [B, N] bool token mask over the token grid `grid`, by the named rule."""
    if mask.ndim == 2:
        if mask.shape[1] != num_tokens:
            raise UserError(f"the TREAD token mask has {mask.shape[1]} tokens per sample, the image {num_tokens}; "
                            f"give one flag per image token, or a mask image")
        return mask
    image = _image_parts(mask, len(grid)) if len(grid) in (2, 3) else None
    if image is None:
        raise UserError(f"the TREAD mask has shape {tuple(mask.shape)} for a token grid {tuple(grid)}; give {FORMS}")
    if rule == "half":
        pool = F.adaptive_avg_pool2d if len(grid) == 2 else F.adaptive_avg_pool3d
        return pool(image, grid).flatten(1) > 0.5
    pool = F.adaptive_max_pool2d if len(grid) == 2 else F.adaptive_max_pool3d
    return pool(image, grid).flatten(1) > 0


def masked_loss(loss: torch.Tensor, mask, normalise: str = "masked") -> torch.Tensor:
    """An unreduced loss weighted by a mask (any accepted form): `loss` [B, C, *image] with a mask image at any
    resolution (area-resized: soft weights at its edges), or token layout `loss` [B, N, C] with a [B, N] mask.

    normalise="masked": the mean over the masked area (the weighted sum over the weights' sum), so the loss
    scale does not depend on the mask's size; "all": SimpleTuner's, the weighted loss averaged over every element."""
    if normalise not in LOSS_NORMALISATIONS:
        raise UserError(f"masked_loss normalise={normalise!r}; choose one of {', '.join(LOSS_NORMALISATIONS)}")
    mask = read_mask(mask)
    weight = mask.to(device=loss.device, dtype=loss.dtype)
    if loss.ndim == 3 and mask.shape == loss.shape[:2]:
        weight = weight[..., None]
    else:
        image = _image_parts(weight, loss.ndim - 2) if mask.ndim > 2 else None
        if image is None or image.shape[0] != loss.shape[0]:
            raise UserError(f"masked_loss got a mask of shape {tuple(mask.shape)} for a loss of shape "
                            f"{tuple(loss.shape)}; give a mask image [B, (C,) *image] or, for a [B, N, C] loss, [B, N]")
        weight = F.interpolate(image, size=loss.shape[2:], mode="area") if image.shape[2:] != loss.shape[2:] else image
    weight = weight.expand_as(loss)
    if normalise == "all":
        return (loss * weight).mean()
    return (loss * weight).sum() / weight.sum().clamp_min(1e-12)
