"""The tiny random diffusers transformers that the SimpleTuner harness (lab/simpletuner_families.py) runs on both
sides: FLUX, FLUX.2, Chroma, SD3, PixArt, AuraFlow, Z-Image, Krea2, Wan, LTX-Video, Cosmos, Kandinsky 5 and LTX-2,
each returned with its inputs and token grid. The family checks use the same models: tests/diffusers_tiny_*.py
name them in their entries, beside the tiny models only the tests use. `B` is the batch of every tiny model's
inputs."""
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
