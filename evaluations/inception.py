"""PyTorch port of the 2015-12-05 TensorFlow Inception graph used by FID and the ADM evaluation suite.

The network is the "FID Inception": torchvision's Inception-v3 module layout with 1008 classes, no
auxiliary head, and the pooling changes of the TF graph inside the mixed blocks:

* Mixed_5b/5c/5d (A blocks), Mixed_6b..6e (C blocks) and Mixed_7b (first E block): the pool branch
  is a 3x3 average pool, stride 1, padding 1, that does NOT count the padding (TF's AvgPool 'SAME').
* Mixed_7c (last E block): the pool branch is a 3x3 max pool, stride 1, padding 1.

It has exactly 23,850,960 parameters and loads the published PyTorch weights
``pt_inception-2015-12-05-6726825d.pth`` (pytorch-fid release ``fid_weights``) unchanged; finding, checking and
loading them is evaluations/inception_weights.py's (``load_inception``).

Input handling copies the TF graph: uint8 NHWC images in [0, 255] become float32, are resized to
299x299 with TF1's legacy bilinear rule (align_corners=False and no half-pixel offset:
``src = dst * in / out``, neighbour indices clamped to the edge), then normalised with (x - 128) / 128.

Outputs of :meth:`InceptionV3FID.forward` (a dict of float32 tensors):

* ``pool``    [N, 2048]  pool_3 features (FID, precision/recall)
* ``spatial`` [N, 2023]  ``mixed_6/conv`` = ``Mixed_6d.branch1x1`` output (17x17x192), first 7
  channels, flattened in (h, w, c) order (sFID)
* ``logits``  [N, 1008]  ``pool @ fc.weight.T`` with NO bias (Inception Score); absent when the weights
  came from a file without a logits layer (a pool_3 TorchScript, see evaluations/inception_torchscript.py)
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn as nn
import torch.nn.functional as F

NUM_PARAMETERS = 23_850_960
RESOLUTION = 299
POOL_DIM = 2048
SPATIAL_DIM = 17 * 17 * 7
NUM_LOGITS = 1008


# --------------------------------------------------------------------------------------------
# Preprocessing: TF1 legacy bilinear resize
# --------------------------------------------------------------------------------------------
def _legacy_resize_weights(in_size: int, out_size: int, device):
    """Lower/upper source indices and lerp weights of TF1 ResizeBilinear (align_corners=False,
    half_pixel_centers=False). All arithmetic in float32 as in the TF kernel."""
    scale = torch.tensor(float(in_size), dtype=torch.float32) / torch.tensor(float(out_size), dtype=torch.float32)
    src = torch.arange(out_size, dtype=torch.float32) * scale
    lower_f = torch.floor(src)
    lerp = src - lower_f
    lower = lower_f.to(torch.int64).clamp(0, in_size - 1)
    upper = torch.ceil(src).to(torch.int64).clamp(max=in_size - 1)
    return lower.to(device), upper.to(device), lerp.to(device)


def tf1_resize_bilinear(images: torch.Tensor, out_h: int, out_w: int) -> torch.Tensor:
    """Resize float NHWC ``images`` to (out_h, out_w) with TF1's legacy bilinear rule.

    ``src = dst * in / out`` (no half-pixel offset), ``lower = floor(src)``,
    ``upper = min(ceil(src), in - 1)``; interpolated along the width first, then along the height,
    each as ``a + (b - a) * lerp`` like TF's kernel (computed in place on the gathered ``b``: the same
    values, without two more image-sized temporaries).
    """
    if images.dim() != 4:
        raise ValueError(f"expected NHWC images, got shape {tuple(images.shape)}")
    _, in_h, in_w, _ = images.shape
    x = images
    if in_w != out_w:
        lo, hi, t = _legacy_resize_weights(in_w, out_w, x.device)
        left = x[:, :, lo, :]
        x = x[:, :, hi, :].sub_(left).mul_(t.to(x.dtype).view(1, 1, -1, 1)).add_(left)
        del left
    if in_h != out_h:
        lo, hi, t = _legacy_resize_weights(in_h, out_h, x.device)
        top = x[:, lo]
        x = x[:, hi].sub_(top).mul_(t.to(x.dtype).view(1, -1, 1, 1)).add_(top)
        del top
    return x


def preprocess_uint8_nhwc(images) -> torch.Tensor:
    """uint8 NHWC [0, 255] -> float32 NCHW 299x299 normalised with (x - 128) / 128."""
    x = images.to(torch.float32)
    x = tf1_resize_bilinear(x, RESOLUTION, RESOLUTION)
    if x.data_ptr() == images.data_ptr():  # a float input already 299x299: not the caller's tensor in place
        x = x.clone()
    x.sub_(128.0).div_(128.0)
    return x.permute(0, 3, 1, 2).contiguous()


# --------------------------------------------------------------------------------------------
# Network (module names follow torchvision so the published state dict loads as is)
# --------------------------------------------------------------------------------------------
class BasicConv2d(nn.Module):
    """conv (no bias) -> batch norm (eps 1e-3, as in the TF graph) -> ReLU."""

    def __init__(self, in_channels: int, out_channels: int, **conv_kwargs):
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, bias=False, **conv_kwargs)
        self.bn = nn.BatchNorm2d(out_channels, eps=0.001)

    def forward(self, x):
        return F.relu(self.bn(self.conv(x)), inplace=True)  # in place on batch norm's fresh output: same values


def _avg_pool_same(x):
    # TF AvgPool with 'SAME' padding divides by the number of real (non-padded) pixels.
    return F.avg_pool2d(x, kernel_size=3, stride=1, padding=1, count_include_pad=False)


class FIDInceptionA(nn.Module):
    def __init__(self, in_channels: int, pool_features: int):
        super().__init__()
        self.branch1x1 = BasicConv2d(in_channels, 64, kernel_size=1)
        self.branch5x5_1 = BasicConv2d(in_channels, 48, kernel_size=1)
        self.branch5x5_2 = BasicConv2d(48, 64, kernel_size=5, padding=2)
        self.branch3x3dbl_1 = BasicConv2d(in_channels, 64, kernel_size=1)
        self.branch3x3dbl_2 = BasicConv2d(64, 96, kernel_size=3, padding=1)
        self.branch3x3dbl_3 = BasicConv2d(96, 96, kernel_size=3, padding=1)
        self.branch_pool = BasicConv2d(in_channels, pool_features, kernel_size=1)

    def forward(self, x):
        b1 = self.branch1x1(x)
        b5 = self.branch5x5_2(self.branch5x5_1(x))
        b3 = self.branch3x3dbl_3(self.branch3x3dbl_2(self.branch3x3dbl_1(x)))
        bp = self.branch_pool(_avg_pool_same(x))
        return torch.cat([b1, b5, b3, bp], 1)


class InceptionB(nn.Module):
    """Grid reduction 35 -> 17 (Mixed_6a); unchanged from torchvision."""

    def __init__(self, in_channels: int):
        super().__init__()
        self.branch3x3 = BasicConv2d(in_channels, 384, kernel_size=3, stride=2)
        self.branch3x3dbl_1 = BasicConv2d(in_channels, 64, kernel_size=1)
        self.branch3x3dbl_2 = BasicConv2d(64, 96, kernel_size=3, padding=1)
        self.branch3x3dbl_3 = BasicConv2d(96, 96, kernel_size=3, stride=2)

    def forward(self, x):
        b3 = self.branch3x3(x)
        bd = self.branch3x3dbl_3(self.branch3x3dbl_2(self.branch3x3dbl_1(x)))
        bp = F.max_pool2d(x, kernel_size=3, stride=2)
        return torch.cat([b3, bd, bp], 1)


class FIDInceptionC(nn.Module):
    def __init__(self, in_channels: int, channels_7x7: int):
        super().__init__()
        c7 = channels_7x7
        self.branch1x1 = BasicConv2d(in_channels, 192, kernel_size=1)
        self.branch7x7_1 = BasicConv2d(in_channels, c7, kernel_size=1)
        self.branch7x7_2 = BasicConv2d(c7, c7, kernel_size=(1, 7), padding=(0, 3))
        self.branch7x7_3 = BasicConv2d(c7, 192, kernel_size=(7, 1), padding=(3, 0))
        self.branch7x7dbl_1 = BasicConv2d(in_channels, c7, kernel_size=1)
        self.branch7x7dbl_2 = BasicConv2d(c7, c7, kernel_size=(7, 1), padding=(3, 0))
        self.branch7x7dbl_3 = BasicConv2d(c7, c7, kernel_size=(1, 7), padding=(0, 3))
        self.branch7x7dbl_4 = BasicConv2d(c7, c7, kernel_size=(7, 1), padding=(3, 0))
        self.branch7x7dbl_5 = BasicConv2d(c7, 192, kernel_size=(1, 7), padding=(0, 3))
        self.branch_pool = BasicConv2d(in_channels, 192, kernel_size=1)

    def forward(self, x, return_branch1x1: bool = False):
        b1 = self.branch1x1(x)
        b7 = self.branch7x7_3(self.branch7x7_2(self.branch7x7_1(x)))
        bd = x
        for layer in (self.branch7x7dbl_1, self.branch7x7dbl_2, self.branch7x7dbl_3,
                      self.branch7x7dbl_4, self.branch7x7dbl_5):
            bd = layer(bd)
        bp = self.branch_pool(_avg_pool_same(x))
        out = torch.cat([b1, b7, bd, bp], 1)
        return (out, b1) if return_branch1x1 else out


class InceptionD(nn.Module):
    """Grid reduction 17 -> 8 (Mixed_7a); unchanged from torchvision."""

    def __init__(self, in_channels: int):
        super().__init__()
        self.branch3x3_1 = BasicConv2d(in_channels, 192, kernel_size=1)
        self.branch3x3_2 = BasicConv2d(192, 320, kernel_size=3, stride=2)
        self.branch7x7x3_1 = BasicConv2d(in_channels, 192, kernel_size=1)
        self.branch7x7x3_2 = BasicConv2d(192, 192, kernel_size=(1, 7), padding=(0, 3))
        self.branch7x7x3_3 = BasicConv2d(192, 192, kernel_size=(7, 1), padding=(3, 0))
        self.branch7x7x3_4 = BasicConv2d(192, 192, kernel_size=3, stride=2)

    def forward(self, x):
        b3 = self.branch3x3_2(self.branch3x3_1(x))
        b7 = self.branch7x7x3_4(self.branch7x7x3_3(self.branch7x7x3_2(self.branch7x7x3_1(x))))
        bp = F.max_pool2d(x, kernel_size=3, stride=2)
        return torch.cat([b3, b7, bp], 1)


class FIDInceptionE(nn.Module):
    """E block; ``pool='avg'`` for Mixed_7b, ``pool='max'`` for Mixed_7c (as in the TF graph)."""

    def __init__(self, in_channels: int, pool: str):
        super().__init__()
        if pool not in ("avg", "max"):
            raise ValueError(f"pool must be 'avg' or 'max', got {pool!r}")
        self.pool = pool
        self.branch1x1 = BasicConv2d(in_channels, 320, kernel_size=1)
        self.branch3x3_1 = BasicConv2d(in_channels, 384, kernel_size=1)
        self.branch3x3_2a = BasicConv2d(384, 384, kernel_size=(1, 3), padding=(0, 1))
        self.branch3x3_2b = BasicConv2d(384, 384, kernel_size=(3, 1), padding=(1, 0))
        self.branch3x3dbl_1 = BasicConv2d(in_channels, 448, kernel_size=1)
        self.branch3x3dbl_2 = BasicConv2d(448, 384, kernel_size=3, padding=1)
        self.branch3x3dbl_3a = BasicConv2d(384, 384, kernel_size=(1, 3), padding=(0, 1))
        self.branch3x3dbl_3b = BasicConv2d(384, 384, kernel_size=(3, 1), padding=(1, 0))
        self.branch_pool = BasicConv2d(in_channels, 192, kernel_size=1)

    def forward(self, x):
        b1 = self.branch1x1(x)
        b3 = self.branch3x3_1(x)
        b3 = torch.cat([self.branch3x3_2a(b3), self.branch3x3_2b(b3)], 1)
        bd = self.branch3x3dbl_2(self.branch3x3dbl_1(x))
        bd = torch.cat([self.branch3x3dbl_3a(bd), self.branch3x3dbl_3b(bd)], 1)
        if self.pool == "avg":
            pooled = _avg_pool_same(x)
        else:
            pooled = F.max_pool2d(x, kernel_size=3, stride=1, padding=1)
        bp = self.branch_pool(pooled)
        return torch.cat([b1, b3, bd, bp], 1)


class InceptionV3FID(nn.Module):
    """The FID Inception network. ``forward(uint8 NHWC images)`` -> dict(pool, spatial, logits)."""

    feature_dims = {"pool": POOL_DIM, "spatial": SPATIAL_DIM, "logits": NUM_LOGITS}

    def __init__(self):
        super().__init__()
        self.Conv2d_1a_3x3 = BasicConv2d(3, 32, kernel_size=3, stride=2)
        self.Conv2d_2a_3x3 = BasicConv2d(32, 32, kernel_size=3)
        self.Conv2d_2b_3x3 = BasicConv2d(32, 64, kernel_size=3, padding=1)
        self.Conv2d_3b_1x1 = BasicConv2d(64, 80, kernel_size=1)
        self.Conv2d_4a_3x3 = BasicConv2d(80, 192, kernel_size=3)
        self.Mixed_5b = FIDInceptionA(192, pool_features=32)
        self.Mixed_5c = FIDInceptionA(256, pool_features=64)
        self.Mixed_5d = FIDInceptionA(288, pool_features=64)
        self.Mixed_6a = InceptionB(288)
        self.Mixed_6b = FIDInceptionC(768, channels_7x7=128)
        self.Mixed_6c = FIDInceptionC(768, channels_7x7=160)
        self.Mixed_6d = FIDInceptionC(768, channels_7x7=160)
        self.Mixed_6e = FIDInceptionC(768, channels_7x7=192)
        self.Mixed_7a = InceptionD(768)
        self.Mixed_7b = FIDInceptionE(1280, pool="avg")
        self.Mixed_7c = FIDInceptionE(2048, pool="max")
        self.fc = nn.Linear(2048, NUM_LOGITS)
        self.has_logits = True  # False for weights without a logits layer: forward then gives no 'logits'
        self.eval()

    # ---- the part of the graph after preprocessing ---------------------------------------
    def forward_features(self, x: torch.Tensor):
        """x: preprocessed float32 NCHW 299x299. Returns (pool [N,2048], Mixed_6d.branch1x1 NCHW)."""
        x = self.Conv2d_1a_3x3(x)
        x = self.Conv2d_2a_3x3(x)
        x = self.Conv2d_2b_3x3(x)
        x = F.max_pool2d(x, kernel_size=3, stride=2)
        x = self.Conv2d_3b_1x1(x)
        x = self.Conv2d_4a_3x3(x)
        x = F.max_pool2d(x, kernel_size=3, stride=2)
        x = self.Mixed_5b(x)
        x = self.Mixed_5c(x)
        x = self.Mixed_5d(x)
        x = self.Mixed_6a(x)
        x = self.Mixed_6b(x)
        x = self.Mixed_6c(x)
        x, mixed_6_conv = self.Mixed_6d(x, return_branch1x1=True)
        x = self.Mixed_6e(x)
        x = self.Mixed_7a(x)
        x = self.Mixed_7b(x)
        x = self.Mixed_7c(x)
        pool = x.mean(dim=(2, 3))  # pool_3: 8x8 average pool
        return pool, mixed_6_conv

    def forward(self, images: torch.Tensor) -> dict:
        """images: uint8 (or float in [0, 255]) tensor [N, H, W, 3]."""
        if not torch.is_tensor(images):
            images = torch.as_tensor(images)
        if images.dim() != 4 or images.shape[-1] != 3:
            raise ValueError(f"expected images of shape [N, H, W, 3], got {tuple(images.shape)}")
        images = images.to(self.fc.weight.device)
        flags = (torch.backends.cudnn.flags(enabled=True, allow_tf32=False)
                 if images.is_cuda else contextlib.nullcontext())
        with torch.no_grad(), flags:
            x = preprocess_uint8_nhwc(images)
            pool, mixed_6_conv = self.forward_features(x)
            spatial = mixed_6_conv[:, :7].permute(0, 2, 3, 1).reshape(len(pool), -1)  # (h, w, c)
            out = {"pool": pool, "spatial": spatial}
            if self.has_logits:
                # no bias, as in ADM's softmax(pool3 @ W); float64 so TF32 settings cannot touch it
                out["logits"] = (pool.double() @ self.fc.weight.double().t()).float()
        return out

    def train(self, mode: bool = True):  # a feature extractor never trains (batch norm stays frozen)
        return super().train(False)


# --------------------------------------------------------------------------------------------
# A network without weights (the published ones: evaluations/inception_weights.py)
# --------------------------------------------------------------------------------------------
def random_init_inception(seed: int = 0) -> InceptionV3FID:
    """A randomly initialised network (tests and smoke runs only: its numbers mean nothing).

    Convolutions use He-normal initialisation so activations keep their scale through the depth.
    The global RNG state is left untouched.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = InceptionV3FID()
        for module in model.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, mode="fan_in", nonlinearity="relu")
            elif isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=0.01)
                nn.init.zeros_(module.bias)
    for p in model.parameters():
        p.requires_grad_(False)
    return model.eval()


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
