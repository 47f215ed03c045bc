"""The tiny random video transformers of lab/diffusers_tiny.py (its `build` names them): Wan, LTX-Video,
HunyuanVideo, Cosmos, Kandinsky 5 and LTX-2, each returned with its inputs and token grid."""
import torch

from lab.diffusers_tiny_image_families import B


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
