"""TREAD with LoRA on a FLUX-architecture transformer whose base Linear weights are stored int8 weight-only per
output channel, as `lab.bench_diffusers.quantized_lora` builds it: by optimum-quanto (qint8, in the test and lora
extras: always), and by torchao where it is installed (it is in no extra: docs/diffusers.md says why)."""
import pytest
import torch

pytest.importorskip("diffusers")
pytest.importorskip("peft")
from diffusers_tiny import build  # noqa: E402
from lab.bench_diffusers import quantized_lora  # noqa: E402
from tread_diffusers import apply_tread  # noqa: E402


def base_weights(model) -> dict:
    """Every base weight and buffer (dequantized where a tensor subclass holds it): what a step must leave alone."""
    return {k: (v.dequantize() if type(v) is not torch.Tensor else v).clone()
            for k, v in model.state_dict().items() if "lora_" not in k}


def check_routed_lora(model, inputs):
    """Only the adapters train, ratio 0 is the unrouted model bit for bit, a routed step leaves the base alone and
    gives every input token a gradient."""
    lora = {n for n, p in model.named_parameters() if "lora_" in n}
    assert lora and {n for n, p in model.named_parameters() if p.requires_grad} == lora
    model.train()
    unrouted = model(**inputs)[0]
    zero = apply_tread(model, {"routes": [{"selection_ratio": 0.0, "start_layer_idx": 1, "end_layer_idx": 2}]})
    assert torch.equal(model(**inputs)[0], unrouted)
    zero.remove()

    handle = apply_tread(model, {"routes": [{"selection_ratio": 0.5, "start_layer_idx": 1, "end_layer_idx": 2}]})
    base = base_weights(model)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    x = inputs["hidden_states"].clone().requires_grad_()
    out = model(**{**inputs, "hidden_states": x})[0]
    assert handle.last_keep[0].shape[1] == x.shape[1] // 2
    assert torch.isfinite(out).all() and not torch.allclose(out, unrouted, atol=1e-4)
    out.square().mean().backward()
    assert (x.grad.abs().sum(-1) > 0).all()  # the skipped tokens too, through the blocks around the route
    grads = {n for n, p in model.named_parameters() if p.grad is not None}
    assert grads == lora  # lora_B starts at zero, so it is the one with a non-zero gradient on the first step
    assert all(model.get_parameter(n).grad.abs().sum() > 0 for n in grads if "lora_B" in n)
    opt.step()
    after = base_weights(model)
    assert all(torch.equal(after[k], v) for k, v in base.items())  # int8 weights, scales and biases unchanged


def test_routed_lora_on_a_quanto_int8_base_trains_adapters_only():
    from optimum.quanto import QLinear

    model, inputs, _ = build("flux")
    quantized_lora(model, rank=4, library="quanto")
    quantized = [m for m in model.modules() if isinstance(m, QLinear)]
    assert len(quantized) > 20 and all(m.weight._data.dtype == torch.int8 for m in quantized)
    check_routed_lora(model, inputs)


def test_routed_lora_on_a_torchao_int8_base_trains_adapters_only():
    pytest.importorskip("torchao")
    from torchao.quantization import Int8Tensor

    model, inputs, _ = build("flux")
    quantized_lora(model, rank=4, library="torchao")
    assert sum(isinstance(getattr(m, "weight", None), Int8Tensor) for m in model.modules()) > 20
    check_routed_lora(model, inputs)
