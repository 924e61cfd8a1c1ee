"""Tile-shape variants of the memory-bound TileLang kernels against the memory floor, and the CPU cost
of each layer of an op call. Used to choose the tilings in the op modules (notes in docs/kernels.md).

    python benchmarks/kernel_variants.py

The floor is bytes moved (each input read once, each output written once) over the device-to-device
copy bandwidth measured in the same run (bytes read + written).
"""

from __future__ import annotations

import time

import torch

from tiletune.kernels import _tilelang, rms_norm, rope, swiglu

TOKENS, HIDDEN, INTER = 8192, 4096, 14336
BF16 = "bfloat16"


def bench(fn) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def copy_bandwidth() -> float:
    """Bytes per ms of a large device-to-device copy, counting read + write."""
    src = torch.randn(2**30 // 4, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() * 4 / bench(lambda: dst.copy_(src))


def sweep(name, items, nbytes, bandwidth):
    """Compile every (label, prim_func, args) variant in parallel, time each, print ms and % of the floor."""
    tl = _tilelang.tilelang()
    target = _tilelang.parse_target(_tilelang.device_target())
    kernels = tl.par_compile([func for _, func, _ in items], target=target, ignore_error=True)
    floor = nbytes / bandwidth
    for (label, _, args), kernel in zip(items, kernels):
        if kernel is None:
            print(f"{name:12s} {label:34s} failed to compile")
            continue
        ms = bench(lambda kernel=kernel, args=args: kernel(*args))
        print(f"{name:12s} {label:34s} {ms:7.3f} ms  floor {floor:6.3f}  {100 * floor / ms:5.1f}% of floor", flush=True)


def variants(bandwidth):
    dev, dt = "cuda", torch.bfloat16
    x = torch.randn(TOKENS, HIDDEN, device=dev, dtype=dt)
    dy = torch.randn_like(x)
    w = torch.randn(HIDDEN, device=dev, dtype=dt)
    mb = x.numel() * 2
    fwd_args = (x, w, torch.empty_like(x))
    sweep("rms_norm fwd", [(f"rows,threads={t}", rms_norm.forward_kernel(HIDDEN, 1e-5, BF16, t), fwd_args)
                           for t in [(1, 256), (1, 512), (1, 128), (2, 256), (2, 512)]], 2 * mb, bandwidth)
    sms = _tilelang.sm_count()
    sweep("rms_norm bwd", [
        (f"programs={mult}xSM rows,threads={t}", rms_norm.backward_kernel(HIDDEN, 1e-5, BF16, mult * sms, t),
         (dy, x, w, torch.empty_like(x), torch.empty(mult * sms * t[0], HIDDEN, device=dev, dtype=torch.float32)))
        for mult in (2, 4, 8) for t in [(1, 256), (1, 512)]], 3 * mb, bandwidth)

    g = torch.randn(TOKENS, INTER, device=dev, dtype=dt)
    u = torch.randn_like(g)
    ib = g.numel() * 2
    blocks = [((8, 512), 256), ((4, 1024), 256), ((16, 256), 256), ((2, 2048), 256), ((8, 1024), 512),
              ((4, 512), 128), ((1, 2048), 128), ((32, 128), 256)]
    fwd_args = (g, u, torch.empty_like(g))
    bwd_args = (torch.randn_like(g), g, u, torch.empty_like(g), torch.empty_like(g))
    sweep("swiglu fwd", [(f"block={b} threads={t}", swiglu.forward_kernel(swiglu.SILU, INTER, BF16, b, t), fwd_args)
                         for b, t in blocks], 3 * ib, bandwidth)
    sweep("swiglu bwd", [(f"block={b} threads={t}", swiglu.backward_kernel(swiglu.SILU, INTER, BF16, b, t), bwd_args)
                         for b, t in blocks], 5 * ib, bandwidth)

    q = torch.randn(TOKENS, 32 * 128, device=dev, dtype=dt)
    k = torch.randn(TOKENS, 8 * 128, device=dev, dtype=dt)
    c, s = torch.randn(TOKENS, 128, device=dev, dtype=dt), torch.randn(TOKENS, 128, device=dev, dtype=dt)
    rope_args = (q, k, c, s, torch.empty_like(q), torch.empty_like(k))
    rb = 2 * (q.numel() + k.numel()) * 2 + 2 * c.numel() * 2
    for bwd in (False, True):
        sweep(f"rope {'bwd' if bwd else 'fwd'}", [(f"tokens,threads={t}", rope.kernel(32, 8, 128, BF16, bwd, t), rope_args)
                                                   for t in [(1, 128), (1, 256), (2, 128), (2, 256), (4, 256), (1, 64)]],
              rb, bandwidth)


def overhead():
    """Microseconds of CPU per call at one token, where device time is negligible."""
    from liger_kernel.ops.rms_norm import LigerRMSNormFunction

    x = torch.randn(1, HIDDEN, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(HIDDEN, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    xd, wd = x.detach(), w.detach()
    rms_norm.tilelang_forward(xd, wd, 1e-5)
    raw = _tilelang.compiled(("rms_norm_fwd", HIDDEN, 1e-5, BF16), lambda: None)
    y = torch.empty_like(xd)
    calls = {
        "raw TileLang kernel call": lambda: raw(xd, wd, y),
        "tilelang_forward()": lambda: rms_norm.tilelang_forward(xd, wd, 1e-5),
        "custom op, no grad": lambda: torch.ops.tiletune.rms_norm(xd, wd, 1e-5, "tilelang", True),
        "custom op fwd+bwd": lambda: rms_norm.rms_norm(x, w, 1e-5, "tilelang", True).backward(torch.ones_like(xd)),
        "liger fwd+bwd": lambda: LigerRMSNormFunction.apply(x, w, 1e-5, 0.0, "llama", False).backward(torch.ones_like(xd)),
        "eager fwd+bwd": lambda: rms_norm.reference_forward(x, w, 1e-5).backward(torch.ones_like(xd)),
    }
    for label, fn in calls.items():
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(500):
            fn()
        torch.cuda.synchronize()
        print(f"overhead rms_norm {label:28s} {(time.perf_counter() - start) / 500 * 1e6:7.1f} us/call", flush=True)


def main():
    bandwidth = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {bandwidth / 1e9:.2f} TB/s (read + write)")
    overhead()
    variants(bandwidth)


if __name__ == "__main__":
    main()
