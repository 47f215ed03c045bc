"""The tiny families of the family checks whose blocks run one sequence of every modality (as in
tread_diffusers/sequence_families.py): Ernie and MiniMax H3, each returned with its inputs and token grid, and
MiniMax H3's packed layout. tests/test_diffusers_sequence_families.py routes them by hand (tests/diffusers_tiny_entry.py
says what an entry holds)."""
import torch

from diffusers_tiny_entry import TINY, Tiny
from lab.diffusers_tiny_models import B


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


CHECKED_BY = "tests/test_diffusers_sequence_families.py"
TINY.update({"ernie": Tiny("ErnieImageTransformer2DModel", ernie, checked_by=CHECKED_BY),
             "minimax": Tiny("MiniMaxH3Transformer3DModel", minimax, checked_by=CHECKED_BY)})
