"""Shared GPU check for the kernel tests: outputs and gradients against a float64 reference.

For each case the op runs three ways on the same fresh random inputs: PyTorch's own implementation in
float64 (the reference), PyTorch's own implementation in the test dtype (the bar), and the TileLang
kernel through the tiletune custom op with strict=True (no silent fallback), its outputs allocated
from memory poisoned with NaN first. Each output and gradient must pass tiletune.numerics.gate.
Every verdict is appended to $TILETUNE_GPU_TABLE when set (the committed results table).
"""

from __future__ import annotations

import os

import torch

from tiletune.numerics import gate


def poison_allocator() -> None:
    """Fill a large block of the caching allocator with NaN and free it, so unwritten outputs show."""
    free, _ = torch.cuda.mem_get_info()
    buf = torch.empty(int(min(free * 0.4, 16e9)) // 4, dtype=torch.float32, device="cuda")
    buf.fill_(float("nan"))
    del buf


def _run(fn, inputs, grad_outputs):
    outs = fn(*inputs)
    outs = outs if isinstance(outs, tuple) else (outs,)
    leaves = [x for x in inputs if isinstance(x, torch.Tensor) and x.requires_grad]
    grads = torch.autograd.grad(outs, leaves, [g.to(o.dtype) for g, o in zip(grad_outputs, outs)])
    return [o.detach() for o in outs], list(grads)


def check(op: str, case: str, dtype, inputs, torch_fn, kernel_fn, names) -> None:
    """Run the three ways, gate every output and gradient, record the rows, assert all pass."""
    def clone(x, to):
        return x.detach().to(to).requires_grad_(x.requires_grad) if isinstance(x, torch.Tensor) else x

    lp = [clone(x, dtype) for x in inputs]  # inputs are drawn in `dtype`, so both see the same values
    hp = [clone(x, torch.float64) for x in inputs]
    with torch.no_grad():
        probe = torch_fn(*lp)
    probe = probe if isinstance(probe, tuple) else (probe,)
    grad_outputs = [torch.randn_like(p, dtype=torch.float64) for p in probe]
    ref_out, ref_grad = _run(torch_fn, hp, grad_outputs)
    t_out, t_grad = _run(torch_fn, lp, grad_outputs)
    poison_allocator()
    k_out, k_grad = _run(kernel_fn, lp, grad_outputs)
    torch.cuda.synchronize()
    rows, failed = [], []
    for name, k, t, r in zip(names, k_out + k_grad, t_out + t_grad, ref_out + ref_grad):
        v = gate(k, t, r)
        row = (f"{op:9s} {str(dtype).removeprefix('torch.'):9s} {case:28s} {name:8s} "
               f"kernel {v.patched.rel_l2:9.3e}  torch {v.stock.rel_l2:9.3e}  ratio {v.ratio:5.2f}  "
               f"maxabs {v.patched.max_abs:9.3e}  {'PASS' if v.passed else 'FAIL'}")
        rows.append(row)
        if not v.passed:
            failed.append(row)
    table = os.environ.get("TILETUNE_GPU_TABLE")
    if table:
        with open(table, "a") as f:
            f.write("\n".join(rows) + "\n")
    assert not failed, "\n".join(failed)
