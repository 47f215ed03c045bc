"""The tiny image families of the family checks (tests/diffusers_tiny_entry.py says what an entry holds): FLUX,
FLUX.2, Chroma, Qwen-Image (and its edit model), SD3, PixArt, AuraFlow, Z-Image, Krea2 and Lumina2, each with its
per-token inputs cut by hand. The models the SimpleTuner harness shares are built in lab/diffusers_tiny_models.py."""
import torch

from diffusers_tiny_entry import TINY, HandRope, Tiny, per_sample
from lab import diffusers_tiny_models as shared
from lab.diffusers_tiny_models import B


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


def joint_by_hand(kw, keep, lead, tail):
    """The joint sequence's RoPE rows: the text, then the kept image tokens (FLUX Kontext's reference rows last);
    Chroma's [B, text + N] and Krea2's [B, 1, 1, text + N] masks at the same positions."""
    text = kw["encoder_hidden_states"].shape[1] if kw.get("encoder_hidden_states") is not None else lead
    kw["image_rotary_emb"] = tuple(HandRope(per_sample(keep, lambda b: torch.cat(
        [t[:text], t[text:len(t) - tail][keep[b]], t[len(t) - tail:]]))) for t in kw["image_rotary_emb"])
    mask = kw.get("attention_mask")
    if mask is not None:
        kw["attention_mask"] = per_sample(keep, lambda b: torch.cat([mask[b][..., :text],
                                                                     mask[b][..., text:][..., keep[b]]], -1))


def joint_angles(table, full, keep, text):
    """The routed block's table is per sample: [B, text + K, 1, head_dim]."""
    table = table[None, :, None, :]
    return all(torch.equal(table[b, :text, 0], full[:text])
               and torch.equal(table[b, text:, 0], full[text:][keep[b]]) for b in range(keep.shape[0]))


def qwen_by_hand(kw, keep, lead, tail):
    """The target's kept RoPE rows, then every reference row (the text's table whole); the edit model's per-token
    modulation index (target 0, reference 1) likewise."""
    image, text = kw["image_rotary_emb"]
    n = image.shape[0] - tail
    kw["image_rotary_emb"] = (HandRope(per_sample(keep, lambda b: torch.cat([image[keep[b]], image[n:]]))), text)
    if kw.get("modulate_index") is not None:
        index = kw["modulate_index"]
        kw["modulate_index"] = per_sample(keep, lambda b: torch.cat([index[b, keep[b]], index[b, n:]]))


def qwen_angles(table, full, keep, text):
    """Complex [B, K + R, 1, head_dim / 2]: the kept target rows, then the references'; the text's table whole."""
    if isinstance(table, torch.Tensor):
        return torch.equal(table, full)
    table, k = table.unsqueeze(1)[:, :, 0], keep.shape[1]
    n = full.shape[0] - (table.shape[1] - k)
    return all(torch.equal(table[b, :k], full[keep[b]]) and torch.equal(table[b, k:], full[n:])
               for b in range(keep.shape[0]))


def zimage_by_hand(kw, keep, lead, tail):
    """Per-sample complex RoPE [B, L, head_dim / 2] and mask [B, L]: the kept rows, then the tail's."""
    for k in ("freqs_cis", "attn_mask"):
        if kw.get(k) is not None:
            kw[k] = per_sample(keep, lambda b: torch.cat([kw[k][b, keep[b]], kw[k][b, kw[k].shape[1] - tail:]]))


TINY.update({
    "flux": Tiny("FluxTransformer2DModel", shared.flux, joint_by_hand, joint_angles),
    "flux2": Tiny("Flux2Transformer2DModel", shared.flux2, joint_by_hand, joint_angles),
    "chroma": Tiny("ChromaTransformer2DModel", shared.chroma, joint_by_hand, joint_angles),
    "qwen": Tiny("QwenImageTransformer2DModel", qwen, qwen_by_hand, qwen_angles),
    "qwen_edit": Tiny("QwenImageTransformer2DModel", lambda: qwen(True), qwen_by_hand, qwen_angles),
    "sd3": Tiny("SD3Transformer2DModel", shared.sd3),
    "pixart": Tiny("PixArtTransformer2DModel", shared.pixart),
    "auraflow": Tiny("AuraFlowTransformer2DModel", shared.auraflow),
    "zimage": Tiny("ZImageTransformer2DModel", shared.zimage, zimage_by_hand),
    "krea2": Tiny("Krea2Transformer2DModel", shared.krea2, joint_by_hand, joint_angles),
    "lumina2": Tiny("Lumina2Transformer2DModel", lumina2, checked_by="tests/test_diffusers_lumina2.py"),
})
