"""The Stable Diffusion VAE (diffusers AutoencoderKL): loading, encoding to posterior moments, decoding.

Shared by data/extract_latents.py (images -> moments) and sampling (scaled latents -> uint8 images).
Latents seen by the diffusion model are VAE samples multiplied by SD_VAE_SCALE; stored moments are not.
The ft-EMA / ft-MSE checkpoints only fine-tuned the decoder, so their encoder equals the original kl-f8.
"""
import contextlib
import logging
import os
import warnings

import torch

from tread_utils.errors import UserError
from tread_utils.hub import hub_unavailable

SD_VAE_SCALE = 0.18215
DEFAULT_VAE = "stabilityai/sd-vae-ft-ema"
LOGVAR_MIN, LOGVAR_MAX = -30.0, 20.0  # the clamp of diffusers' DiagonalGaussianDistribution


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".strip()


@contextlib.contextmanager
def _quiet_hub():
    """Silence hub/diffusers warnings and retry logs while loading: failures become one UserError line."""
    loggers = [logging.getLogger(n) for n in ("huggingface_hub", "diffusers")]
    levels = [lg.level for lg in loggers]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for lg in loggers:
            lg.setLevel(logging.ERROR)
        try:
            yield
        finally:
            for lg, level in zip(loggers, levels):
                lg.setLevel(level)


def vae_folder_hint(option) -> str:
    """The fix a VAE error offers, in the calling command's spelling of the option (`--vae DIR`, `vae=DIR`)."""
    return f"pass a local diffusers folder holding config.json and the weights{f' with {option}' if option else ''}"


def vae_source(name_or_path, option=None) -> tuple:
    """(the name with ~ expanded, whether it is a local folder): a diffusers folder (with config.json) or a
    Hugging Face repo id like stabilityai/sd-vae-ft-ema; anything else is one line naming `option`."""
    name = os.path.expanduser(os.fspath(name_or_path))
    if os.path.isdir(name):
        if not os.path.isfile(os.path.join(name, "config.json")):
            raise UserError(f"VAE folder {name} has no config.json; {vae_folder_hint(option)}")
        return name, True
    if os.path.exists(name) or name.startswith((".", "/")) or name.count("/") != 1:
        raise UserError(f"VAE {name!r} is neither a diffusers folder nor a Hugging Face repo id like {DEFAULT_VAE}; "
                        f"{vae_folder_hint(option)}")
    return name, False


def load_sd_vae(name_or_path: str = DEFAULT_VAE, device="cpu", dtype=torch.float32, option=None):
    """Return a frozen diffusers AutoencoderKL in eval mode on `device`.

    `name_or_path` is a local diffusers folder (config.json + weights) or a Hugging Face repo id. A repo id is
    looked up in the local cache first (works offline); only when it is missing there and the hub can be tried
    (not marked offline with HF_HUB_OFFLINE=1, and reachable within seconds) is a download attempted.
    `option`: how the calling command is given a VAE (`--vae DIR`, `vae=DIR`, `dataset.vae=DIR`): the errors
    name it, so that the fix they suggest is one that command accepts.
    """
    try:
        from diffusers import AutoencoderKL
    except ImportError:
        raise UserError("the SD-VAE needs the diffusers package; install it with `pip install diffusers`") from None
    name_or_path, is_folder = vae_source(name_or_path, option)
    folder = vae_folder_hint(option)
    if is_folder:
        try:
            with _quiet_hub():
                vae = AutoencoderKL.from_pretrained(name_or_path, torch_dtype=dtype)
        except (OSError, ValueError, RuntimeError, KeyError) as e:
            raise UserError(f"cannot load the VAE from {name_or_path} ({_first_line(e)}); download "
                            f"{DEFAULT_VAE} with `hf download {DEFAULT_VAE}`, or {folder}") from None
    else:
        vae, err = None, None
        for local_only in (True, False):
            if not local_only and hub_unavailable():  # offline or no connection: no half minute of retries
                break
            try:
                with _quiet_hub():
                    vae = AutoencoderKL.from_pretrained(name_or_path, torch_dtype=dtype, local_files_only=local_only)
                break
            except Exception as e:  # hub/network errors come in many types; all mean "weights not available"
                err = e
        if vae is None:
            why = hub_unavailable()
            where = f"the Hugging Face cache ({why})" if why else "the Hugging Face cache or the hub"
            raise UserError(f"VAE weights for {name_or_path} are not available from {where} ({_first_line(err)}); "
                            f"download them with `huggingface-cli download {name_or_path}` on a machine with "
                            f"network access (set HF_HOME to share the cache), or {folder}") from None
    vae.eval().requires_grad_(False)
    return vae.to(device)


# The architecture of stabilityai/sd-vae-ft-ema (its config.json), for benchmarks without the weights.
SD_VAE_ARCHITECTURE = dict(in_channels=3, out_channels=3, latent_channels=4, layers_per_block=2, norm_num_groups=32,
                           block_out_channels=(128, 256, 512, 512), down_block_types=("DownEncoderBlock2D",) * 4,
                           up_block_types=("UpDecoderBlock2D",) * 4, act_fn="silu", sample_size=256)


def random_sd_vae(device="cpu", seed=0):
    """The SD-VAE's exact architecture with seeded random weights: its speed, none of its images."""
    from diffusers import AutoencoderKL

    torch.manual_seed(seed)
    return AutoencoderKL(**SD_VAE_ARCHITECTURE).eval().requires_grad_(False).to(device)


def vae_downsample_factor(vae) -> int:
    return 2 ** (len(vae.config.block_out_channels) - 1)


@torch.no_grad()
def encode_moments(vae, images: torch.Tensor):
    """images float NCHW in [-1, 1] -> (mean, logvar), each [N, latent_channels, H/f, W/f], unscaled."""
    param = next(vae.parameters())
    dist = vae.encode(images.to(device=param.device, dtype=param.dtype)).latent_dist
    return dist.mean, dist.logvar.clamp(LOGVAR_MIN, LOGVAR_MAX)


QUANTIZE = ("truncate", "round")


@torch.no_grad()
def decode_latents(vae, latents_scaled: torch.Tensor, scale: float = SD_VAE_SCALE,
                   quantize: str = "truncate") -> torch.Tensor:
    """Scaled latents [N, C, h, w] -> uint8 images [N, H, W, 3] on the CPU.

    `quantize`: "truncate" maps [-1, 1] to [0, 1], clamps and truncates 255 x (the authors' decoder and
    ADM's sampling script); "round" rounds (x + 1) * 127.5 to the nearest level instead."""
    assert quantize in QUANTIZE, f"quantize {quantize!r}: refused where it was given (SDVAEDecoder, the config check)"
    param = next(vae.parameters())
    x = vae.decode(latents_scaled.to(device=param.device, dtype=param.dtype) / scale).sample.float()
    if quantize == "truncate":
        x = (((x + 1.0) / 2.0).clamp(0, 1) * 255).to(torch.uint8)
    else:
        x = ((x + 1.0) * 127.5).clamp(0, 255).round().to(torch.uint8)
    return x.permute(0, 2, 3, 1).contiguous().cpu()
