"""TREAD with LoRA on a FLUX-architecture transformer whose base Linear weights are stored quantized, int8 weight-only
per output channel: by a Linear written here in torch (always), and by torchao itself where it is installed (it is
in no extra: docs/diffusers.md says why)."""
import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("diffusers")
pytest.importorskip("peft")
from backbones import apply_tread  # noqa: E402
from diffusers_tiny import build  # noqa: E402


class Int8Linear(torch.nn.Linear):
    """A Linear whose weight is int8 [out, in] with one float scale per output row (symmetric), dequantized at each
    call; it has no weight parameter, so nothing of the base can train."""

    def __init__(self, linear: torch.nn.Linear):
        torch.nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        scale = weight.abs().amax(1, keepdim=True).clamp_min(1e-8) / 127
        self.register_buffer("qweight", torch.round(weight / scale).to(torch.int8))
        self.register_buffer("scale", scale)
        self.bias = None if linear.bias is None else torch.nn.Parameter(linear.bias.detach(), requires_grad=False)

    @property
    def weight(self) -> torch.Tensor:
        return self.qweight.float() * self.scale

    def forward(self, x):
        return F.linear(x, self.weight, self.bias)


def quantized_flux():
    model, inputs, _ = build("flux")
    blocks = [*model.transformer_blocks, *model.single_transformer_blocks]
    for block in blocks:
        for name, module in list(block.named_modules()):
            if isinstance(module, torch.nn.Linear):
                parent = block.get_submodule(name.rpartition(".")[0]) if "." in name else block
                setattr(parent, name.rpartition(".")[2], Int8Linear(module))
    for p in model.parameters():
        p.requires_grad_(False)
    return model, inputs


def base_weights(model) -> dict:
    """Every base weight and buffer (dequantized where a tensor subclass holds it): what a step must leave alone."""
    return {k: (v.dequantize() if type(v) is not torch.Tensor else v).clone()
            for k, v in model.state_dict().items() if "lora_" not in k}


def check_routed_lora(model, inputs):
    """Only the adapters train, ratio 0 is the unrouted model bit for bit, a routed step leaves the base alone."""
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
    out = model(**inputs)[0]
    assert handle.last_keep[0].shape[1] == inputs["hidden_states"].shape[1] // 2
    assert torch.isfinite(out).all() and not torch.allclose(out, unrouted, atol=1e-4)
    out.square().mean().backward()
    grads = {n for n, p in model.named_parameters() if p.grad is not None}
    assert grads == lora  # lora_B starts at zero, so it is the one with a non-zero gradient on the first step
    assert all(model.get_parameter(n).grad.abs().sum() > 0 for n in grads if "lora_B" in n)
    opt.step()
    after = base_weights(model)
    assert all(torch.equal(after[k], v) for k, v in base.items())  # int8 weights, scales and biases unchanged


def test_routed_lora_on_a_hand_written_int8_base_trains_adapters_only():
    from peft import LoraConfig

    model, inputs = quantized_flux()
    model.add_adapter(LoraConfig(r=4, lora_alpha=4, init_lora_weights="gaussian",
                                 target_modules=["to_q", "to_k", "to_v"]))
    assert sum(isinstance(m, Int8Linear) for m in model.modules()) > 20  # the adapters wrap quantized layers
    check_routed_lora(model, inputs)
    assert all(v.dtype == torch.int8 for k, v in model.state_dict().items() if k.endswith("qweight"))


def test_routed_lora_on_a_torchao_int8_base_trains_adapters_only():
    pytest.importorskip("torchao")
    from lab.bench_diffusers import quantized_lora
    from torchao.quantization import Int8Tensor

    model, inputs, _ = build("flux")
    quantized_lora(model, rank=4)
    assert sum(isinstance(getattr(m, "weight", None), Int8Tensor) for m in model.modules()) > 20
    check_routed_lora(model, inputs)
