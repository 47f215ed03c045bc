"""lab.cudnn_attention_fault, the GPU check of the cuDNN attention guard: where it cannot run it says so in one
line and exits 2 (never 0, which would read as "no fault"), and its cases are the reported faults' shapes."""
import pytest
import torch

from lab import cudnn_attention_fault as check


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU answer; a GPU runs the cases")
def test_without_a_gpu_it_exits_2_in_one_line(capsys):
    assert check.main([]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["cannot run: no CUDA GPU"]


def test_the_cases_cover_the_reported_faults():
    masked_64_mod_128 = [c for c in check.CASES if c[4] and c[2] % 128 == 64]
    assert masked_64_mod_128, "pytorch#196678: a mask and a length of 64 mod 128"
    assert {c[3] for c in check.CASES} == {72, 128}, "DiT-XL/2's and FLUX's head dims"
    assert max(c[2] for c in check.CASES) > 16384, "pytorch#122695: a long sequence"
