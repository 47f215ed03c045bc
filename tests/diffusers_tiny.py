"""Tiny random diffusers transformers of the four routed families, with inputs, for the TREAD checks."""
import torch

B = 2


def flux(layers=2, single_layers=2):
    from diffusers import FluxTransformer2DModel

    model = FluxTransformer2DModel(patch_size=1, in_channels=4, num_layers=layers, num_single_layers=single_layers,
                                   attention_head_dim=8, num_attention_heads=2, joint_attention_dim=16,
                                   pooled_projection_dim=16, axes_dims_rope=(2, 2, 4))
    h, w = 4, 6
    ids = torch.zeros(h, w, 3)
    ids[..., 1], ids[..., 2] = torch.arange(h)[:, None], torch.arange(w)[None]
    inputs = dict(hidden_states=torch.randn(B, h * w, 4), encoder_hidden_states=torch.randn(B, 5, 16),
                  pooled_projections=torch.randn(B, 16), timestep=torch.rand(B), img_ids=ids.reshape(-1, 3),
                  txt_ids=torch.zeros(5, 3), return_dict=False)
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


def auraflow():
    from diffusers import AuraFlowTransformer2DModel

    model = AuraFlowTransformer2DModel(sample_size=8, patch_size=2, in_channels=4, num_mmdit_layers=2,
                                       num_single_dit_layers=2, attention_head_dim=8, num_attention_heads=2,
                                       joint_attention_dim=16, caption_projection_dim=16, out_channels=4,
                                       pos_embed_max_size=16)
    inputs = dict(hidden_states=torch.randn(B, 4, 8, 8), encoder_hidden_states=torch.randn(B, 5, 16),
                  timestep=torch.rand(B) * 1000, return_dict=False)
    return model, inputs, (4, 4)


FAMILIES = {"flux": flux, "sd3": sd3, "pixart": pixart, "wan": wan, "auraflow": auraflow}
BLOCK_LISTS = {"flux": ("transformer_blocks", "single_transformer_blocks"), "sd3": ("transformer_blocks",),
               "pixart": ("transformer_blocks",), "wan": ("blocks",),
               "auraflow": ("joint_transformer_blocks", "single_transformer_blocks")}


def build(name, seed=0, **kw):
    torch.manual_seed(seed)
    return FAMILIES[name](**kw)


def blocks_of(name, model):
    return [block for attr in BLOCK_LISTS[name] for block in getattr(model, attr)]
