"""TREAD with LoRA on a FLUX-architecture transformer whose block Linear weights are quantized by torchao (int8
weight-only, one scale per output channel), as a quantized fine-tune runs: peft wraps the quantized layers, only
the adapters train, the int8 base stays as it was."""
import pytest
import torch

pytest.importorskip("diffusers")
pytest.importorskip("peft")
pytest.importorskip("torchao")
from backbones import apply_tread  # noqa: E402
from diffusers_tiny import build  # noqa: E402
from lab.bench_diffusers import quantized_lora  # noqa: E402


def test_routed_lora_on_an_int8_base_trains_adapters_only_and_ratio_zero_is_the_unrouted_model():
    from torchao.quantization import Int8Tensor

    model, inputs, _ = build("flux")
    quantized_lora(model, rank=4)
    quantized = [m for m in model.modules() if isinstance(getattr(m, "weight", None), Int8Tensor)]
    assert len(quantized) > 20  # every block Linear: the adapters wrap quantized layers
    lora = {n for n, p in model.named_parameters() if "lora_" in n}
    assert lora and {n for n, p in model.named_parameters() if p.requires_grad} == lora
    model.train()
    unrouted = model(**inputs)[0]
    zero = apply_tread(model, {"routes": [{"selection_ratio": 0.0, "start_layer_idx": 1, "end_layer_idx": 2}]})
    assert torch.equal(model(**inputs)[0], unrouted)
    zero.remove()

    handle = apply_tread(model, {"routes": [{"selection_ratio": 0.5, "start_layer_idx": 1, "end_layer_idx": 2}]})
    base = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" not in n}
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    out = model(**inputs)[0]
    assert handle.last_keep[0].shape[1] == inputs["hidden_states"].shape[1] // 2
    assert torch.isfinite(out).all() and not torch.allclose(out, unrouted, atol=1e-4)
    out.square().mean().backward()
    grads = {n for n, p in model.named_parameters() if p.grad is not None}
    assert grads == lora
    assert all(model.get_parameter(n).grad.abs().sum() > 0 for n in grads if "lora_B" in n)
    opt.step()
    after = dict(model.named_parameters())
    for n, before in base.items():  # the int8 data and scales and every other base weight, unchanged
        now = after[n].detach()
        assert type(now) is type(before) and torch.equal(now.dequantize() if hasattr(now, "dequantize") else now,
                                                         before.dequantize() if hasattr(before, "dequantize") else before)
