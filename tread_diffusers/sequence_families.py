"""Two more diffusers families for TREAD, whose blocks run one sequence of every modality, registered into the
tables of tread_diffusers/families.py (whose docstring says what a Family holds).

- Ernie (`ErnieImageTransformer2DModel`, `layers`): sequence-first. Every block takes `x` [S, B, D], the image
  tokens first (N = H/p x W/p), then the text padded to the batch's longest (`text_lens` says how much is real);
  the family's `sequence_first` makes the hooks cut the token axis 0. The text follows the image and passes every
  block whole. Its RoPE `rotary_pos_emb` [B, S, 1, head_dim] is per sample: each sample's kept image rows, then the
  text rows. The modulation `temb` is six tensors [S, B, D] (one row per token) and the attention mask [B, 1, 1, S]
  masks the text padding: both are cut at the same positions.
- MiniMax H3 (`MiniMaxH3Transformer3DModel`, `transformer_blocks`): one packed sequence [B, S, D] of text rows,
  conditioning rows (keyframes, references), audio rows and the target video, laid out as diffusers' MiniMax H3
  pipelines build it, [text | conditions | audio | target video], and shared by the batch (`position_ids` [S, 3],
  `token_tags` [S], `timestep_indices` [S]). The routed tokens are the target video's rows, the trailing run of
  video rows at the target's timestep; everything before them is conditioning and passes every block whole. The
  blocks select their modulation with one index per row shared by the batch (`adaln_indices` [S],
  `index_select`), so only rows that share one index can be routed per sample: the target's do, the conditioning
  video rows (at their own timestep) do not. Its RoPE (cos, sin) [S, rotary_dim] has no batch dimension: a routed
  block gets each sample's leading rows and kept target rows. Under torch.compile the rows are not read (that is
  data-dependent): every video row is taken as the target, and `check_target_rows`, run when the graph runs, stops a
  forward whose video rows are not the trailing rows at one timestep (a layout with conditioning rows: run it eagerly).
"""
import torch

from tread_diffusers.families import FAMILIES, Example, Family, SampleRope, gather_attention_mask, latent_grid
from tread_diffusers.image_families import image_latents
from tread_diffusers.video_families import _token_rows, video_latents
from tread_utils.errors import UserError


def _ernie_tail(transformer, kw: dict) -> int:
    """Ernie's text tokens, after the image's in every block's sequence."""
    return kw["text_bth"].shape[1]


def _ernie_narrow(kw: dict, keep: torch.Tensor) -> None:
    """Each sample's kept image rows, then the text rows, of the RoPE [B, S, 1, head_dim], of the six modulation
    tensors [S, B, D] and of the attention mask [B, 1, 1, S]."""
    rope = kw["rotary_pos_emb"]
    length, text = rope.shape[1], kw["x"].shape[0] - keep.shape[1]
    rest = torch.arange(length - text, length, device=keep.device).expand(keep.shape[0], -1)
    positions = torch.cat([keep, rest], 1)
    kw["rotary_pos_emb"] = _token_rows(rope, positions, 1)
    kw["temb"] = [_token_rows(t.transpose(0, 1), positions, 1).transpose(0, 1) for t in kw["temb"]]
    if kw.get("attention_mask") is not None:
        kw["attention_mask"] = gather_attention_mask(kw["attention_mask"], positions, "Ernie")


class RowsRope(SampleRope):
    """Each sample's RoPE rows [B, S, rotary_dim] where MiniMax H3 reads a batch-shared [S, rotary_dim] table:
    `cos.shape[-1]`, `cos.to(dtype)`, then `[None, :, None, :]` (SampleRope's)."""

    @property
    def shape(self) -> torch.Size:
        return self.table.shape

    def to(self, *args, **kwargs) -> "RowsRope":
        return RowsRope(self.table.to(*args, **kwargs))


MODALITIES = 3  # diffusers' MINIMAX_H3_MODALITY_NUM: a row's modulation index is timestep index * 3 + token tag
TARGET_LAYOUT = ("TREAD routes MiniMax H3's target video as the last rows of the packed sequence, at one timestep, "
                 "as diffusers' MiniMax H3 pipelines lay it out ([text | conditions | audio | target video])")


def _minimax_lead(transformer, kw: dict) -> dict:
    """The rows before the target video's: the trailing run of video rows (token tag 0) at the last row's timestep."""
    tags = kw["token_tags"]
    length, video = tags.shape[0], kw["hidden_states"].shape[1]
    if torch.compiler.is_compiling():  # no data read into Python: every video row, checked in the blocks
        return {"transformer_blocks": length - video}
    index = kw["timestep_indices"] * MODALITIES + tags
    other = (index != index[-1]).nonzero()
    lead = int(other.max()) + 1 if len(other) else 0
    target = torch.arange(lead, length, device=tags.device)
    video_rows = kw["video_indices"][video - (length - lead):] if length - lead <= video else None
    if int(tags[-1]) != 0 or video_rows is None or not torch.equal(video_rows.to(tags.device), target):
        raise UserError(f"{TARGET_LAYOUT}; these rows are not (the last row's token tag is {int(tags[-1])})")
    return {"transformer_blocks": lead}


def _minimax_grid(transformer, kw: dict) -> tuple:
    """Frames x rows x columns of the target video, read from its rows of position_ids [S, 3]."""
    lead = _minimax_lead(transformer, kw)["transformer_blocks"]
    ids = kw["position_ids"][lead:]
    return tuple(int(ids[:, axis].unique().numel()) for axis in range(3))


@torch.library.custom_op("tread::check_target_rows", mutates_args=())
def check_target_rows(index: torch.Tensor, lead: int, kept: int) -> torch.Tensor:
    """The modulation index [S] of the `lead` leading rows and `kept` target rows, once the rows after `lead` are
    checked to be one target video (one index, a video row's). An op is opaque to torch.compile: a compiled
    forward, which takes every video row as the target without reading the rows, runs this check on their values
    when it runs, inside its graph; the index it returns is the one the routed blocks use."""
    if not bool((index[lead:] == index[-1]).all()) or int(index[-1]) % MODALITIES != 0:
        raise UserError(f"{TARGET_LAYOUT}; these are not: with conditioning rows, run the routed model without "
                        f"torch.compile")
    return index[:lead + kept].clone()


@check_target_rows.register_fake
def _(index: torch.Tensor, lead: int, kept: int) -> torch.Tensor:
    return index.new_empty(lead + kept)


def _minimax_narrow(kw: dict, keep: torch.Tensor) -> None:
    """Each sample's leading rows and kept target rows of the RoPE (cos, sin) [S, rotary_dim]; the modulation index
    [S] keeps its leading rows and as many target rows as are kept (the target's rows share one index)."""
    lead = kw["hidden_states"].shape[1] - keep.shape[1]
    index = kw["adaln_indices"]
    positions = torch.cat([torch.arange(lead, device=keep.device).expand(keep.shape[0], -1), lead + keep], 1)
    kw["rotary_emb"] = tuple(RowsRope(table[positions.to(table.device)]) for table in kw["rotary_emb"])
    kw["adaln_indices"] = (check_target_rows(index, lead, keep.shape[1]) if torch.compiler.is_compiling()
                           else index[:lead + keep.shape[1]])  # eager: the rows were read by _minimax_lead


def _ernie_inputs(model, x_t, text, pooled, t) -> dict:
    """Latents [B, C, H, W], every text token real, t * 1000."""
    return dict(hidden_states=x_t, timestep=t * 1000, text_bth=text,
                text_lens=torch.full((len(t),), text.shape[1], device=x_t.device))


def minimax_inputs(x_t: torch.Tensor, text: torch.Tensor, t: torch.Tensor, audio: int, audio_channels: int) -> dict:
    """MiniMax H3's text-to-video-and-audio layout, [text | audio | video], of video latents [B, C, F, H, W] as rows
    (patch 1) beside random audio rows. Its batch shares one layout, timesteps included: every row is at the
    first sample's t (a bench times the step; the other samples' loss is not the flow-matching one)."""
    frames, rows, columns = x_t.shape[2:]
    n, text_len = frames * rows * columns, text.shape[1]
    length = text_len + audio + n
    grid = torch.stack(torch.meshgrid(*(torch.arange(g) for g in (frames, rows, columns)), indexing="ij"), -1)
    sequence = torch.arange(text_len + audio)[:, None] * torch.tensor([1, 0, 0])
    return dict(hidden_states=x_t.flatten(2).transpose(1, 2),
                audio_hidden_states=torch.randn(len(t), audio, audio_channels, device=x_t.device),
                encoder_hidden_states=text, timestep=t[:1], timestep_indices=torch.zeros(length, dtype=torch.long),
                token_tags=torch.tensor([1] * text_len + [2] * audio + [0] * n),
                position_ids=torch.cat([sequence, grid.reshape(n, 3)]),
                video_indices=torch.arange(text_len + audio, length),
                audio_indices=torch.arange(text_len, text_len + audio), text_indices=torch.arange(text_len))


def _minimax_inputs(model, x_t, text, pooled, t) -> dict:
    return minimax_inputs(x_t, text, t, audio=16, audio_channels=model.config.audio_in_channels)


def _ernie_model(channels: int, width: int, depth: int, text_dim: int, side: int):
    """Its zero-initialised modulation and output layers made random (zero, every step would give the same loss)."""
    from diffusers import ErnieImageTransformer2DModel

    model = ErnieImageTransformer2DModel(hidden_size=width, num_attention_heads=width // 64, num_layers=depth,
                                         ffn_hidden_size=4 * width, in_channels=channels, out_channels=channels,
                                         patch_size=2, text_in_dim=text_dim, rope_axes_dim=(16, 24, 24))
    for p in (*model.adaLN_modulation.parameters(), *model.final_linear.parameters()):
        torch.nn.init.normal_(p, std=0.02)
    return model


def _minimax_model(channels: int, width: int, depth: int, text_dim: int, side: int):
    """Patch 1, one refiner block before `depth` blocks, audio rows of the same width."""
    from diffusers import MiniMaxH3Transformer3DModel

    return MiniMaxH3Transformer3DModel(num_attention_heads=width // 64, attention_head_dim=64, hidden_size=width,
                                       num_layers=depth, num_refiner_layers=1, ffn_dim=4 * width,
                                       in_channels=channels, audio_in_channels=channels, patch_size=(1, 1, 1),
                                       text_dim=text_dim, time_embed_hidden_dim=width, time_embed_dim=width // 2,
                                       rope_freq_dim=8)


SEQUENCE_FAMILIES = {
    "ErnieImageTransformer2DModel": Family(("layers",), None, _ernie_narrow, latent_grid("patch_size", 2),
                                           tail=_ernie_tail, tokens="x", sequence_first=True,
                                           name="Ernie",
                                           example=Example("ernie", _ernie_model, image_latents, _ernie_inputs),
                                           relies_on={"forward": ("hidden_states", "text_bth", "text_lens"),
                                                      "layers": ("x", "rotary_pos_emb", "temb", "attention_mask")}),
    "MiniMaxH3Transformer3DModel": Family(("transformer_blocks",), None, _minimax_narrow, _minimax_grid,
                                          lead=_minimax_lead,
                                          name="MiniMax H3",
                                          example=Example("minimax", _minimax_model, video_latents(1), _minimax_inputs,
                                                          video=True),
                                          relies_on={"forward": ("hidden_states", "timestep_indices", "token_tags",
                                                                 "position_ids", "video_indices"),
                                                     "transformer_blocks": ("hidden_states", "adaln_indices",
                                                                            "rotary_emb")}),
}
FAMILIES.update(SEQUENCE_FAMILIES)
