"""The tiny video families of the family checks (tests/diffusers_tiny_entry.py says what an entry holds): Wan,
LTX-Video, HunyuanVideo, Cosmos, Kandinsky 5 and LTX-2 (interleaved and split RoPE), each with its per-token
inputs cut by hand. The models the SimpleTuner harness shares are built in lab/diffusers_tiny_models.py."""
import torch

from diffusers_tiny_entry import TINY, HandRope, Tiny, per_sample
from lab import diffusers_tiny_models as shared
from lab.diffusers_tiny_models import B


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


class HandRopeHeads(HandRope):
    """As HandRope, for attention that holds [B, heads, S, head_dim] (diffusers' `cos[None, None]`)."""

    def __getitem__(self, index):
        assert index == (None, None, slice(None), slice(None)), index
        return self.table.unsqueeze(1)


def wan_by_hand(kw, keep, lead, tail):
    """Each sample's kept RoPE rows of the [1, N, 1, head_dim] table; Wan 2.2's per-token timestep likewise."""
    kw["rotary_emb"] = tuple(per_sample(keep, lambda b: t[0, keep[b]]) for t in kw["rotary_emb"])
    if kw["temb"].ndim == 4:
        kw["temb"] = per_sample(keep, lambda b: kw["temb"][b, keep[b]])


def wan_angles(table, full, keep, text):
    return all(torch.equal(table[b, :, 0], full[0, keep[b], 0]) for b in range(keep.shape[0]))


def ltx_by_hand(kw, keep, lead, tail):
    """Per-sample RoPE [B, N, dim] and, with per-token timesteps, temb [B, N, 6 * dim]."""
    kw["image_rotary_emb"] = tuple(per_sample(keep, lambda b: t[b, keep[b]]) for t in kw["image_rotary_emb"])
    if kw["temb"].shape[1] > 1:
        kw["temb"] = per_sample(keep, lambda b: kw["temb"][b, keep[b]])


def per_sample_angles(table, full, keep, text):
    """Per sample already: [B, K, dim] from [B, N, dim]."""
    return all(torch.equal(table[b], full[b, keep[b]]) for b in range(keep.shape[0]))


def hunyuan_by_hand(kw, keep, lead, tail):
    """The video's RoPE rows [B, K, head_dim]; the mask [B, 1, 1, N + T], video first."""
    key = "freqs_cis" if "freqs_cis" in kw else "image_rotary_emb"
    kw[key] = tuple(HandRope(per_sample(keep, lambda b: t[keep[b]])) for t in kw[key])
    mask, text = kw["attention_mask"], kw["encoder_hidden_states"].shape[1]
    kw["attention_mask"] = per_sample(keep, lambda b: torch.cat([mask[b][..., :-text][..., keep[b]],
                                                                 mask[b][..., -text:]], -1))


def video_rows_angles(table, full, keep, text):
    """The video's rows only, [B, K, 1, head_dim], from a batch-shared [N, head_dim]."""
    table = table[None, :, None, :]
    return all(torch.equal(table[b, :, 0], full[keep[b]]) for b in range(keep.shape[0]))


def cosmos_by_hand(kw, keep, lead, tail):
    """The video's RoPE rows [B, K, head_dim]; learnable positions and per-frame modulation [B, K, D]."""
    kw["image_rotary_emb"] = tuple(HandRopeHeads(per_sample(keep, lambda b: t[keep[b]]))
                                   for t in kw["image_rotary_emb"])
    for key in ("extra_pos_emb", "embedded_timestep", "temb"):
        if kw[key].ndim == 3:
            kw[key] = per_sample(keep, lambda b: kw[key][b, keep[b]])


def kandinsky_by_hand(kw, keep, lead, tail):
    """Its RoPE rotation matrices are per sample already, [B, N, 1, head_dim / 2, 2, 2]: the kept rows."""
    kw["rope"] = per_sample(keep, lambda b: kw["rope"][b, keep[b]])


def ltx2_by_hand(kw, keep, lead, tail):
    """The video's RoPE rows (interleaved [B, N, dim], split [B, heads, N, head_dim / 2]), per-token modulations
    [B, N, k * D] and self-attention mask [B, N, N] at each sample's kept tokens."""
    for key in ("video_rotary_emb", "ca_video_rotary_emb"):
        kw[key] = tuple(per_sample(keep, lambda b: t[b, keep[b]] if t.ndim == 3 else t[b][:, keep[b]])
                        for t in kw[key])
    for key in ("temb", "temb_ca_scale_shift", "temb_ca_gate"):
        if kw[key].shape[1] > 1:
            kw[key] = per_sample(keep, lambda b: kw[key][b, keep[b]])
    if kw.get("self_attention_mask") is not None:
        kw["self_attention_mask"] = per_sample(keep, lambda b: kw["self_attention_mask"][b][keep[b]][:, keep[b]])


LTX2 = dict(rope_attention=("attn1", "query_rotary_emb"), other_stream="audio_hidden_states")
TINY.update({
    "wan": Tiny("WanTransformer3DModel", shared.wan, wan_by_hand, wan_angles),
    "ltx": Tiny("LTXVideoTransformer3DModel", shared.ltx, ltx_by_hand, per_sample_angles),
    "hunyuan": Tiny("HunyuanVideoTransformer3DModel", hunyuan, hunyuan_by_hand, video_rows_angles),
    "cosmos": Tiny("CosmosTransformer3DModel", shared.cosmos, cosmos_by_hand, video_rows_angles),
    "kandinsky": Tiny("Kandinsky5Transformer3DModel", shared.kandinsky, kandinsky_by_hand,
                      rope_attention=("self_attention", "rotary_emb"), channels_last=True,
                      lora_targets=("to_query", "to_key", "to_value")),
    "ltx2": Tiny("LTX2VideoTransformer3DModel", shared.ltx2, ltx2_by_hand, per_sample_angles, **LTX2),
    "ltx2_split": Tiny("LTX2VideoTransformer3DModel", lambda **kw: shared.ltx2(rope_type="split", **kw), ltx2_by_hand,
                       **LTX2),
})
