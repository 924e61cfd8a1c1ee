"""Where a training step's device time goes: one profiled step, its kernels grouped by what they do.

`tiletune bench --profile` runs this in every variant's process after the timed steps (so it never
touches the timings) and writes profile.md: milliseconds per category and variant, and each variant's
heaviest kernels.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable

# First match wins; names are the device kernels' (cuBLAS, cuDNN, FlashAttention, Triton, TileLang, ATen).
# tiletune's ops whose kernels have a name pattern (tiletune.kernels.registry.Op.profile_pattern) come
# right after attention, as "tiletune <op>".
ATTENTION = ("attention", r"flash|fmha|attention|sdpa|cudnn")
BY_FUNCTION = [
    ("rms_norm", r"rms|layer_norm|norm_kernel"),
    ("rope", r"rope|rotary"),
    ("swiglu", r"swiglu|silu|geglu"),
    ("cross-entropy", r"cross_entropy|log_softmax|softmax|nll_loss|logsumexp"),
    ("optimizer", r"adam|multi_tensor|foreach"),
    ("matmul (cuBLAS)", r"gemm|gemv|nvjet|xmma|cutlass|wgmma|sm\d+_.*(tn|nt|nn)|splitk"),
    ("copy / cast", r"copy|cast|convert|to_copy|cat_|fill"),
    ("reduction", r"reduce|sum_|mean|norm"),
    ("elementwise", r"elementwise|vectorized|unrolled|pointwise|triton"),
]


@functools.cache
def _categories() -> list[tuple[str, re.Pattern]]:
    from tiletune.kernels import registry

    ops = [(f"tiletune {name}", op.profile_pattern) for name, op in registry.ops().items() if op.profile_pattern]
    return [(name, re.compile(pattern, re.IGNORECASE)) for name, pattern in [ATTENTION, *ops, *BY_FUNCTION]]


def category(kernel: str) -> str:
    """The category of a device kernel's name ('other' if none matches)."""
    return next((name for name, pattern in _categories() if pattern.search(kernel)), "other")


def profile_step(step: Callable[[], None], top: int = 12) -> dict:
    """Run `step` once under the profiler; device milliseconds per category and the `top` heaviest kernels."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    kernels: dict[str, list[float]] = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA and event.device_time_total > 0:
            kernels.setdefault(event.name, []).append(event.device_time_total / 1000)
    return summarise_kernels({name: (sum(times), len(times)) for name, times in kernels.items()}, top)


def summarise_kernels(kernels: dict[str, tuple[float, int]], top: int = 12) -> dict:
    """{name: (total ms, calls)} -> totals per category (largest first) and the heaviest kernels."""
    categories: dict[str, float] = {}
    for name, (ms, _) in kernels.items():
        categories[category(name)] = categories.get(category(name), 0.0) + ms
    heaviest = sorted(kernels.items(), key=lambda item: -item[1][0])[:top]
    return {
        "device_ms": sum(ms for ms, _ in kernels.values()),
        "categories": dict(sorted(categories.items(), key=lambda item: -item[1])),
        "kernels": [{"name": name, "ms": ms, "calls": calls, "category": category(name)} for name, (ms, calls) in heaviest],
    }


def profile_table(profiles: dict[str, dict]) -> str:
    """Markdown: device ms per category (rows) and variant (columns), then each variant's heaviest kernels."""
    variants = list(profiles)
    names = sorted({c for p in profiles.values() for c in p["categories"]},
                   key=lambda c: -max(p["categories"].get(c, 0.0) for p in profiles.values()))  # fmt: skip
    lines = ["| device ms per step | " + " | ".join(variants) + " |", "|---" * (len(variants) + 1) + "|"]
    for name in names:
        lines.append(f"| {name} | " + " | ".join(f"{profiles[v]['categories'].get(name, 0.0):.1f}" for v in variants) + " |")
    lines.append("| **total** | " + " | ".join(f"**{profiles[v]['device_ms']:.1f}**" for v in variants) + " |")
    for variant in variants:
        lines += ["", f"### {variant}: heaviest kernels", "", "| ms | calls | category | kernel |", "|---|---|---|---|"]
        lines += [f"| {k['ms']:.1f} | {k['calls']} | {k['category']} | `{k['name'][:90]}` |" for k in profiles[variant]["kernels"]]
    return "\n".join(lines)
