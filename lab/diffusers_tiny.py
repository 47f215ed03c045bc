"""Tiny random diffusers transformers of the routed families, with inputs, and the routed forward built by hand
that the hooks are compared with: for the tests and the SimpleTuner harness both. `build(name)` makes one; the
builders are in lab/diffusers_tiny_image_families.py, lab/diffusers_tiny_video_families.py and
lab/diffusers_tiny_sequence_families.py, and the tables here say how each family's blocks lay out their tokens."""
import inspect

import torch

from lab.diffusers_tiny_image_families import B  # noqa: F401  (the batch of every model's inputs, for the callers)
from lab.diffusers_tiny_image_families import (auraflow, chroma, flux, flux2, krea2, lumina2, pixart, qwen, sd3,
                                               zimage)
from lab.diffusers_tiny_sequence_families import ernie, minimax
from lab.diffusers_tiny_video_families import cosmos, hunyuan, kandinsky, ltx, ltx2, wan

FAMILIES = {"flux": flux, "flux2": flux2, "chroma": chroma, "qwen": qwen, "qwen_edit": lambda: qwen(True), "sd3": sd3,
            "pixart": pixart, "wan": wan, "ltx": ltx, "hunyuan": hunyuan, "auraflow": auraflow, "zimage": zimage,
            "lumina2": lumina2, "krea2": krea2, "cosmos": cosmos, "kandinsky": kandinsky, "ltx2": ltx2,
            "ltx2_split": lambda: ltx2(rope_type="split"), "ernie": ernie, "minimax": minimax}
FLUX_BLOCKS = ("transformer_blocks", "single_transformer_blocks")
BLOCK_LISTS = {"flux": FLUX_BLOCKS, "flux2": FLUX_BLOCKS, "chroma": FLUX_BLOCKS, "qwen": ("transformer_blocks",),
               "qwen_edit": ("transformer_blocks",), "sd3": ("transformer_blocks",),
               "pixart": ("transformer_blocks",), "wan": ("blocks",), "ltx": ("transformer_blocks",),
               "hunyuan": FLUX_BLOCKS,
               "auraflow": ("joint_transformer_blocks", "single_transformer_blocks"),
               "zimage": ("layers",), "lumina2": ("layers",), "krea2": ("transformer_blocks",),
               "cosmos": ("transformer_blocks",), "kandinsky": ("visual_transformer_blocks",),
               "ltx2": ("transformer_blocks",), "ltx2_split": ("transformer_blocks",),
               "ernie": ("layers",), "minimax": ("transformer_blocks",)}
VIDEO_FAMILIES = ("cosmos", "kandinsky", "ltx2", "ltx2_split")  # tread_diffusers/video_families.py's
PACKED = ("flux", "flux2", "chroma", "qwen", "qwen_edit", "ltx",  # inputs already tokens [B, N, C]
          "krea2", "ltx2", "ltx2_split", "minimax")
JOINT_ROPE = ("flux", "flux2", "chroma", "krea2")  # one RoPE table over the joint [text, image] sequence
TEXT_FIRST = ("krea2",)  # the text leads the image in every block's hidden_states
# the blocks' argument that holds the image tokens, where not hidden_states
TOKENS = {"zimage": "x", "kandinsky": "visual_embed", "ernie": "x"}
IMAGE_FIRST = ("hunyuan", "ltx2", "ltx2_split")  # blocks that return (image, other stream)
SECOND_STREAM = {"ltx2": "audio_hidden_states", "ltx2_split": "audio_hidden_states"}  # other than the text
CHANNELS_LAST = ("kandinsky",)  # latents [B, *grid, C]
ROPE_ATTENTION = {"kandinsky": ("self_attention", "rotary_emb"),  # where a block's RoPE reaches its attention
                  "ltx2": ("attn1", "query_rotary_emb")}
LORA_TARGETS = {"kandinsky": ["to_query", "to_key", "to_value"]}


def build(name, seed=0, **kw):
    torch.manual_seed(seed)
    return FAMILIES[name](**kw)


def blocks_of(name, model):
    return [block for attr in BLOCK_LISTS[name] for block in getattr(model, attr)]


def bound(module, args, kwargs) -> dict:
    return dict(inspect.signature(module.forward).bind(*args, **kwargs).arguments)


def capture_inputs(module):
    """A hook that keeps the (bound) keyword inputs of `module`'s latest call."""
    seen = {}
    handle = module.register_forward_pre_hook(lambda m, a, k: seen.update(bound(m, a, k)), with_kwargs=True)
    return seen, handle


class HandRope:
    """A per-sample table [B, S, head_dim] seen by diffusers' `cos[None, :, None, :]` as [B, S, 1, head_dim]."""

    def __init__(self, table):
        self.table = table

    def __getitem__(self, index):
        assert index == (None, slice(None), None, slice(None)), index
        return self.table.unsqueeze(2)

    def unsqueeze(self, dim):  # Qwen-Image's complex table, [B, S, head_dim / 2] as [B, S, 1, head_dim / 2]
        assert dim == 1
        return self.table.unsqueeze(2)


# -- the video families' inputs narrowed by hand (tread_diffusers/video_families.py) ------------------------
class HandRopeHeads(HandRope):
    """As HandRope, for attention that holds [B, heads, S, head_dim] (diffusers' `cos[None, None]`)."""

    def __getitem__(self, index):
        assert index == (None, None, slice(None), slice(None)), index
        return self.table.unsqueeze(1)


def _cosmos_by_hand(kw, keep, per_sample):
    """The video's RoPE rows [B, K, head_dim]; learnable positions and per-frame modulation [B, K, D]."""
    kw["image_rotary_emb"] = tuple(HandRopeHeads(per_sample(lambda b: t[keep[b]])) for t in kw["image_rotary_emb"])
    for key in ("extra_pos_emb", "embedded_timestep", "temb"):
        if kw[key].ndim == 3:
            kw[key] = per_sample(lambda b: kw[key][b, keep[b]])


def _kandinsky_by_hand(kw, keep, per_sample):
    """Its RoPE rotation matrices are per sample already, [B, N, 1, head_dim / 2, 2, 2]: the kept rows."""
    kw["rope"] = per_sample(lambda b: kw["rope"][b, keep[b]])


def _ltx2_by_hand(kw, keep, per_sample):
    """The video's RoPE rows (interleaved [B, N, dim], split [B, heads, N, head_dim / 2]), per-token modulations
    [B, N, k * D] and self-attention mask [B, N, N] at each sample's kept tokens."""
    for key in ("video_rotary_emb", "ca_video_rotary_emb"):
        kw[key] = tuple(per_sample(lambda b: t[b, keep[b]] if t.ndim == 3 else t[b][:, keep[b]]) for t in kw[key])
    for key in ("temb", "temb_ca_scale_shift", "temb_ca_gate"):
        if kw[key].shape[1] > 1:
            kw[key] = per_sample(lambda b: kw[key][b, keep[b]])
    if kw.get("self_attention_mask") is not None:
        kw["self_attention_mask"] = per_sample(lambda b: kw["self_attention_mask"][b][keep[b]][:, keep[b]])


VIDEO_HAND_NARROW = {"cosmos": _cosmos_by_hand, "kandinsky": _kandinsky_by_hand, "ltx2": _ltx2_by_hand,
                     "ltx2_split": _ltx2_by_hand}


def narrow_by_hand(name, kw, keep, lead, tail):
    """A routed block's other per-token inputs, written out sample by sample."""
    per_sample = lambda f: torch.stack([f(b) for b in range(keep.shape[0])])  # noqa: E731
    if name in VIDEO_HAND_NARROW:
        return VIDEO_HAND_NARROW[name](kw, keep, per_sample)
    if name.startswith("qwen"):  # the target's kept rows, then every reference row (the text's table whole)
        image, text = kw["image_rotary_emb"]
        n = image.shape[0] - tail
        kw["image_rotary_emb"] = (HandRope(per_sample(lambda b: torch.cat([image[keep[b]], image[n:]]))), text)
        if kw.get("modulate_index") is not None:  # the edit model's per-token modulation: target 0, reference 1
            index = kw["modulate_index"]
            kw["modulate_index"] = per_sample(lambda b: torch.cat([index[b, keep[b]], index[b, n:]]))
    if name in JOINT_ROPE:  # the joint sequence's rows: the text, then the kept image tokens
        text = kw["encoder_hidden_states"].shape[1] if kw.get("encoder_hidden_states") is not None else lead
        kw["image_rotary_emb"] = tuple(HandRope(per_sample(lambda b: torch.cat([t[:text], t[text:len(t) - tail][keep[b]],
                                                                                t[len(t) - tail:]])))
                                       for t in kw["image_rotary_emb"])  # FLUX Kontext's reference rows last
        if name == "krea2":  # its [B, 1, 1, text + N] mask
            mask = kw["attention_mask"]
            kw["attention_mask"] = per_sample(lambda b: torch.cat([mask[b][..., :text],
                                                                   mask[b][..., text:][..., keep[b]]], -1))
        elif kw.get("attention_mask") is not None:  # Chroma's [B, text + N] mask
            kw["attention_mask"] = per_sample(lambda b: torch.cat([kw["attention_mask"][b, :text],
                                                                    kw["attention_mask"][b, text:][keep[b]]]))
    if name == "hunyuan":  # the video's RoPE rows [B, K, head_dim]; the mask [B, 1, 1, N + T], video first
        key = "freqs_cis" if "freqs_cis" in kw else "image_rotary_emb"
        kw[key] = tuple(HandRope(per_sample(lambda b: t[keep[b]])) for t in kw[key])
        mask, text = kw["attention_mask"], kw["encoder_hidden_states"].shape[1]
        kw["attention_mask"] = per_sample(lambda b: torch.cat([mask[b][..., :-text][..., keep[b]],
                                                               mask[b][..., -text:]], -1))
    if name == "ltx":  # per-sample RoPE [B, N, dim] and, with per-token timesteps, temb [B, N, 6 * dim]
        kw["image_rotary_emb"] = tuple(per_sample(lambda b: t[b, keep[b]]) for t in kw["image_rotary_emb"])
        if kw["temb"].shape[1] > 1:
            kw["temb"] = per_sample(lambda b: kw["temb"][b, keep[b]])
    if name == "zimage":  # per-sample complex RoPE [B, L, head_dim / 2] and mask [B, L]: kept rows, then the tail's
        for k in ("freqs_cis", "attn_mask"):
            if kw.get(k) is not None:
                kw[k] = per_sample(lambda b: torch.cat([kw[k][b, keep[b]], kw[k][b, kw[k].shape[1] - tail:]]))
    if name == "wan":
        kw["rotary_emb"] = tuple(per_sample(lambda b: t[0, keep[b]]) for t in kw["rotary_emb"])
        if kw["temb"].ndim == 4:  # Wan 2.2's per-token timestep
            kw["temb"] = per_sample(lambda b: kw["temb"][b, keep[b]])


def reference_forward(name, model, inputs, keep, start, end, n):
    """Run the blocks from `start` by hand: gather the kept image tokens (of `n`) and their per-token inputs
    before `start`, scatter them back after `end`; returns the last block's output tokens (text first where the
    single-stream blocks carry it; reference-image tokens after the target). The other inputs of each block
    come from an unrouted pass."""
    blocks = blocks_of(name, model)
    captured = [capture_inputs(block) for block in blocks]
    with torch.no_grad():
        model(**inputs)
    for _, handle in captured:
        handle.remove()
    seen = [dict(s) for s, _ in captured]
    key = TOKENS.get(name, "hidden_states")  # the blocks' argument that holds the image tokens
    tail = seen[0][key].shape[1] - n - (inputs["encoder_hidden_states"].shape[1] if name in TEXT_FIRST else 0)
    rows = torch.arange(keep.shape[0])[:, None]
    lead = seen[start][key].shape[1] - n - tail
    x = seen[start][key]
    x_full = x[:, lead:lead + n]
    x = torch.cat([x[:, :lead], x_full[rows, keep], x[:, lead + n:]], 1)
    stream = SECOND_STREAM.get(name, "encoder_hidden_states")  # the other stream a block updates and returns
    text = seen[start].get(stream)
    for i in range(start, len(blocks)):
        kw = dict(seen[i])
        if kw[key].shape[1] > n + tail and not lead:  # text and image joined for single-stream blocks
            x, lead = torch.cat([text, x], 1), kw[key].shape[1] - n - tail
        kw[key] = x
        if kw.get(stream) is not None:
            kw[stream] = text
        if start <= i <= end:
            narrow_by_hand(name, kw, keep, lead, tail)
        out = blocks[i](**kw)
        if isinstance(out, tuple):  # (text, image); HunyuanVideo (image, text), LTX-2 (video, audio)
            out, other = (out[0], out[1]) if name in IMAGE_FIRST else (out[1], out[0])
            text = text if other is None else other
        x = out
        if i == end:
            full = x_full.clone()
            full[rows, keep] = x[:, lead:lead + keep.shape[1]]
            x = torch.cat([x[:, :lead], full, x[:, lead + keep.shape[1]:]], 1)
    return x
