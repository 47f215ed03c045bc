"""tread_utils.attention, the models' attention backends, on the CPU: the registry's names are the config's, the
models call the selected backend, the backends that run here compute torch's attention, the others are refused in
one line (train.py's config entry included), the diffusers mapping, and the cuDNN guard's decision by version."""
import dataclasses
import sys
import types

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend

from conftest import assert_one_line_error, run_script, tiny_overrides
from training import config_schema as S
from tread_utils import attention as A
from tread_utils.errors import UserError
from tread_utils.precision import cudnn_attention_faults


@pytest.fixture(autouse=True)
def default_backend():
    """Each test starts and ends with the default selection (the selection is the process's)."""
    A.use_attention(A.DEFAULT, "train.attention")
    yield
    A.use_attention(A.DEFAULT, "train.attention")


def reference(q, k, v):
    """softmax(q k^T / sqrt(D)) v in float64, written out."""
    q, k, v = (t.double() for t in (q, k, v))
    return torch.softmax(q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5, dim=-1) @ v


def test_the_config_rule_reads_the_registrys_names():
    rule = {f.name: f for f in dataclasses.fields(S.TrainSchema)}["attention"].metadata["rule"]
    assert rule.allowed == f"one of {', '.join(A.BACKENDS)}"
    assert all(rule.ok(name) for name in A.BACKENDS) and not rule.ok("flash3")
    assert A.DEFAULT in A.BACKENDS
    rule = {f.name: f for f in dataclasses.fields(S.TrainSchema)}["attention_fp32"].metadata["rule"]
    assert rule.allowed == "one of sdpa, math" and not rule.ok("tf32") and A.DEFAULT in A.FLOAT32


# (heads, head dim, tokens): DiT-S/2's 64 at 256 tokens, DiT-XL/2's 72, FLUX's 128, and a routed sequence's 40
SHAPES = [(2, 64, 40), (2, 72, 17), (1, 128, 9)]


@pytest.mark.parametrize("name", ["sdpa", "flash", "math"])
@pytest.mark.parametrize("heads, head_dim, tokens", SHAPES)
def test_the_backends_that_run_on_the_cpu_compute_attention(name, heads, head_dim, tokens):
    """float32 (torch's choice under every backend) and bfloat16 (the forced kernel)."""
    A.use_attention(name, "train.attention", "cpu")
    q, k, v = torch.randn(3, 2, heads, tokens, head_dim).unbind(0)
    assert torch.allclose(A.attention(q, k, v).double(), reference(q, k, v), atol=1e-5)
    half = [t.bfloat16() for t in (q, k, v)]
    assert (A.attention(*half).double() - reference(*half)).abs().max() < 2e-2


@pytest.mark.parametrize("block", ["dit", "lightningdit"])
def test_the_models_attention_runs_the_selected_backend(block, monkeypatch):
    """DiT's and LightningDiT's attention call tread_utils.attention with [B, H, N, D] and use what it returns."""
    from backbones.lightningdit import RotaryAttention
    from dit import Attention

    torch.manual_seed(0)
    module = Attention(144, 2) if block == "dit" else RotaryAttention(144, 2)  # head dim 72
    x = torch.randn(2, 6, 144)
    args = (x,) if block == "dit" else (x, torch.stack(torch.meshgrid(torch.arange(2), torch.arange(3), indexing="ij"),
                                                      -1).reshape(1, 6, 2).expand(2, 6, 2))
    expected = module(*args)
    seen = []
    monkeypatch.setattr(A, "_float32", lambda q, k, v: seen.append(q.shape) or torch.zeros_like(q))  # float32 in
    assert torch.equal(module(*args), module.proj(torch.zeros_like(x)))
    assert seen == [(2, 2, 6, 72)]
    monkeypatch.undo()
    assert torch.equal(module(*args), expected)


def kernels(fn, *args) -> set:
    """The aten operators `fn(*args)` runs, by the profiler's names."""
    with torch.profiler.profile() as prof:
        fn(*args)
    return {e.key for e in prof.key_averages()}


def test_float32_attention_runs_its_own_kernel_and_half_precision_the_backends():
    """train.attention_fp32=math: float32 inputs go to torch's math kernel (its matmuls: TF32 on CUDA under
    train.tf32), the bf16 ones to the backend; the default leaves float32 to torch's choice (here its CPU flash)."""
    q, k, v = torch.randn(3, 2, 2, 17, 72).unbind(0)
    assert "aten::_scaled_dot_product_flash_attention_for_cpu" in kernels(A.attention, q, k, v)
    assert A.use_attention("flash", "train.attention", "cpu", "math") == (
        "attention: flash, torch's FlashAttention-2 kernel for bf16/fp16; float32 attention: math, torch's math "
        "kernel (TF32 batched matmuls on CUDA under train.tf32)")
    ran = kernels(A.attention, q, k, v)
    assert "aten::_scaled_dot_product_attention_math" in ran and "aten::bmm" in ran
    assert not any("flash" in name for name in ran)
    assert torch.allclose(A.attention(q, k, v).double(), reference(q, k, v), atol=1e-5)
    half = [t.bfloat16() for t in (q, k, v)]
    assert "aten::_scaled_dot_product_flash_attention_for_cpu" in kernels(A.attention, *half)


def test_compiled_float32_math_attention_stays_matmuls():
    """Under torch.compile (inductor) the forced math kernel is traced as its batched matmuls and a softmax, forward
    and backward: inductor's pattern matcher, which fuses a written-out attention back into SDPA, leaves it so."""
    from torch._inductor.utils import run_and_get_code

    A.use_attention("sdpa", "train.attention", "cpu", "math")
    q, k, v = (torch.randn(2, 2, 16, 8, requires_grad=True) for _ in range(3))
    compiled = torch.compile(A.attention)
    _, codes = run_and_get_code(lambda: compiled(q, k, v).sum().backward())
    calls = [line for code in codes for line in code.splitlines() if not line.strip().startswith("#")]
    assert sum("bmm(" in line for line in calls) >= 6  # 2 forward, 4 backward
    assert not any("scaled_dot_product" in line for line in calls)
    written_out = torch.compile(lambda q, k, v: torch.softmax(q @ k.transpose(-1, -2) * 8 ** -0.5, -1) @ v)
    _, codes = run_and_get_code(lambda: written_out(q, k, v).sum().backward())
    assert any("scaled_dot_product" in line for code in codes for line in code.splitlines()
               if not line.strip().startswith("#"))  # what the forced kernel avoids


def test_the_float32_block_after_a_route_is_the_one_float32_call():
    """A routed DiT under bf16 autocast: the block after the route (fp32_after_route) calls the float32 kernel,
    every other block the backend's."""
    from dit import DiT

    model = DiT(input_size=8, patch_size=2, in_channels=4, hidden_size=32, depth=6, num_heads=2, num_classes=10,
                enable_routing=True, routes=[dict(selection_ratio=0.5, start_layer_idx=1, end_layer_idx=3)]).train()
    calls = []
    A.use_attention("flash", "train.attention", "cpu", "math")
    for name in ("_selected", "_float32"):
        run = getattr(A, name)
        setattr(A, name, lambda q, k, v, run=run, name=name: calls.append((name, q.dtype, q.shape[2])) or run(q, k, v))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(torch.randn(2, 4, 8, 8), torch.rand(2), torch.tensor([1, 2]))
    assert calls == [("_selected", torch.bfloat16, 16), *[("_selected", torch.bfloat16, 8)] * 3,
                     ("_float32", torch.float32, 16), ("_selected", torch.bfloat16, 16)]


def test_a_forced_kernel_takes_half_precision_and_leaves_float32_to_torch(monkeypatch):
    """cuDNN's kernel does not exist on the CPU: forced, bfloat16 finds no kernel; float32 goes to torch's choice
    (the default float32 kernel) before the backend sees it."""
    monkeypatch.setattr(A, "_selected", A.forced(SDPBackend.CUDNN_ATTENTION))
    q = torch.randn(1, 2, 5, 8)
    assert torch.equal(A.attention(q, q, q), F.scaled_dot_product_attention(q, q, q))
    with pytest.raises(RuntimeError):
        A.attention(*(q.bfloat16(),) * 3)


def test_flash_attention_4_gets_and_gives_its_layout(monkeypatch):
    """The FlashAttention-4 path against a stand-in with its function's contract ([B, N, H, D] in, (out, lse) out):
    bfloat16 goes through it, float32 to torch's choice."""
    calls = []

    def flash_attn_func(q, k, v):
        calls.append(q.shape)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return out.transpose(1, 2).contiguous(), None

    monkeypatch.setitem(sys.modules, "flash_attn.cute", types.SimpleNamespace(flash_attn_func=flash_attn_func))
    monkeypatch.setattr(A, "_selected", A.flash_attention_4())
    q, k, v = torch.randn(3, 2, 3, 10, 72).unbind(0)
    half = [t.bfloat16() for t in (q, k, v)]
    assert torch.equal(A.attention(*half), F.scaled_dot_product_attention(*half)) and calls == [(2, 10, 3, 72)]
    assert torch.equal(A.attention(q, k, v), F.scaled_dot_product_attention(q, k, v)) and len(calls) == 1


def refusal(name, **kw) -> str:
    with pytest.raises(UserError) as e:
        A.check_attention(name, "train.attention", **kw)
    assert "\n" not in str(e.value) and len(str(e.value)) <= 300
    return str(e.value)


def test_backends_that_cannot_run_here_are_refused_in_one_line(monkeypatch):
    monkeypatch.setattr(A, "installed", lambda module: False)
    assert 'flash-attn-4 package, not installed here: pip install -e ".[hopper]"' in refusal("flash4", device="cpu")
    monkeypatch.setattr(A, "installed", lambda module: True)
    assert "flash4 runs on a CUDA GPU of sm90 or newer and this process runs on the cpu" in refusal("flash4", device="cpu")
    assert "cudnn runs on a CUDA GPU of sm80 or newer" in refusal("cudnn", device="cpu")
    assert "not an attention backend; use one of sdpa, flash" in refusal("flash3", device="cpu")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(A, "attention_stack", lambda: None)
    assert "runs on a CUDA GPU of sm90 or newer and this one is sm80" in refusal("flash4", device="cuda")
    assert A.check_attention("cudnn", "train.attention", "cuda") is A.BACKENDS["cudnn"]


@pytest.mark.parametrize("cudnn, refused", [(91900, True), (92600, False)])
def test_cudnn_is_refused_on_a_stack_seen_to_fault(monkeypatch, cudnn, refused):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(A, "attention_stack", lambda: ("2.11.0+cu130", cudnn, (9, 0)))
    if refused:
        assert "seen to fault with torch 2.11.0+cu130 and cuDNN 91900" in refusal("cudnn", device="cuda")
    else:
        assert A.check_attention("cudnn", "train.attention", "cuda") is A.BACKENDS["cudnn"]


def test_train_py_refuses_a_backend_it_cannot_run_before_writing_anything(tmp_path):
    """flash4 without its package (or, where it is installed, without a Hopper GPU): one line, exit 2."""
    results = tmp_path / "results"
    proc = run_script("train.py", f"results_dir={results}", *tiny_overrides("dit"), "train.attention=flash4")
    needle = "runs on a CUDA GPU" if A.installed("flash_attn.cute") else 'pip install -e ".[hopper]"'
    assert_one_line_error(proc, "train.attention=flash4", needle)
    assert proc.returncode == 2 and not results.exists()


def test_diffusers_transformers_take_the_mapped_backend():
    from diffusers_tiny import build

    model, inputs, _ = build("flux")
    backends = lambda: {getattr(m.processor._attention_backend, "value", None) for m in model.modules()
                        if hasattr(m, "processor")}
    with torch.no_grad():
        assert A.use_diffusers_attention(model, "sdpa", "--attention", "cpu") is None
        native = model(**inputs)[0]
        line = A.use_diffusers_attention(model, "math", "--attention", "cpu")
        assert line == "attention: math, diffusers' _native_math backend"
        assert backends() == {"_native_math"}
        assert torch.allclose(model(**inputs)[0], native, atol=1e-5)
    with pytest.raises(UserError, match="--attention=flash4 runs on a CUDA GPU"):
        A.use_diffusers_attention(model, "flash4", "--attention", "cpu")


def test_a_diffusers_refusal_is_one_line(monkeypatch):
    def set_attention_backend(name):  # diffusers' refusal where its backend's package is missing
        raise RuntimeError(f"Backend '{name}' is not usable because the `kernels` package isn't available.\nInstall it.")

    model = types.SimpleNamespace(set_attention_backend=set_attention_backend)
    monkeypatch.setattr(A, "check_attention", lambda *args, **kw: A.BACKENDS["flash4"])
    with pytest.raises(UserError, match=r"^--attention=flash4 \(diffusers' flash_4_hub\): Backend 'flash_4_hub' is "
                                        r"not usable because the `kernels` package isn't available.$"):
        A.use_diffusers_attention(model, "flash4", "--attention")


@pytest.mark.parametrize("capability, torch_version, cudnn, faults", [
    ((9, 0), "2.11.0+cu130", 91900, True),    # H100 / H200 with torch 2.11 and the cuDNN it ships: seen here
    ((9, 0), "2.11.0+cu130", 91300, True),    # the same with cuDNN 9.13
    ((9, 0), "2.11.0+cu130", 92600, False),   # a newer cuDNN installed over torch 2.11
    ((9, 0), "2.11.0+cu130", 92700, False),
    ((9, 0), "2.12.0+cu130", 92400, True),    # torch 2.11 or later with cuDNN before 9.26: NaN gradients, reported
    ((10, 0), "2.14.1+cu130", 92600, False),  # a Blackwell GPU, a cuDNN past every row
    ((9, 0), "2.10.0+cu128", 91400, True),    # cuDNN before 9.15.1: the illegal access, reported
    ((9, 0), "2.10.0+cu128", 91501, False),   # its fix, torch before 2.11
    ((9, 0), "2.11.0a0+git1234", None, True),  # a source build without cuDNN's version: treated as old
    ((8, 0), "2.11.0+cu130", 91300, False),   # an A100: torch does not pick cuDNN's attention first
    (None, "2.11.0", None, False),            # no GPU
])
def test_the_cudnn_decision_by_version(capability, torch_version, cudnn, faults):
    assert cudnn_attention_faults(torch_version, cudnn, capability) is faults


def test_finetune_lora_checks_its_attention_backend_before_building_anything():
    from tools import finetune_lora

    with pytest.raises(UserError, match="--attention=flash4 runs on a CUDA GPU of sm90 or newer and this process "
                                        "runs on the cpu") as err:
        finetune_lora.main(["--attention", "flash4", "--device", "cpu"])
    assert "\n" not in str(err.value)
