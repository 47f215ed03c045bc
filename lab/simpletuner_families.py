"""The families the SimpleTuner harness (lab/simpletuner_models.py) runs, one entry each, and what it knows of the
rest: SimpleTuner's file and class per family, our block lists (its Family's), and the tiny model
(lab/diffusers_tiny_models.py's, which the family checks build too); the families both route that cannot be run, and why
SimpleTuner's file fails or differs where it does (read from its commit bc8e6ab, each difference isolated by a run).
"""
import torch

from lab import diffusers_tiny_models
from tread_diffusers.families import FAMILIES as ROUTED
from tread_diffusers.tread import apply_tread  # noqa: F401  (importing registers every family in ROUTED)

B = diffusers_tiny_models.B


def tiny(name: str):
    """lab/diffusers_tiny_models.py's model and inputs for `name` (its token grid is not needed here)."""
    def build():
        model, inputs, _ = getattr(diffusers_tiny_models, name)()
        return model, inputs
    return build


def with_inputs(build, **extra):
    """A builder whose inputs also hold `extra`."""
    def built():
        model, inputs = build()
        return model, {**inputs, **extra}
    return built


def _qwen():
    """Qwen-Image with four blocks (the layouts' count; the family checks' has three)."""
    from diffusers import QwenImageTransformer2DModel
    model = QwenImageTransformer2DModel(patch_size=2, in_channels=16, out_channels=4, num_layers=4,
                                        attention_head_dim=8, num_attention_heads=2, joint_attention_dim=16,
                                        axes_dims_rope=(2, 2, 4))
    return model, dict(hidden_states=torch.randn(B, 20, 16), encoder_hidden_states=torch.randn(B, 6, 16),
                       encoder_hidden_states_mask=torch.ones(B, 6), timestep=torch.rand(B),
                       img_shapes=[[(1, 4, 5)]] * B, return_dict=False)


def _ernie():
    """Ernie, its zero-initialised modulation and output layer made random (a zero output would agree trivially);
    captions of one length (the padded case is lab/simpletuner_joint.py's `padded_text`)."""
    from diffusers import ErnieImageTransformer2DModel
    model = ErnieImageTransformer2DModel(hidden_size=16, num_attention_heads=2, num_layers=4, ffn_hidden_size=32,
                                         in_channels=4, out_channels=4, patch_size=2, text_in_dim=12,
                                         rope_axes_dim=(2, 2, 4))
    for p in (*model.adaLN_modulation.parameters(), *model.final_linear.parameters()):
        torch.nn.init.normal_(p, std=0.2)
    return model, dict(hidden_states=torch.randn(B, 4, 8, 10), timestep=torch.rand(B) * 1000,
                       text_bth=torch.randn(B, 6, 12), text_lens=torch.full((B,), 6), return_dict=False)


def _minimax():
    """MiniMax H3 on its text-to-video-and-audio layout [text | audio | video]: 6 text, 3 audio, 2 x 3 x 4 video
    rows (no conditioning rows: SimpleTuner routes those, we pass them whole)."""
    from diffusers import MiniMaxH3Transformer3DModel

    from tread_diffusers.sequence_families import minimax_inputs
    model = MiniMaxH3Transformer3DModel(num_attention_heads=2, attention_head_dim=16, hidden_size=24, num_layers=4,
                                        num_refiner_layers=1, ffn_dim=32, in_channels=4, audio_in_channels=4,
                                        patch_size=(1, 1, 1), text_dim=16, freq_dim=16, time_embed_hidden_dim=16,
                                        time_embed_dim=16, rope_freq_dim=2)
    inputs = minimax_inputs(torch.randn(B, 4, 2, 3, 4), torch.randn(B, 6, 16), torch.rand(B), audio=3, audio_channels=4)
    return model, dict(inputs, return_dict=False)


def entry(folder: str, cls_name: str, build) -> tuple:
    """A FAMILIES row: our block lists are the class's Family's, in numbering order."""
    return folder, cls_name, ROUTED[cls_name].block_lists, build


def routed_argument(name: str) -> str:
    """The block argument that holds the tokens our side routes (its Family's `tokens`)."""
    return ROUTED[FAMILIES[name][1]].tokens


# name: (SimpleTuner's folder under simpletuner/helpers/models/, or folder/file where its file is not transformer.py;
# its class; our block lists in numbering order; the tiny model and inputs). Every model has four routable blocks
# (FLUX-like: two lists of two).
FAMILIES = {
    "flux": entry("flux", "FluxTransformer2DModel", tiny("flux")),
    "sd3": entry("sd3", "SD3Transformer2DModel", tiny("sd3")),
    "pixart": entry("pixart", "PixArtTransformer2DModel", tiny("pixart")),
    "auraflow": entry("auraflow", "AuraFlowTransformer2DModel", tiny("auraflow")),
    "wan": entry("wan", "WanTransformer3DModel", tiny("wan")),
    "chroma": entry("chroma", "ChromaTransformer2DModel", tiny("chroma")),
    "qwen": entry("qwen_image", "QwenImageTransformer2DModel", _qwen),
    "ltx": entry("ltxvideo", "LTXVideoTransformer3DModel", tiny("ltx")),
    "zimage": entry("z_image", "ZImageTransformer2DModel", tiny("zimage")),
    "krea2": entry("krea2", "Krea2Transformer2DModel", tiny("krea2")),
    "cosmos": entry("cosmos", "CosmosTransformer3DModel", tiny("cosmos")),
    "kandinsky": entry("kandinsky5_video/transformer_kandinsky5", "Kandinsky5Transformer3DModel", tiny("kandinsky")),
    "flux2": entry("flux2", "Flux2Transformer2DModel", tiny("flux2")),
    # the frame rate given: its RoPE's default is 25 fps in SimpleTuner's copy, 24 in diffusers'
    "ltx2": entry("ltxvideo2", "LTX2VideoTransformer3DModel", with_inputs(tiny("ltx2"), fps=24.0)),
    # compared by lab/simpletuner_joint.py: SimpleTuner selects over the blocks' whole sequence
    "ernie": entry("ernie", "ErnieImageTransformer2DModel", _ernie),
    "minimax": entry("minimaxh3", "MiniMaxH3Transformer3DModel", _minimax),
}


def source_file(folder: str) -> str:
    """The file of a FAMILIES entry under simpletuner/helpers/models/, without .py."""
    return folder if "/" in folder else f"{folder}/transformer"


# Where SimpleTuner's sequence of S tokens holds more than the N image tokens we route, its router is handed our
# kept tokens (indices into the N) placed in its sequence, with every other token kept, as ours passes them whole.
def text_first(keep: torch.Tensor, s: int, n: int) -> torch.Tensor:
    """[text, image]: the S - N leading tokens, then our kept image tokens."""
    return torch.cat([torch.arange(s - n).expand(len(keep), -1), s - n + keep], 1)


def image_first(keep: torch.Tensor, s: int, n: int) -> torch.Tensor:
    """[image, the rest]: our kept image tokens, then every token after the image."""
    return torch.cat([keep, torch.arange(n, s).expand(len(keep), -1)], 1)


REPLAY = {"krea2": text_first,  # every block takes [text, image]
          "zimage": image_first,  # [image, its padding, caption]
          "ernie": image_first,  # [image, text]
          "minimax": text_first}  # [text, audio, target video]


def _first_sample(inputs: dict) -> dict:
    return {k: v[:1] if torch.is_tensor(v) and v.shape[0] == B else v for k, v in inputs.items()}


def _unpadded_text(inputs: dict) -> dict:
    return {**inputs, "encoder_attention_mask": torch.ones_like(inputs["encoder_attention_mask"])}


# Inputs that isolate a cause of a difference, run over the layout "across lists 1..2" (label: new inputs).
CAUSES = {
    "krea2": {"no text padding": _unpadded_text,
              "no text padding, batch of 1": lambda inputs: _first_sample(_unpadded_text(inputs))},
    "zimage": {"captions of one length": lambda inputs: {**inputs, "cap_feats": [torch.randn(
        40, 16, generator=torch.Generator().manual_seed(5 + i)) for i in range(B)]}},
}
LEAVES = {"zimage": ("x",)}  # the inputs whose gradients are compared, where not hidden / encoder_hidden_states

# Families both route whose SimpleTuner file cannot be run against its own router, read from bc8e6ab.
NOT_COMPARED = {
    "hunyuan": "SimpleTuner's HunyuanVideo transformer is HunyuanVideo 1.5 (another architecture than diffusers' "
               "HunyuanVideoTransformer3DModel) and its set_router refuses routes (NotImplementedError)",
    "kandinsky_image": "SimpleTuner's kandinsky5_image/transformer_kandinsky5.py has no TREAD router (no set_router); "
                       "its model.py hands a force_keep_mask to a transformer that does not route. Ours routes the "
                       "image model as the video one (one frame): the video row stands for both",
    "sana": "routed by SimpleTuner, refused here: its GLUMBConv feed-forward convolves over the token grid, so kept "
            "tokens need their neighbours (docs/diffusers.md, families not supported)",
    "hidream": "routed by SimpleTuner, refused here: diffusers' forward loop cuts the single-stream sequence back to "
               "its length before the blocks after every block (docs/diffusers.md, families not supported)",
}

# Why SimpleTuner's file fails where it does (read from bc8e6ab); ours follows the paper's rule there: kept tokens run
# the blocks with their own per-token inputs, skipped tokens rejoin unchanged.
WHY_IT_FAILS = {
    "flux": "with a force-keep mask, a route starting in a single-stream block slices force_keep_mask[:, txt_len:] "
            "as if the mask covered the text too; it holds the image tokens only. With FLUX Kontext's reference "
            "tokens its router selects over target and references, so the mask its model_predict builds from the "
            "target's latents does not fit (it runs when the mask is padded for the references)",
    "wan": "with per-token timesteps (Wan 2.2), the route gathers the tokens but not their timestep embeddings",
    "chroma": "the route hands per-sample RoPE tables [B, K, D] to diffusers' FluxAttnProcessor, which takes one "
              "[S, D] table (SimpleTuner's FLUX has its own processor; Chroma uses diffusers')",
    "qwen": "the route gathers the image tokens but hands the blocks the full image RoPE table (all N rows)",
    "ltx": "the route calls get_mask(token count, ratio, force_keep_mask=...), which its TREADRouter does not take",
    "flux2": "the route calls router.route() / unroute(), which its TREADRouter does not define (it also gathers "
             "one RoPE row set for the whole batch, read from the file)",
    "cosmos": "the route calls get_mask(token count, ratio, force_keep_mask=...), which its TREADRouter does not "
              "take (as LTX-Video's)",
}

# Why SimpleTuner's file gives other values than ours on the same kept tokens where it runs, each cause isolated by a
# CAUSES row (bit-identical once it is removed); ours follows the paper's rule (each kept token with its own
# position; masked tokens stay masked).
WHY_IT_DIFFERS = {
    "krea2": "while routed it gives every sample the first sample's kept RoPE rows (start_route on the table "
             "expanded over the batch, then [0]) and drops the attention mask (padded text is attended): with no "
             "padding the values still differ, with a batch of one too they are the same. Its router selects over "
             "[text, image] with the text forced, so its own count includes the text (first kept figure)",
    "zimage": "while routed it attends with an all-ones mask, so the batch padding after the shorter caption is "
              "attended: with captions of one length the values are the same. Its router selects over [image, "
              "padding, caption] and forces the first caption-length tokens, which are image tokens, not the caption "
              "(its own count is the first kept figure)",
    "flux": "with FLUX Kontext's references its router selects over target and reference tokens together (its own "
            "count, the first kept figure, can drop references); ours keeps target tokens only and passes every "
            "reference whole: handed ours plus every reference, its values are ours",
}
