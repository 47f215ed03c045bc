"""The cuDNN attention guard's decision by version, on the CPU."""
import pytest

from tread_utils.precision import cudnn_attention_faults


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
