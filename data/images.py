"""[-1, 1] pixel-space tensors -> uint8 RGB images: the one conversion that decoding (digits) and
evaluation (classifier and Inception inputs) share."""
import torch


def latents_to_uint8(x):
    """[-1, 1] images/latents [N, C, H, W] with C = 1 (grey, repeated) or 3 -> uint8 [N, H, W, 3].

    ``round((x + 1) * 127.5)`` clamped to [0, 255] (round half to even). Torch in, torch out (same
    device); numpy in, numpy out. This is how digits latents become "images" for the classifier.
    """
    is_numpy = not torch.is_tensor(x)
    t = torch.as_tensor(x)
    if t.dim() != 4 or t.shape[1] not in (1, 3):
        raise ValueError(f"expected latents of shape [N, 1 or 3, H, W], got {tuple(t.shape)}")
    t = torch.round((t.detach().to(torch.float32) + 1.0) * 127.5).clamp_(0, 255).to(torch.uint8)
    t = t.permute(0, 2, 3, 1)
    if t.shape[-1] == 1:
        t = t.expand(-1, -1, -1, 3)
    t = t.contiguous()
    return t.cpu().numpy() if is_numpy else t
