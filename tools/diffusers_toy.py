"""Shared by tools/finetune_lora.py and lab/bench_diffusers.py: random FLUX- and SD3-architecture
transformers, a tiny fixed text encoder, the flow-matching training step those models train with, and the
timing / FLOP-bound measurement of a routed against an unrouted step."""
import statistics
import time
from contextlib import nullcontext

import torch
import torch.nn as nn
from torch.utils.flop_counter import FlopCounterMode

from tread_diffusers import apply_tread

CLASS_NAMES = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")


class FixedTextEncoder(nn.Module):
    """Letters -> a frozen random embedding plus a sinusoidal position, one token per letter (names padded to
    the longest); the pooled vector is the mean over the name's letters. Seeded: the same on every run."""

    def __init__(self, dim: int, pooled_dim: int, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.length = max(map(len, CLASS_NAMES))
        self.register_buffer("letters", torch.randn(27, dim, generator=g))  # row 0: padding
        pos = torch.arange(self.length)[:, None] / 10000 ** (torch.arange(0, dim, 2) / dim)
        self.register_buffer("position", torch.cat([pos.sin(), pos.cos()], 1)[:, :dim])
        self.register_buffer("pool", torch.randn(dim, pooled_dim, generator=g) / dim ** 0.5)

    @torch.no_grad()
    def forward(self, labels: torch.Tensor):
        """Text tokens [B, L, dim] and pooled [B, pooled_dim] for class labels [B]."""
        codes = torch.zeros(len(CLASS_NAMES), self.length, dtype=torch.long)
        for i, name in enumerate(CLASS_NAMES):
            codes[i, :len(name)] = torch.tensor([ord(c) - 96 for c in name])
        codes = codes.to(labels.device)[labels]
        present = (codes > 0).float()[..., None]
        tokens = (self.letters[codes] + self.position) * present
        pooled = (tokens.sum(1) / present.sum(1)) @ self.pool
        return tokens, pooled


def pack(latents: torch.Tensor) -> torch.Tensor:
    """FLUX's 2x2 packing: [B, C, H, W] -> [B, (H/2)(W/2), 4C], rows of tokens in row-major order."""
    b, c, h, w = latents.shape
    return latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(b, (h // 2) * (w // 2), c * 4)


def image_ids(h: int, w: int, axes: int = 3) -> torch.Tensor:
    ids = torch.zeros(h, w, axes)
    ids[..., 1], ids[..., 2] = torch.arange(h)[:, None], torch.arange(w)[None]
    return ids.reshape(-1, axes)


def random_flux(channels: int, width: int, heads: int, dual: int, single: int, text_dim: int, seed: int = 0):
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(seed)
    head_dim = width // heads
    axes = (head_dim - 2 * (3 * head_dim // 8), 3 * head_dim // 8, 3 * head_dim // 8)
    return FluxTransformer2DModel(patch_size=1, in_channels=channels * 4, num_layers=dual, num_single_layers=single,
                                  attention_head_dim=head_dim, num_attention_heads=heads, joint_attention_dim=text_dim,
                                  pooled_projection_dim=text_dim, axes_dims_rope=axes)


def random_sd3(channels: int, width: int, heads: int, depth: int, text_dim: int, resolution: int, seed: int = 0):
    from diffusers import SD3Transformer2DModel

    torch.manual_seed(seed)
    return SD3Transformer2DModel(sample_size=resolution, patch_size=2, in_channels=channels, num_layers=depth,
                                 attention_head_dim=width // heads, num_attention_heads=heads,
                                 joint_attention_dim=text_dim, caption_projection_dim=width,
                                 pooled_projection_dim=text_dim, out_channels=channels,
                                 pos_embed_max_size=resolution // 2)


def model_inputs(model, x_t: torch.Tensor, text: torch.Tensor, pooled: torch.Tensor, t: torch.Tensor) -> dict:
    """The forward keywords of noisy latents `x_t` at times `t` in [0, 1]: SD3 takes latents and t * 1000; FLUX,
    FLUX.2, Chroma and Qwen-Image packed tokens of a square-ish grid, with their position inputs, and t; LTX-Video
    video latents as tokens (LTX-2 beside random audio tokens); HunyuanVideo and Cosmos video latents; Kandinsky 5
    channels-last video latents; Z-Image one-frame latents; Krea2 packed tokens after the text, with their
    positions; Lumina2 latents after captions of two lengths (a padded batch)."""
    # the diffusers class (FSDP2's `fully_shard` makes the model an instance of a subclass, FSDP<class>)
    name = next((c.__name__ for c in type(model).__mro__ if c.__module__.startswith("diffusers.")),
                type(model).__name__)
    if name == "ErnieImageTransformer2DModel":  # latents [B, C, H, W], text [B, T, D] all real, t * 1000
        return dict(hidden_states=x_t, timestep=t * 1000, text_bth=text,
                    text_lens=torch.full((len(t),), text.shape[1], device=x_t.device))
    if name == "MiniMaxH3Transformer3DModel":
        return minimax_inputs(x_t, text, t, audio=16, audio_channels=model.config.audio_in_channels)
    if name == "LTXVideoTransformer3DModel":  # video latents [B, C, F, H, W] as tokens (patch 1), t * 1000
        frames, rows, columns = x_t.shape[2:]
        return dict(hidden_states=x_t.flatten(2).transpose(1, 2), encoder_hidden_states=text, timestep=t * 1000,
                    encoder_attention_mask=text.new_ones(text.shape[:2]), num_frames=frames, height=rows,
                    width=columns)
    if name == "ZImageTransformer2DModel":  # latents [B, C, 1, H, W] (one frame), t in [0, 1]
        return dict(x=x_t[:, :, None], cap_feats=text, t=t)
    if name == "Lumina2Transformer2DModel":  # latents [B, C, H, W], t in [0, 1]; every other caption 4 tokens shorter
        lengths = text.shape[1] - 4 * (torch.arange(len(t), device=text.device) % 2)
        return dict(hidden_states=x_t, timestep=t, encoder_hidden_states=text,
                    encoder_attention_mask=torch.arange(text.shape[1], device=text.device)[None] < lengths[:, None])
    if name in ("PixArtTransformer2DModel", "AuraFlowTransformer2DModel", "WanTransformer3DModel"):  # latents, t * 1000
        return dict(hidden_states=x_t, encoder_hidden_states=text, timestep=t * 1000)
    if name == "SD3Transformer2DModel":
        return dict(hidden_states=x_t, encoder_hidden_states=text, pooled_projections=pooled, timestep=t * 1000)
    if name == "LTX2VideoTransformer3DModel":  # video latents as tokens beside 16 random audio tokens, t * 1000
        frames, rows, columns = x_t.shape[2:]
        audio = torch.randn(len(t), 16, model.config.audio_in_channels, device=x_t.device)
        return dict(hidden_states=x_t.flatten(2).transpose(1, 2), audio_hidden_states=audio,
                    encoder_hidden_states=text, audio_encoder_hidden_states=text, timestep=t * 1000, sigma=t,
                    num_frames=frames, height=rows, width=columns, audio_num_frames=audio.shape[1])
    if name == "Kandinsky5Transformer3DModel":  # channels-last latents [B, F, H, W, C] as they are, t * 1000
        frames, rows, columns = (size // p for size, p in zip(x_t.shape[1:4], model.config.patch_size))
        return dict(hidden_states=x_t, encoder_hidden_states=text, timestep=t * 1000, pooled_projections=pooled,
                    visual_rope_pos=tuple(torch.arange(n, device=x_t.device) for n in (frames, rows, columns)),
                    text_rope_pos=torch.arange(text.shape[1], device=x_t.device))
    if name == "CosmosTransformer3DModel":  # video latents [B, C, F, H, W] as they are, t
        return dict(hidden_states=x_t, encoder_hidden_states=text, timestep=t)
    if name == "HunyuanVideoTransformer3DModel":  # video latents [B, C, F, H, W] as they are, t * 1000
        return dict(hidden_states=x_t, encoder_hidden_states=text, pooled_projections=pooled, timestep=t * 1000,
                    encoder_attention_mask=text.new_ones(text.shape[:2]))
    rows = int(round(x_t.shape[1] ** 0.5))
    columns = x_t.shape[1] // rows
    if name == "Krea2Transformer2DModel":  # text [B, T, text layers = 1, D]; positions of [text, image], text at 0
        ids = torch.cat([text.new_zeros(text.shape[1], 3), image_ids(rows, columns).to(text)])
        return dict(hidden_states=x_t, encoder_hidden_states=text[:, :, None], timestep=t, position_ids=ids)
    if name == "QwenImageTransformer2DModel":
        return dict(hidden_states=x_t, encoder_hidden_states=text, timestep=t,
                    img_shapes=[[(1, rows, columns)]] * len(t))
    axes = len(model.config.axes_dims_rope)
    inputs = dict(hidden_states=x_t, encoder_hidden_states=text, timestep=t,
                  img_ids=image_ids(rows, columns, axes).to(x_t.device), txt_ids=text.new_zeros(text.shape[1], axes))
    if name == "FluxTransformer2DModel":
        guidance = torch.ones_like(t) if model.config.guidance_embeds else None  # FLUX.1-dev
        inputs.update(pooled_projections=pooled, guidance=guidance)
    return inputs


def minimax_inputs(x_t: torch.Tensor, text: torch.Tensor, t: torch.Tensor, audio: int, audio_channels: int) -> dict:
    """MiniMax H3's text-to-video-and-audio layout, [text | audio | video], of video latents [B, C, F, H, W] as rows
    (patch 1) beside random audio rows. Its batch shares one layout, timesteps included: every row is at the
    first sample's t (a bench times the step; the other samples' loss is not the flow-matching one)."""
    frames, rows, columns = x_t.shape[2:]
    n, text_len = frames * rows * columns, text.shape[1]
    length = text_len + audio + n
    grid = torch.stack(torch.meshgrid(*(torch.arange(g) for g in (frames, rows, columns)), indexing="ij"), -1)
    sequence = torch.arange(text_len + audio)[:, None] * torch.tensor([1, 0, 0])
    return dict(hidden_states=x_t.flatten(2).transpose(1, 2),
                audio_hidden_states=torch.randn(len(t), audio, audio_channels, device=x_t.device),
                encoder_hidden_states=text, timestep=t[:1], timestep_indices=torch.zeros(length, dtype=torch.long),
                token_tags=torch.tensor([1] * text_len + [2] * audio + [0] * n),
                position_ids=torch.cat([sequence, grid.reshape(n, 3)]),
                video_indices=torch.arange(text_len + audio, length),
                audio_indices=torch.arange(text_len, text_len + audio), text_indices=torch.arange(text_len))


def flow_matching_loss(model, latents: torch.Tensor, text: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
    """Rectified flow as FLUX and SD3 train: x_t = (1 - t) x0 + t noise with t from a logit-normal, the
    model predicts the velocity noise - x0."""
    b = latents.shape[0]
    t = torch.sigmoid(torch.randn(b, device=latents.device))
    noise = torch.randn_like(latents)
    x_t = (1 - t.view(-1, *[1] * (latents.ndim - 1))) * latents + t.view(-1, *[1] * (latents.ndim - 1)) * noise
    x_t = x_t.to(latents.dtype)  # a bf16 model's latents stay bf16 (t is float32)
    pred = model(**model_inputs(model, x_t, text, pooled, t), return_dict=False)
    pred = pred if isinstance(pred, torch.Tensor) else pred[0]  # Kandinsky 5 returns the bare tensor
    if isinstance(pred, list):  # Z-Image: [C, 1, H, W] per sample
        pred = torch.stack(pred).reshape(latents.shape)
    if pred.shape != latents.shape:  # tokens [B, N, C] of latents [B, C, *grid] (LTX-Video, LTX-2)
        pred = pred.transpose(1, 2).reshape(latents.shape)
    return (pred.float() - (noise - latents).float()).square().mean()


def step_flops(model, batch) -> int:
    """FLOPs of one training step's forward + backward (torch.utils.flop_counter), as the model routes now; a
    compiled model's, counted eagerly (its compiled graphs run their Python code instead)."""
    eager = torch.compiler.set_stance("force_eager") if hasattr(torch.compiler, "set_stance") else nullcontext()
    with eager, FlopCounterMode(display=False) as counter:
        flow_matching_loss(model, *batch).backward()
    model.zero_grad(set_to_none=True)
    return counter.get_total_flops()


def training_step(model, batch_fn, optimizer):
    """One training step as a closure: the flow-matching loss on a new batch, backward, the optimizer's step."""
    def step():
        torch.compiler.cudagraph_mark_step_begin()  # a new step for CUDA graphs (compile mode reduce-overhead)
        optimizer.zero_grad(set_to_none=True)
        flow_matching_loss(model, *batch_fn()).backward()
        optimizer.step()
    return step


def routed_vs_unrouted(model, routes, batch_fn, optimizer, rounds: int = 5, steps: int = 3, flops=None) -> dict:
    """Median step time (forward, backward, optimizer step) routed and unrouted, alternating `rounds` blocks of
    `steps` steps each so both see the same machine load, with the FLOP bound unrouted / routed. On a GPU each
    step ends with a synchronisation: its time is the GPU's or the host's, whichever is longer. `flops`
    ({False: unrouted, True: routed}) skips the counting (a compiled model's counts are its eager ones)."""
    cuda = next(model.parameters()).is_cuda
    step = training_step(model, batch_fn, optimizer)

    def one_step():
        step()
        if cuda:
            torch.cuda.synchronize()

    model.train()
    counted, times = dict(flops or {}), {True: [], False: []}
    for routed in (False, True):
        handle = apply_tread(model, routes) if routed else None
        if routed not in counted:
            counted[routed] = step_flops(model, batch_fn())
        one_step()  # warm-up
        if handle:
            handle.remove()
    for _ in range(rounds):
        for routed in (False, True):
            handle = apply_tread(model, routes) if routed else None
            for _ in range(steps):
                start = time.perf_counter()
                one_step()
                times[routed].append(time.perf_counter() - start)
            if handle:
                handle.remove()
    unrouted, routed = statistics.median(times[False]), statistics.median(times[True])
    bound, speedup = counted[False] / counted[True], unrouted / routed
    return dict(unrouted_step_s=unrouted, routed_step_s=routed, speedup=speedup, flops_unrouted=counted[False],
                flops_routed=counted[True], flop_bound=bound, speedup_vs_bound=speedup / bound,
                timed_steps_each=rounds * steps)
