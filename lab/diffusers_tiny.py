"""Tiny random diffusers transformers of the routed families, with inputs, and the routed forward built by hand
that the hooks are compared with: for the tests and the SimpleTuner harness both."""
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


# -- Z-Image, Lumina2, ErnieImage, Krea2 (tread_diffusers/image_families.py) ---------------------------------
def zimage(frames=1):
    """Z-Image with captions of 5 and 40 tokens (padded to 32 and 64: an attention mask) and 4 x 6 image tokens
    (padded to 32)."""
    from diffusers import ZImageTransformer2DModel

    model = ZImageTransformer2DModel(in_channels=4, dim=16, n_layers=4, n_refiner_layers=1, n_heads=2, n_kv_heads=2,
                                     cap_feat_dim=16, axes_dims=[2, 2, 4], axes_lens=[128, 16, 16])
    inputs = dict(x=torch.randn(B, 4, frames, 8, 12), t=torch.rand(B),
                  cap_feats=[torch.randn(5, 16), torch.randn(40, 16)], return_dict=False)
    return model, inputs, ((4, 6) if frames == 1 else (frames, 4, 6))


FAMILIES.update(zimage=zimage)
BLOCK_LISTS.update(zimage=("layers",))
TOKENS = {"zimage": "x"}  # the blocks' argument that holds the image tokens, where not hidden_states


def lumina2(captions=(5, 3)):
    """Lumina2 with 4 x 6 image tokens after captions of 5 and 3 tokens (the second padded: the image starts at a
    per-sample offset, and the main layers get an attention mask); GQA, 2 query heads on 1 key-value head."""
    from diffusers import Lumina2Transformer2DModel

    model = Lumina2Transformer2DModel(sample_size=8, patch_size=2, in_channels=4, hidden_size=16, num_layers=4,
                                      num_refiner_layers=1, num_attention_heads=2, num_kv_heads=1, multiple_of=16,
                                      axes_dim_rope=(2, 2, 4), axes_lens=(32, 16, 16), cap_feat_dim=16)
    text_mask = torch.arange(max(captions))[None] < torch.tensor(captions)[:, None]
    inputs = dict(hidden_states=torch.randn(B, 4, 8, 12), timestep=torch.rand(B),
                  encoder_hidden_states=torch.randn(B, max(captions), 16), encoder_attention_mask=text_mask,
                  return_dict=False)
    return model, inputs, (4, 6)


FAMILIES.update(lumina2=lumina2)
BLOCK_LISTS.update(lumina2=("layers",))


def krea2():
    """Krea2, the second sample's last two text tokens padding (an attention mask)."""
    from diffusers import Krea2Transformer2DModel

    model = Krea2Transformer2DModel(in_channels=4, num_layers=4, attention_head_dim=8, num_attention_heads=2,
                                    num_key_value_heads=1, intermediate_size=32, timestep_embed_dim=16,
                                    text_hidden_dim=16, num_text_layers=2, text_num_attention_heads=2,
                                    text_num_key_value_heads=2, text_intermediate_size=32, num_layerwise_text_blocks=1,
                                    num_refiner_text_blocks=1, axes_dims_rope=(2, 2, 4))
    h, w = 4, 6
    img_ids, txt_ids = _flux_ids(h, w, 5, 3)
    text_mask = torch.ones(B, 5, dtype=torch.bool)
    text_mask[1, 3:] = False
    inputs = dict(hidden_states=torch.randn(B, h * w, 4), encoder_hidden_states=torch.randn(B, 5, 2, 16),
                  timestep=torch.rand(B), position_ids=torch.cat([txt_ids, img_ids]), encoder_attention_mask=text_mask,
                  return_dict=False)
    return model, inputs, (h, w)


FAMILIES.update(krea2=krea2)
BLOCK_LISTS.update(krea2=("transformer_blocks",))
PACKED += ("krea2",)
JOINT_ROPE += ("krea2",)
TEXT_FIRST = ("krea2",)  # the text leads the image in every block's hidden_states


# -- tread_diffusers/video_families.py ------------------------------------------------------------------------
def cosmos(frames=2):
    """Cosmos (text by cross-attention, a text mask); random learnable positions (diffusers starts them at zero)."""
    from diffusers import CosmosTransformer3DModel

    model = CosmosTransformer3DModel(in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=12,
                                     num_layers=4, mlp_ratio=2.0, text_embed_dim=16, adaln_lora_dim=8,
                                     max_size=(8, 16, 16), concat_padding_mask=False)
    for p in model.learnable_pos_embed.parameters():
        torch.nn.init.normal_(p)
    text_mask = torch.ones(B, 5, dtype=torch.bool)
    text_mask[1, 3:] = False
    inputs = dict(hidden_states=torch.randn(B, 4, frames, 8, 6), timestep=torch.rand(B),
                  encoder_hidden_states=torch.randn(B, 5, 16), attention_mask=text_mask, return_dict=False)
    return model, inputs, (frames, 4, 3)


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


def kandinsky(frames=2):
    """Kandinsky 5 (one text block, four visual blocks); its modulations, zero at diffusers' init, made random so
    that every block changes the tokens."""
    from diffusers import Kandinsky5Transformer3DModel

    model = Kandinsky5Transformer3DModel(in_visual_dim=4, in_text_dim=16, in_text_dim2=16, time_dim=16,
                                         out_visual_dim=4, model_dim=24, ff_dim=32, num_text_blocks=1,
                                         num_visual_blocks=4, axes_dims=(4, 4, 4))
    for name, p in model.named_parameters():
        if "modulation" in name:
            torch.nn.init.normal_(p, std=0.2)
    h, w = 4, 3
    inputs = dict(hidden_states=torch.randn(B, frames, 2 * h, 2 * w, 4), encoder_hidden_states=torch.randn(B, 5, 16),
                  timestep=torch.rand(B) * 1000, pooled_projections=torch.randn(B, 16),
                  visual_rope_pos=(torch.arange(frames), torch.arange(h), torch.arange(w)),
                  text_rope_pos=torch.arange(5), return_dict=True)  # its return_dict=False gives the bare tensor
    return model, inputs, (frames, h, w)


def _kandinsky_by_hand(kw, keep, per_sample):
    """Its RoPE rotation matrices are per sample already, [B, N, 1, head_dim / 2, 2, 2]: the kept rows."""
    kw["rope"] = per_sample(lambda b: kw["rope"][b, keep[b]])


def ltx2(frames=2, rope_type="interleaved"):
    """LTX-2: video tokens and, beside them, 6 audio tokens; prompt modulation from sigma (LTX-2.3)."""
    from diffusers import LTX2VideoTransformer3DModel

    model = LTX2VideoTransformer3DModel(in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=12,
                                        cross_attention_dim=24, audio_in_channels=4, audio_out_channels=4,
                                        audio_num_attention_heads=2, audio_attention_head_dim=8,
                                        audio_cross_attention_dim=16, num_layers=4, caption_channels=16,
                                        rope_type=rope_type)
    h, w, audio = 4, 3, 6
    inputs = dict(hidden_states=torch.randn(B, frames * h * w, 4), audio_hidden_states=torch.randn(B, audio, 4),
                  encoder_hidden_states=torch.randn(B, 5, 16), audio_encoder_hidden_states=torch.randn(B, 5, 16),
                  timestep=torch.rand(B) * 1000, sigma=torch.rand(B), encoder_attention_mask=torch.ones(B, 5),
                  audio_encoder_attention_mask=torch.ones(B, 5), num_frames=frames, height=h, width=w,
                  audio_num_frames=audio, return_dict=False)
    return model, inputs, (frames, h, w)


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


VIDEO_FAMILIES = ("cosmos", "kandinsky", "ltx2", "ltx2_split")
FAMILIES.update(cosmos=cosmos, kandinsky=kandinsky, ltx2=ltx2, ltx2_split=lambda: ltx2(rope_type="split"))
BLOCK_LISTS.update(cosmos=("transformer_blocks",), kandinsky=("visual_transformer_blocks",),
                   ltx2=("transformer_blocks",), ltx2_split=("transformer_blocks",))
VIDEO_HAND_NARROW = {"cosmos": _cosmos_by_hand, "kandinsky": _kandinsky_by_hand, "ltx2": _ltx2_by_hand,
                     "ltx2_split": _ltx2_by_hand}
PACKED = PACKED + ("ltx2", "ltx2_split")
IMAGE_FIRST = ("hunyuan", "ltx2", "ltx2_split")  # blocks that return (image, other stream)
SECOND_STREAM = {"ltx2": "audio_hidden_states", "ltx2_split": "audio_hidden_states"}  # other than the text
TOKENS.update(kandinsky="visual_embed")
CHANNELS_LAST = ("kandinsky",)  # latents [B, *grid, C]
ROPE_ATTENTION = {"kandinsky": ("self_attention", "rotary_emb"),  # where a block's RoPE reaches its attention
                  "ltx2": ("attn1", "query_rotary_emb")}
LORA_TARGETS = {"kandinsky": ["to_query", "to_key", "to_value"]}


# -- tread_diffusers/sequence_families.py -----------------------------------------------------------------
def ernie():
    """Ernie (sequence-first blocks), the second sample's last two text tokens padding; its modulation and output
    layer, zero at diffusers' init, made random so that every block changes the tokens and every token a loss."""
    from diffusers import ErnieImageTransformer2DModel

    model = ErnieImageTransformer2DModel(hidden_size=16, num_attention_heads=2, num_layers=4, ffn_hidden_size=32,
                                         in_channels=4, out_channels=4, patch_size=2, text_in_dim=12,
                                         rope_axes_dim=(2, 2, 4))
    for p in (*model.adaLN_modulation.parameters(), *model.final_linear.parameters()):
        torch.nn.init.normal_(p, std=0.2)
    inputs = dict(hidden_states=torch.randn(B, 4, 8, 12), timestep=torch.rand(B) * 1000,
                  text_bth=torch.randn(B, 5, 12), text_lens=torch.tensor([5, 3]), return_dict=False)
    return model, inputs, (4, 6)


def minimax_layout(text=5, conditions=4, audio=3, grid=(2, 3, 4)):
    """A packed MiniMax H3 sequence as its pipelines lay it out: [text | conditioning video rows | audio | target
    video]; text and conditions at the clean timestep (index 0), audio and the target at the noisy one (index 1)."""
    n = grid[0] * grid[1] * grid[2]
    length = text + conditions + audio + n
    tags = torch.tensor([1] * text + [0] * conditions + [2] * audio + [0] * n)
    steps = torch.tensor([0] * (text + conditions) + [1] * (audio + n))
    frames, rows, columns = torch.meshgrid(*(torch.arange(g) for g in grid), indexing="ij")
    target = torch.stack([frames + 2, rows, columns], -1).reshape(n, 3)
    along = lambda k, axis: torch.arange(k)[:, None] * torch.eye(3, dtype=torch.long)[axis]  # noqa: E731
    position_ids = torch.cat([along(text, 0), along(conditions, 1) + torch.tensor([1, 0, 0]), along(audio, 0), target])
    start = text + conditions
    return dict(timestep=torch.tensor([0.0, 0.6]), timestep_indices=steps, token_tags=tags, position_ids=position_ids,
                video_indices=torch.cat([torch.arange(text, start), torch.arange(start + audio, length)]),
                audio_indices=torch.arange(start, start + audio), text_indices=torch.arange(text))


def minimax():
    """MiniMax H3: 5 text rows, 4 conditioning video rows, 3 audio rows and a 2 x 3 x 4 target video."""
    from diffusers import MiniMaxH3Transformer3DModel

    model = MiniMaxH3Transformer3DModel(num_attention_heads=2, attention_head_dim=16, hidden_size=24, num_layers=4,
                                        num_refiner_layers=1, ffn_dim=32, in_channels=4, audio_in_channels=4,
                                        patch_size=(1, 1, 1), text_dim=16, freq_dim=16, time_embed_hidden_dim=16,
                                        time_embed_dim=16, rope_freq_dim=2)
    layout = minimax_layout()
    inputs = dict(hidden_states=torch.randn(B, len(layout["video_indices"]), 4),
                  audio_hidden_states=torch.randn(B, 3, 4), encoder_hidden_states=torch.randn(B, 5, 16),
                  return_dict=False, **layout)
    return model, inputs, (2, 3, 4)


FAMILIES.update(ernie=ernie, minimax=minimax)
BLOCK_LISTS.update(ernie=("layers",), minimax=("transformer_blocks",))
PACKED += ("minimax",)
TOKENS.update(ernie="x")
