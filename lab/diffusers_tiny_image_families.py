"""The tiny random image transformers of lab/diffusers_tiny.py (its `build` names them): FLUX, FLUX.2, Chroma,
Qwen-Image, SD3, PixArt, AuraFlow, Z-Image, Lumina2 and Krea2, each returned with its inputs and token grid.
`B`, the batch of every tiny model's inputs, is defined here for the video and sequence families too."""
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


def auraflow():
    from diffusers import AuraFlowTransformer2DModel

    model = AuraFlowTransformer2DModel(sample_size=8, patch_size=2, in_channels=4, num_mmdit_layers=2,
                                       num_single_dit_layers=2, attention_head_dim=8, num_attention_heads=2,
                                       joint_attention_dim=16, caption_projection_dim=16, out_channels=4,
                                       pos_embed_max_size=16)
    inputs = dict(hidden_states=torch.randn(B, 4, 8, 8), encoder_hidden_states=torch.randn(B, 5, 16),
                  timestep=torch.rand(B) * 1000, return_dict=False)
    return model, inputs, (4, 4)


def zimage(frames=1):
    """Z-Image with captions of 5 and 40 tokens (padded to 32 and 64: an attention mask) and 4 x 6 image tokens
    (padded to 32)."""
    from diffusers import ZImageTransformer2DModel

    model = ZImageTransformer2DModel(in_channels=4, dim=16, n_layers=4, n_refiner_layers=1, n_heads=2, n_kv_heads=2,
                                     cap_feat_dim=16, axes_dims=[2, 2, 4], axes_lens=[128, 16, 16])
    inputs = dict(x=torch.randn(B, 4, frames, 8, 12), t=torch.rand(B),
                  cap_feats=[torch.randn(5, 16), torch.randn(40, 16)], return_dict=False)
    return model, inputs, ((4, 6) if frames == 1 else (frames, 4, 6))


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
