"""Tiny random diffusers transformers of the routed families, with inputs, for the TREAD checks, and the
routed forward built by hand that the hooks are compared with."""
import inspect

import torch

B = 2


def _flux_ids(h, w, text, axes):
    """Packed-latent position ids: (rows, columns) at axes 1 and 2, zeros elsewhere; the text at the origin."""
    ids = torch.zeros(h, w, axes)
    ids[..., 1], ids[..., 2] = torch.arange(h)[:, None], torch.arange(w)[None]
    return ids.reshape(-1, axes), torch.zeros(text, axes)


def flux(layers=2, single_layers=2):
    from diffusers import FluxTransformer2DModel

    model = FluxTransformer2DModel(patch_size=1, in_channels=4, num_layers=layers, num_single_layers=single_layers,
                                   attention_head_dim=8, num_attention_heads=2, joint_attention_dim=16,
                                   pooled_projection_dim=16, axes_dims_rope=(2, 2, 4))
    h, w = 4, 6
    img_ids, txt_ids = _flux_ids(h, w, 5, 3)
    inputs = dict(hidden_states=torch.randn(B, h * w, 4), encoder_hidden_states=torch.randn(B, 5, 16),
                  pooled_projections=torch.randn(B, 16), timestep=torch.rand(B), img_ids=img_ids,
                  txt_ids=txt_ids, return_dict=False)
    return model, inputs, (h, w)


def flux2(layers=2, single_layers=2):
    from diffusers import Flux2Transformer2DModel

    model = Flux2Transformer2DModel(patch_size=1, in_channels=4, num_layers=layers, num_single_layers=single_layers,
                                    attention_head_dim=8, num_attention_heads=2, joint_attention_dim=16,
                                    timestep_guidance_channels=16, axes_dims_rope=(2, 2, 2, 2), guidance_embeds=False)
    h, w = 4, 6
    img_ids, txt_ids = _flux_ids(h, w, 5, 4)
    txt_ids[:, 3] = torch.arange(5)  # FLUX.2 numbers the text tokens on its fourth axis
    inputs = dict(hidden_states=torch.randn(B, h * w, 4), encoder_hidden_states=torch.randn(B, 5, 16),
                  timestep=torch.rand(B), img_ids=img_ids, txt_ids=txt_ids, return_dict=False)
    return model, inputs, (h, w)


def chroma(layers=2, single_layers=2):
    from diffusers import ChromaTransformer2DModel

    model = ChromaTransformer2DModel(patch_size=1, in_channels=4, num_layers=layers, num_single_layers=single_layers,
                                     attention_head_dim=8, num_attention_heads=2, joint_attention_dim=16,
                                     axes_dims_rope=(2, 2, 4), approximator_num_channels=16,
                                     approximator_hidden_dim=32, approximator_layers=1)
    h, w = 4, 6
    img_ids, txt_ids = _flux_ids(h, w, 5, 3)
    inputs = dict(hidden_states=torch.randn(B, h * w, 4), encoder_hidden_states=torch.randn(B, 5, 16),
                  timestep=torch.rand(B), img_ids=img_ids, txt_ids=txt_ids, return_dict=False)
    return model, inputs, (h, w)


def qwen(references=False):
    """Qwen-Image; with `references`, the edit model (zero_cond_t), a reference image's tokens after the target's."""
    from diffusers import QwenImageTransformer2DModel

    model = QwenImageTransformer2DModel(patch_size=2, in_channels=16, out_channels=4, num_layers=3,
                                        attention_head_dim=8, num_attention_heads=2, joint_attention_dim=16,
                                        axes_dims_rope=(2, 2, 4),
                                        zero_cond_t=references)
    h, w = 4, 6
    shapes = [(1, h, w), (1, 2, 3)] if references else [(1, h, w)]
    tokens = sum(f * r * c for f, r, c in shapes)
    inputs = dict(hidden_states=torch.randn(B, tokens, 16), encoder_hidden_states=torch.randn(B, 5, 16),
                  encoder_hidden_states_mask=torch.ones(B, 5), timestep=torch.rand(B), img_shapes=[shapes] * B,
                  return_dict=False)
    return model, inputs, (h, w)


def sd3():
    from diffusers import SD3Transformer2DModel

    model = SD3Transformer2DModel(sample_size=8, patch_size=2, in_channels=4, num_layers=4, attention_head_dim=8,
                                  num_attention_heads=2, joint_attention_dim=16, caption_projection_dim=16,
                                  pooled_projection_dim=16, out_channels=4, pos_embed_max_size=16)
    inputs = dict(hidden_states=torch.randn(B, 4, 8, 8), encoder_hidden_states=torch.randn(B, 5, 16),
                  pooled_projections=torch.randn(B, 16), timestep=torch.rand(B) * 1000, return_dict=False)
    return model, inputs, (4, 4)


def pixart():
    from diffusers import PixArtTransformer2DModel

    model = PixArtTransformer2DModel(sample_size=8, num_layers=4, patch_size=2, attention_head_dim=8,
                                     num_attention_heads=2, in_channels=4, out_channels=8, cross_attention_dim=16,
                                     caption_channels=16, norm_type="ada_norm_single", use_additional_conditions=False)
    inputs = dict(hidden_states=torch.randn(B, 4, 8, 8), encoder_hidden_states=torch.randn(B, 5, 16),
                  timestep=torch.randint(0, 1000, (B,)), return_dict=False)
    return model, inputs, (4, 4)


def wan(frames=1):
    from diffusers import WanTransformer3DModel

    model = WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=4,
                                  out_channels=4, text_dim=16, freq_dim=32, ffn_dim=32, num_layers=4,
                                  rope_max_seq_len=32)
    inputs = dict(hidden_states=torch.randn(B, 4, frames, 8, 8), encoder_hidden_states=torch.randn(B, 5, 16),
                  timestep=torch.randint(0, 1000, (B,)), return_dict=False)
    return model, inputs, (frames, 4, 4)


def ltx(frames=2):
    from diffusers import LTXVideoTransformer3DModel

    model = LTXVideoTransformer3DModel(in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=12,
                                       cross_attention_dim=24, num_layers=4, caption_channels=16)
    h, w = 4, 3
    inputs = dict(hidden_states=torch.randn(B, frames * h * w, 4), encoder_hidden_states=torch.randn(B, 5, 16),
                  timestep=torch.randint(0, 1000, (B,)), encoder_attention_mask=torch.ones(B, 5), num_frames=frames,
                  height=h, width=w, return_dict=False)
    return model, inputs, (frames, h, w)


def hunyuan(frames=2, image_condition_type=None):
    from diffusers import HunyuanVideoTransformer3DModel

    model = HunyuanVideoTransformer3DModel(in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=8,
                                           num_layers=2, num_single_layers=2, num_refiner_layers=1, patch_size=2,
                                           patch_size_t=1, guidance_embeds=False, text_embed_dim=16,
                                           pooled_projection_dim=16, rope_axes_dim=(2, 2, 4),
                                           image_condition_type=image_condition_type)
    text_mask = torch.ones(B, 5)
    text_mask[1, 3:] = 0  # the second sample's text is padded
    inputs = dict(hidden_states=torch.randn(B, 4, frames, 8, 6), timestep=torch.randint(0, 1000, (B,)),
                  encoder_hidden_states=torch.randn(B, 5, 16), encoder_attention_mask=text_mask,
                  pooled_projections=torch.randn(B, 16), return_dict=False)
    return model, inputs, (frames, 4, 3)


def auraflow():
    from diffusers import AuraFlowTransformer2DModel

    model = AuraFlowTransformer2DModel(sample_size=8, patch_size=2, in_channels=4, num_mmdit_layers=2,
                                       num_single_dit_layers=2, attention_head_dim=8, num_attention_heads=2,
                                       joint_attention_dim=16, caption_projection_dim=16, out_channels=4,
                                       pos_embed_max_size=16)
    inputs = dict(hidden_states=torch.randn(B, 4, 8, 8), encoder_hidden_states=torch.randn(B, 5, 16),
                  timestep=torch.rand(B) * 1000, return_dict=False)
    return model, inputs, (4, 4)


FAMILIES = {"flux": flux, "flux2": flux2, "chroma": chroma, "qwen": qwen, "qwen_edit": lambda: qwen(True), "sd3": sd3,
            "pixart": pixart, "wan": wan, "ltx": ltx, "hunyuan": hunyuan, "auraflow": auraflow}
FLUX_BLOCKS = ("transformer_blocks", "single_transformer_blocks")
BLOCK_LISTS = {"flux": FLUX_BLOCKS, "flux2": FLUX_BLOCKS, "chroma": FLUX_BLOCKS, "qwen": ("transformer_blocks",),
               "qwen_edit": ("transformer_blocks",), "sd3": ("transformer_blocks",),
               "pixart": ("transformer_blocks",), "wan": ("blocks",), "ltx": ("transformer_blocks",),
               "hunyuan": FLUX_BLOCKS,
               "auraflow": ("joint_transformer_blocks", "single_transformer_blocks")}


def build(name, seed=0, **kw):
    torch.manual_seed(seed)
    return FAMILIES[name](**kw)


def blocks_of(name, model):
    return [block for attr in BLOCK_LISTS[name] for block in getattr(model, attr)]


PACKED = ("flux", "flux2", "chroma", "qwen", "qwen_edit", "ltx")  # inputs already tokens [B, N, C]
JOINT_ROPE = ("flux", "flux2", "chroma")  # one RoPE table over the joint [text, image] sequence


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


def narrow_by_hand(name, kw, keep, lead, tail):
    """A routed block's other per-token inputs, written out sample by sample."""
    per_sample = lambda f: torch.stack([f(b) for b in range(keep.shape[0])])  # noqa: E731
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
        if kw.get("attention_mask") is not None:  # Chroma's [B, text + N] mask
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
    tail = seen[0]["hidden_states"].shape[1] - n  # the first block holds the image and its references alone
    rows = torch.arange(keep.shape[0])[:, None]
    lead = seen[start]["hidden_states"].shape[1] - n - tail
    x = seen[start]["hidden_states"]
    x_full = x[:, lead:lead + n]
    x = torch.cat([x[:, :lead], x_full[rows, keep], x[:, lead + n:]], 1)
    text = seen[start].get("encoder_hidden_states")
    for i in range(start, len(blocks)):
        kw = dict(seen[i])
        if kw["hidden_states"].shape[1] > n + tail and not lead:  # text and image joined for single-stream blocks
            x, lead = torch.cat([text, x], 1), kw["hidden_states"].shape[1] - n - tail
        kw["hidden_states"] = x
        if kw.get("encoder_hidden_states") is not None:
            kw["encoder_hidden_states"] = text
        if start <= i <= end:
            narrow_by_hand(name, kw, keep, lead, tail)
        out = blocks[i](**kw)
        if isinstance(out, tuple):  # (text, image); HunyuanVideo (image, text)
            out, other = (out[0], out[1]) if name == "hunyuan" else (out[1], out[0])
            text = text if other is None else other
        x = out
        if i == end:
            full = x_full.clone()
            full[rows, keep] = x[:, lead:lead + keep.shape[1]]
            x = torch.cat([x[:, :lead], full, x[:, lead + keep.shape[1]:]], 1)
    return x
