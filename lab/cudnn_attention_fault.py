"""Does cuDNN's fused attention fault in backward on this GPU? The smallest check of what
tread_utils.precision.cudnn_attention_faults decides by version, run where the decision is made:

    python -m lab.cudnn_attention_fault --out cudnn_attention.json

Each case runs scaled_dot_product_attention forward and backward under cuDNN's backend alone, in a process of
its own (an illegal memory access leaves the CUDA context unusable), in bfloat16, and compares the gradients with
the math backend's: a case faults when it raises, or gives a non-finite or wrong gradient. The cases are the
shapes the faults were reported at (pytorch#196678: a mask and a length of 64 mod 128; pytorch#122695: long
sequences) at FLUX's head dim 128 and DiT-XL/2's 72. Exit status: 1 if a case faulted, 0 if none did, 2 where it
cannot run (no CUDA GPU, or no cuDNN attention in this torch). The record names the versions and the guard's
decision, so a run on a new stack says whether the guard keys on the right versions.
"""
import argparse
import json
import subprocess
import sys

CASES = [  # (batch, heads, length, head dim, with a mask)
    (1, 24, 4672, 128, True), (1, 24, 4672, 128, False), (2, 24, 4608, 128, True),
    (2, 16, 320, 72, True), (8, 16, 256, 72, False), (1, 24, 16448, 128, False),
]
TOLERANCE = 0.05  # bfloat16 gradients against the math backend's, relative to the largest


def run_case(batch: int, heads: int, length: int, dim: int, masked: bool) -> dict:
    """One case in this process: what went wrong, or None."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.manual_seed(0)
    shape = (batch, heads, length, dim)
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    mask = None
    if masked:  # the padded text of a prompt: the last eighth of the keys masked out for every query
        mask = torch.ones(batch, 1, length, length, device="cuda", dtype=torch.bool)
        mask[..., length - length // 8:] = False
    grads = {}
    for backend in (SDPBackend.MATH, SDPBackend.CUDNN_ATTENTION):
        for t in (q, k, v):
            t.grad = None
        try:
            with sdpa_kernel(backend):
                F.scaled_dot_product_attention(q, k, v, attn_mask=mask).float().square().mean().backward()
            torch.cuda.synchronize()
        except RuntimeError as e:
            if backend == SDPBackend.MATH:
                raise
            return {"fault": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
        grads[backend] = [t.grad.float() for t in (q, k, v)]
    for name, ours, ref in zip("qkv", grads[SDPBackend.CUDNN_ATTENTION], grads[SDPBackend.MATH]):
        if not torch.isfinite(ours).all():
            return {"fault": f"non-finite {name} gradient"}
        error = float((ours - ref).abs().max() / ref.abs().max().clamp_min(1e-12))
        if error > TOLERANCE:
            return {"fault": f"{name} gradient off by {error:.3f} of its largest value"}
    return {"fault": None}


def stack() -> dict:
    import torch

    from tread_utils.precision import attention_stack, cudnn_attention_faults

    found = attention_stack()
    if found is None:
        return {"cannot_run": "no CUDA GPU"}
    version, cudnn, capability = found
    return {"torch": version, "cudnn": cudnn, "capability": list(capability),
            "device": torch.cuda.get_device_name(), "guard_turns_cudnn_off": cudnn_attention_faults(*found)}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m lab.cudnn_attention_fault", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", help="write the record (JSON) here too")
    p.add_argument("--case", type=int, help=argparse.SUPPRESS)  # one case, in the child process
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.case is not None:
        print(json.dumps(run_case(*CASES[args.case])))
        return 0
    record = stack()
    if "cannot_run" not in record:
        import torch

        if not hasattr(torch.backends.cuda, "cudnn_sdp_enabled"):
            record["cannot_run"] = "this torch has no cuDNN attention backend"
    if "cannot_run" in record:
        print(f"cannot run: {record['cannot_run']}", file=sys.stderr)
        return 2
    record["cases"] = []
    for i, case in enumerate(CASES):
        child = subprocess.run([sys.executable, "-m", "lab.cudnn_attention_fault", "--case", str(i)],
                               capture_output=True, text=True)
        lines = child.stdout.strip().splitlines()
        result = json.loads(lines[-1]) if child.returncode == 0 and lines else {
            "fault": f"the process died (exit {child.returncode}): {(child.stderr.strip().splitlines() or [''])[-1][:200]}"}
        record["cases"].append({"batch": case[0], "heads": case[1], "length": case[2], "head_dim": case[3],
                                "mask": case[4], **result})
        print(f"{case}: {result['fault'] or 'ok'}", flush=True)
    record["faulted"] = any(c["fault"] for c in record["cases"])
    record["guard_right"] = not record["faulted"] or record["guard_turns_cudnn_off"]  # it may keep off a stack that runs
    if args.out:
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)
    print(f"cuDNN attention {'FAULTED' if record['faulted'] else 'ran every case'}; the guard "
          f"{'turns it off' if record['guard_turns_cudnn_off'] else 'keeps it'} on this stack")
    return 1 if record["faulted"] else 0


if __name__ == "__main__":
    sys.exit(main())
