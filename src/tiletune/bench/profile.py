"""Where a training step's device time goes: one profiled step, its kernels grouped by what they do.

`tiletune bench --profile` runs this in every variant's process after the timed steps (so it never
touches the timings) and writes profile.md: milliseconds per category and variant, each variant's
heaviest kernels, and what the host did: how long the GPU sat idle between the step's first and last kernel
(waiting on the host to launch work), how many kernels it launched, how often it waited for the GPU, and the host
events (ops, autograd nodes, runtime calls) with the most CPU time of their own, on every thread. A second
extra step records the CUDA allocator's history: what was live at the step's peak, by the line of Python that
allocated it (`memory_peak`).
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


# CUDA runtime / driver calls, as the profiler's CPU events name them: a kernel launch, and a wait of the host for the
# device (a synchronise, or a copy to pageable host memory that returns only once done: `.item()`, `.tolist()`)
_LAUNCH = re.compile(r"^(?:cudaLaunchKernel|cudaLaunchKernelExC|cuLaunchKernel|cuLaunchKernelEx|cudaLaunchCooperativeKernel"
                     r"|hipLaunchKernel|hipExtModuleLaunchKernel|hipModuleLaunchKernel)$")
_HOST_WAIT = re.compile(r"^(?:cuda|hip)(?:StreamSynchronize|DeviceSynchronize|EventSynchronize|Memcpy)$")


def profile_step(step: Callable[[], None], top: int = 12) -> dict:
    """Run `step` once under the profiler; device milliseconds per category, the `top` heaviest kernels, the
    host's side (`host_side`) and the `top` host events by their own CPU time (`host_events`)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    kernels: dict[str, list[float]] = {}
    intervals, launches, waits = [], 0, 0
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA and event.device_time_total > 0:
            kernels.setdefault(event.name, []).append(event.device_time_total / 1000)
            intervals.append((event.time_range.start / 1000, event.time_range.end / 1000))
        else:
            launches += bool(_LAUNCH.match(event.name))
            waits += bool(_HOST_WAIT.match(event.name))
    summary = summarise_kernels({name: (sum(times), len(times)) for name, times in kernels.items()}, top)
    own_cpu = [(e.key, e.self_cpu_time_total / 1000, e.count) for e in prof.key_averages()]
    return {**summary, **host_side(intervals, launches, waits), "host_events": host_events(own_cpu, top)}


def host_events(own_cpu: list[tuple[str, float, int]], top: int = 12) -> list[dict]:
    """(name, own CPU ms, calls) of the profiler's host events -> the `top` by own CPU ms (the host's time in the
    event less its child events'; under the profiler each event also carries the profiler's own cost)."""
    heaviest = sorted(own_cpu, key=lambda event: -event[1])[:top]
    return [{"name": name, "ms": ms, "calls": calls} for name, ms, calls in heaviest]


def host_side(intervals: list[tuple[float, float]], launches: int, waits: int) -> dict:
    """From the device's busy intervals (ms; kernels and copies, on any stream): the span from the first start to
    the last end, the time in it no kernel ran (`idle_ms`: the GPU waiting on the host), and the host's kernel
    launches and waits for the device."""
    busy, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        busy += max(0.0, stop - max(start, end))
        end = max(end, stop)
    span = end - min(start for start, _ in intervals) if intervals else 0.0
    return {"span_ms": span, "idle_ms": span - busy, "launches": launches, "host_waits": waits}


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


def memory_peak(step: Callable[[], None], top: int = 12) -> dict:
    """Run `step` once recording the CUDA allocator's history: the step's peak of allocated bytes and what was live
    then, by allocating site (`summarise_peak`)."""
    import torch

    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.memory._record_memory_history(enabled="all", context="alloc", stacks="python")
    try:
        step()
        torch.cuda.synchronize()
        snapshot = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    return summarise_peak(snapshot["device_traces"][torch.cuda.current_device()], before, top)


BEFORE_STEP = "before the step (weights, optimizer state, kept buffers)"
BACKWARD_ENGINE = "autograd's C++ backward (no Python frame)"


def _site(frames: list[dict]) -> str:
    """The innermost frame outside torch's own files, as `package/file.py:line function` (the allocating line)."""
    for frame in frames:
        name = frame["filename"].replace("\\", "/")
        if "/torch/" in name or not name.endswith(".py"):
            continue
        tail = name.rsplit("site-packages/", 1)[-1].rsplit("/src/", 1)[-1]
        return f"{tail}:{frame['line']} {frame['name']}"
    return BACKWARD_ENGINE if not frames else frames[0]["filename"].rsplit("/", 1)[-1] + " (torch)"


def summarise_peak(events: list[dict], before: int, top: int = 12) -> dict:
    """The allocator's trace of one step (alloc / free_completed events with addr, size and frames) after `before`
    bytes were allocated -> the peak of allocated bytes and the `top` sites holding the most then (bytes freed that
    were allocated before the trace come off `before`)."""
    live: dict[int, tuple[int, str]] = {}
    carried, total, peak, peak_index = before, before, before, -1
    for index, event in enumerate(events):
        if event["action"] == "alloc":
            total += event["size"]
        elif event["action"] == "free_completed":
            total -= event["size"]
        if total > peak:
            peak, peak_index = total, index
    for event in events[: peak_index + 1]:
        if event["action"] == "alloc":
            live[event["addr"]] = (event["size"], _site(event.get("frames", [])))
        elif event["action"] == "free_completed" and live.pop(event["addr"], None) is None:
            carried -= event["size"]
    by_site: dict[str, int] = {BEFORE_STEP: carried}
    for size, site in live.values():
        by_site[site] = by_site.get(site, 0) + size
    heaviest = sorted(by_site.items(), key=lambda item: -item[1])[:top]
    return {"peak_gib": peak / 2**30, "sites": [{"site": site, "gib": size / 2**30} for site, size in heaviest]}


def profile_table(profiles: dict[str, dict]) -> str:
    """Markdown: device ms per category (rows) and variant (columns), then each variant's heaviest kernels and what
    was live at its peak."""
    variants = list(profiles)
    names = sorted({c for p in profiles.values() for c in p["categories"]},
                   key=lambda c: -max(p["categories"].get(c, 0.0) for p in profiles.values()))  # fmt: skip
    lines = ["| device ms per step | " + " | ".join(variants) + " |", "|---" * (len(variants) + 1) + "|"]
    for name in names:
        lines.append(f"| {name} | " + " | ".join(f"{profiles[v]['categories'].get(name, 0.0):.1f}" for v in variants) + " |")
    lines.append("| **total** | " + " | ".join(f"**{profiles[v]['device_ms']:.1f}**" for v in variants) + " |")
    host_rows = (("GPU idle within the step, ms", "idle_ms", ".1f"), ("step span on the GPU, ms", "span_ms", ".1f"),
                 ("kernel launches", "launches", "d"), ("host waits for the GPU", "host_waits", "d"))
    for label, key, spec in host_rows:
        if all(key in profiles[v] for v in variants):
            lines.append(f"| {label} | " + " | ".join(format(profiles[v][key], spec) for v in variants) + " |")
    for variant in variants:
        lines += ["", f"### {variant}: heaviest kernels", "", "| ms | calls | category | kernel |", "|---|---|---|---|"]
        lines += [f"| {k['ms']:.1f} | {k['calls']} | {k['category']} | `{k['name'][:90]}` |" for k in profiles[variant]["kernels"]]
        if profiles[variant].get("host_events"):
            lines += ["", f"### {variant}: host events by their own CPU time", "", "| ms | calls | event |", "|---|---|---|"]
            lines += [f"| {e['ms']:.1f} | {e['calls']} | `{e['name'][:90]}` |" for e in profiles[variant]["host_events"]]
        if "memory" in profiles[variant]:
            memory = profiles[variant]["memory"]
            lines += ["", f"### {variant}: live at the step's peak ({memory['peak_gib']:.2f} GiB allocated)", "",
                      "| GiB | allocated by |", "|---|---|"]
            lines += [f"| {site['gib']:.2f} | `{site['site']}` |" for site in memory["sites"]]
    return "\n".join(lines)
