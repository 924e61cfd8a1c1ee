"""Where the host's time goes in one call of tiletune's ops (forward + backward at 8 tokens, where the device
work is a few microseconds): each op's host time a call (the best of 5 rounds of CALLS calls, synchronised at the
end of each round), then cProfile of CALLS calls per op (backward on the calling thread, where cProfile sees it), the
functions with the most time of their own. On a GPU
the ops run their TileLang impl; without one, the reference (the custom op's dispatch and selection are the same;
`--small` shrinks the widths 64-fold, so that the reference's arithmetic on the CPU does not hide them).

    python benchmarks/host_profile.py [--calls 300] [--top 25] [--small]
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import io
import pstats
import time

import torch


def cases(tokens: int = 8, scale: int = 1):
    """(name, fn) doing one forward + backward of each op through its TileLang impl (the reference without a GPU), at
    Llama-3-8B's widths divided by `scale`."""
    from tiletune.kernels import rms_norm, rope, swiglu

    on_gpu = torch.cuda.is_available()
    dev, dt, impl = ("cuda", torch.bfloat16, "tilelang") if on_gpu else ("cpu", torch.float32, "reference")
    hidden, heads, head_dim = 4096 // scale, max(1, 32 // scale), max(2, 128 // scale)
    x = torch.randn(tokens, hidden, device=dev, dtype=dt, requires_grad=True)
    w = torch.ones(hidden, device=dev, dtype=dt, requires_grad=True)
    q = torch.randn(1, heads, tokens, head_dim, device=dev, dtype=dt, requires_grad=True)
    k = torch.randn(1, max(1, heads // 4), tokens, head_dim, device=dev, dtype=dt, requires_grad=True)
    cos, sin = (torch.randn(1, tokens, head_dim, device=dev, dtype=dt) for _ in range(2))
    gate = torch.randn(tokens, 14336 // scale, device=dev, dtype=dt, requires_grad=True)
    up = torch.randn_like(gate, requires_grad=True)

    def run_rms():
        torch.autograd.grad(rms_norm.rms_norm(x, w, 1e-5, impl, True).sum(), [x, w])

    def run_rope():
        qo, ko = rope.rope(q, k, cos, sin, impl, True)
        torch.autograd.grad(qo.sum() + ko.sum(), [q, k])

    def run_swiglu():
        torch.autograd.grad(swiglu.swiglu(gate, up, impl, True).sum(), [gate, up])

    return [("rms_norm", run_rms), ("rope", run_rope), ("swiglu", run_swiglu)]


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def host_us(fn, calls: int) -> float:
    """The best of 5 rounds of `calls` calls of `fn`, microseconds a call (the host runs ahead of the device; each
    round ends synchronised)."""
    best = float("inf")
    for _ in range(5):
        synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        synchronize()
        best = min(best, (time.perf_counter() - start) / calls * 1e6)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--small", action="store_true", help="widths 64 times smaller than Llama-3-8B's")
    args = parser.parse_args()
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU (reference impls)"
    print(f"{device}, torch {torch.__version__}, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC"
          + (", widths / 64" if args.small else ""))
    profiles = {}
    for name, fn in cases(scale=64 if args.small else 1):
        for _ in range(20):
            fn()
        print(f"{name}: {host_us(fn, args.calls):.0f} us a call (forward + backward)")
        profiler = cProfile.Profile()
        # backward on this thread: on a GPU autograd's engine runs it on a device thread cProfile does not see
        with torch.autograd.set_multithreading_enabled(False):
            profiler.enable()
            for _ in range(args.calls):
                fn()
            profiler.disable()
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(args.top)
        table = text.getvalue()
        profiles[name] = table[table.index("   ncalls"):].rstrip()
    for name, text in profiles.items():
        print(f"\n== {name}: cProfile of {args.calls} calls\n{text}")


if __name__ == "__main__":
    main()
