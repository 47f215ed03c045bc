"""Latents -> images: the autoencoder side of sampling.

Every decoder has ``decode(latents) -> images`` (also callable as ``decoder(latents)``):

* ``latents``: float tensor [N, C, h, w] as the diffusion model produces them (any device);
* ``images``:  **torch.uint8 tensor [N, H, W, 3] on the CPU** (NHWC, RGB, values 0..255), the layout of
  the ADM evaluation batches; ``.numpy()`` gives the array to store.

`IdentityDecoder` serves the embedded digits (the "latents" are the images themselves), `SDVAEDecoder`
the ImageNet latents of the Stable Diffusion VAE. `decoder_for(dataset_cfg)` picks the one a dataset needs.
"""
import os

import torch

from data.images import latents_to_uint8
from data.vae import QUANTIZE, SD_VAE_SCALE, decode_latents, load_sd_vae
from tread_utils.errors import UserError

DEFAULT_VAE = "stabilityai/sd-vae-ft-ema"


def _get(cfg, key, default=None):
    """cfg[key] for a dict or an OmegaConf node, `default` when absent or null."""
    if cfg is None:
        return default
    try:
        value = cfg.get(key, default)
    except AttributeError:
        value = getattr(cfg, key, default)
    return default if value is None else value


class IdentityDecoder:
    """Latents that are images in [-1, 1]: round((x + 1) * 127.5), clamped to [0, 255].

    One channel (the digits) is repeated to grey RGB; three channels are taken as RGB.
    """

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        return latents_to_uint8(latents.detach().cpu())

    __call__ = decode


class SDVAEDecoder:
    """Scaled SD-VAE latents (latent * scale, scale 0.18215) -> images, through diffusers' AutoencoderKL.

    `vae` is a local diffusers folder, a Hugging Face repo id looked up in the local cache first (see
    `data.vae.load_sd_vae`: offline without the weights this raises a one-line UserError), or an already
    loaded AutoencoderKL. The VAE is loaded at construction, so a missing one fails before any sampling.
    Decoding runs in chunks of `decode_batch_size` latents to bound memory.
    """

    def __init__(self, vae=DEFAULT_VAE, device="cpu", dtype=torch.float32, scale=None, decode_batch_size=32,
                 quantize="truncate", vae_option=None):
        if isinstance(vae, (str, os.PathLike)):  # vae_option: how the command names the VAE, for its errors
            vae = load_sd_vae(os.fspath(vae), device=device, dtype=dtype, option=vae_option)
        elif not isinstance(vae, torch.nn.Module):
            raise UserError(f"SDVAEDecoder needs a VAE path, a repo id or an AutoencoderKL, got {type(vae).__name__}")
        self.vae = vae
        self.scale = float(SD_VAE_SCALE if scale is None else scale)
        if decode_batch_size < 1:
            raise ValueError(f"decode_batch_size must be positive, got {decode_batch_size}")
        self.decode_batch_size = int(decode_batch_size)
        if quantize not in QUANTIZE:
            raise UserError(f"dataset.quantize must be one of {', '.join(QUANTIZE)}, got {quantize!r}")
        self.quantize = quantize

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        chunks = [decode_latents(self.vae, part, scale=self.scale, quantize=self.quantize)
                  for part in latents.detach().split(self.decode_batch_size)]
        return torch.cat(chunks) if chunks else torch.zeros(0, 0, 0, 3, dtype=torch.uint8)

    __call__ = decode


def decoder_for(dataset_cfg, vae=None, device="cpu", dtype=torch.float32, vae_option=None):
    """The decoder for a run's `dataset` config (a dict or an OmegaConf node).

    dataset.kind 'digits' -> IdentityDecoder; 'shards' -> SDVAEDecoder with, in order of precedence, the
    `vae` argument (path, repo id or loaded AutoencoderKL), `dataset.vae`, or stabilityai/sd-vae-ft-ema,
    and `dataset.quantize` (default truncate). The model's latents are SD-VAE latents times 0.18215 whatever
    the stored form (`dataset.scale_factor` only says how to get them there), so decoding divides by 0.18215.
    `vae_option`: how the calling command is given a VAE (e.g. `vae=DIR`), named by a VAE-not-found error.
    """
    kind = _get(dataset_cfg, "kind")
    if kind not in DECODERS:
        raise UserError(f"no decoder for dataset.kind {kind!r}; known kinds: {', '.join(DECODERS)}")
    return DECODERS[kind](dataset_cfg, vae, device, dtype, vae_option)


# dataset.kind -> decoder(dataset_cfg, vae, device, dtype, vae_option)
DECODERS = {
    "digits": lambda d, vae, device, dtype, vae_option: IdentityDecoder(),
    "shards": lambda d, vae, device, dtype, vae_option: SDVAEDecoder(
        vae if vae is not None else _get(d, "vae", DEFAULT_VAE), device=device, dtype=dtype,
        quantize=_get(d, "quantize", "truncate"), vae_option=vae_option),
}
