"""`tiletune bench`: variants in fresh processes, interleaved over repeats; table, JSON, CSV and plot.

Protocol (docs/design.md): one run, variants interleaved (A B C A B C ...), each in a fresh process on
the same random tokens and seed, warm-up steps dropped, median of the timed steps with min and max,
ratios to the baseline of the same run, peak memory from the end of the warm-up, and FLOP utilisation
against a bf16 matmul peak measured in the same run.
"""

from __future__ import annotations

import csv
import json
import os
import statistics
import subprocess
import sys
from importlib.util import find_spec
from pathlib import Path

from tqdm.auto import tqdm

from tiletune.bench.preference import LIGER_FUSED
from tiletune.bench.worker import PEER_VARIANTS, RESULT_PREFIX, split_variant
from tiletune.env import run_stamp
from tiletune.errors import UserError


# peer variant -> (the module it imports, the project, the package to install)
PEER_PACKAGES = {"liger": ("liger_kernel", "Liger-Kernel", "liger-kernel"),
                 LIGER_FUSED: ("liger_kernel", "Liger-Kernel", "liger-kernel"),
                 "bnb": ("bitsandbytes", "bitsandbytes", "bitsandbytes"), "unsloth": ("unsloth", "Unsloth", "unsloth")}


def ablation_variants() -> list[str]:
    """baseline, each kernel op alone, all of them, and Liger-Kernel when it is installed."""
    from tiletune.kernels.registry import OPS

    return ["baseline", *OPS, "all"] + (["liger"] if find_spec("liger_kernel") else [])


def check_variants(variants: list[str], stage: str = "sft") -> None:
    from tiletune.bench.preference import STAGES
    from tiletune.kernels.registry import OPS, impls

    if stage not in ("pt", "sft", *STAGES):
        raise UserError(f"bench times pt, sft, {' and '.join(STAGES)} steps; stage {stage!r} has no step to time here "
                        "(train it with `tiletune train`)")  # fmt: skip

    known = {*PEER_VARIANTS, "all", *OPS}
    names = [split_variant(v)[0] for v in variants]
    parts = [part.partition("=") for n in names if n not in known for part in n.split("+")]
    unknown = [op for op, _, _ in parts if op not in (*OPS, "all")]
    if unknown:
        raise UserError(f"bench variant {unknown[0]!r} is unknown; available: {', '.join(sorted(known))}, ops joined "
                        "by + (rms_norm+rope, all+attention: every kernel plus an opt-in op; op=impl picks an "
                        "implementation), each optionally with :key=value config overrides "
                        "(all:gradient_checkpointing=auto)")  # fmt: skip
    for op, _, impl in parts:
        if impl and impl not in impls(op):
            raise UserError(f"bench variant: {op} has no implementation {impl!r}; it has {', '.join(impls(op))}")
    for name in names:
        module, project, package = PEER_PACKAGES.get(name, (None, None, None))
        if module and not find_spec(module):
            raise UserError(f"bench variant {name!r} needs {project}; pip install {package} (or drop the variant)")
    if "llamafactory" in names and stage not in STAGES:
        raise UserError(f"bench variant 'llamafactory' computes LLaMA-Factory's preference log-probs: it needs stage "
                        f"{' or '.join(STAGES)} (this config's stage is {stage})")  # fmt: skip
    if "baseline" not in variants:
        raise UserError("bench needs the 'baseline' variant: every ratio is measured against it")
    for index, variant in enumerate(variants):
        for name in peak_references(variant):
            if name not in variants[:index]:
                raise UserError(f"bench variant {variant!r} takes the peak memory of {name!r}: list {name!r} before it "
                                f"(variants: {', '.join(variants)})")  # fmt: skip


def check_liger_fused(config: str, overrides: list[str], variants: list[str]) -> None:
    """Refuse a `liger_fused` variant whose config (with its own overrides) has a loss Liger-Kernel's fused
    preference losses do not compute (bench/preference.py's liger_fused_refusal): its row would time another loss."""
    from tiletune.bench.preference import liger_fused_refusal
    from tiletune.config import load_config

    for variant in variants:
        name, extra = split_variant(variant)
        if name != LIGER_FUSED:
            continue
        extra = [o for o in extra if not o.partition("=")[2].startswith("@")]  # peaks of other variants: set later
        why = liger_fused_refusal(load_config(config, [*overrides, *extra]))
        if why:
            raise UserError(f"bench variant {variant!r}: {why}")


def _peak_reference(value: str) -> tuple[str, float] | None:
    """(variant name, factor) of an override value `@name` or `@name*factor`, else None; UserError for a factor
    that is not a positive number."""
    if not value.startswith("@"):
        return None
    name, star, factor = value[1:].partition("*")
    try:
        scale = float(factor) if star else 1.0
    except ValueError:
        scale = 0.0
    if scale <= 0:
        raise UserError(f"bench variant override {value!r}: give @VARIANT or @VARIANT*FACTOR with a positive factor "
                        "(gradient_checkpointing_budget=@baseline*0.55)")  # fmt: skip
    return name, scale


def peak_references(variant: str) -> list[str]:
    """The variants whose measured peak this one's overrides take (`gradient_checkpointing_budget=@liger`, or a share
    of it: `@baseline*0.55`)."""
    return [reference[0] for _, value in (o.split("=", 1) for o in split_variant(variant)[1] if "=" in o)
            if (reference := _peak_reference(value))]


def resolve_peaks(variant: str, runs: dict[str, list[dict]]) -> str:
    """`variant` with each `=@name` replaced by the peak GiB variant `name` reached so far in this run (its
    peak allocated memory, so a budget of that value gives the same memory as the peer), `=@name*f` by f times it."""
    name, overrides = split_variant(variant)
    resolved = []
    for override in overrides:
        key, equals, value = override.partition("=")
        if reference := _peak_reference(value):
            peer, scale = reference
            value = f"{scale * max(r['peak_allocated_gib'] for r in runs[peer]):.3f}"
        resolved.append(key + equals + value)
    return ":".join([name, *resolved])


def _spawn(job: dict) -> dict:
    """Run one job in a fresh Python process and return its result (UserError with its output if it fails)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.run(
        [sys.executable, "-m", "tiletune.bench.worker", json.dumps(job)], capture_output=True, text=True, env=env
    )
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT_PREFIX):
            return json.loads(line[len(RESULT_PREFIX) :])
    tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
    raise UserError(f"bench variant {job['variant']!r} failed (exit {proc.returncode}):\n{tail}")


def run_bench(config: str, overrides: list[str], variants: list[str], out_dir: Path, preset: str | None,
              batch: int, seq: int, steps: int, warmup: int, repeats: int, seed: int = 0,
              profile: bool = False, layers: int | None = None, stage: str = "sft") -> dict:  # fmt: skip
    """Measure every variant `repeats` times, interleaved; write bench.json/csv/png (and profile.md) into `out_dir`."""
    check_variants(variants, stage)
    check_liger_fused(config, overrides, variants)
    if out_dir.exists() and (any(out_dir.glob("bench.*")) or (out_dir / "runs.jsonl").exists()):
        raise UserError(f"{out_dir} already holds bench results; choose another --out or move them away")
    out_dir.mkdir(parents=True, exist_ok=True)
    common = dict(config=config, overrides=overrides, preset=preset, layers=layers, batch=batch, seq=seq,
                  steps=steps, warmup=warmup, seed=seed)  # fmt: skip
    runs: dict[str, list[dict]] = {v: [] for v in variants}
    failed: dict[str, str] = {}  # variant -> why its process failed (over a memory budget, out of memory...)
    with tqdm(total=repeats * len(variants) + 1, desc="bench", dynamic_ncols=True) as bar, \
            (out_dir / "runs.jsonl").open("w") as log:  # every process's result as it lands: a cut-off run keeps them
        peak = _spawn({**common, "variant": "matmul_peak"})["matmul_peak_tflops"]
        bar.update(1)
        for repeat in range(repeats):
            for variant in (v for v in variants if v not in failed):
                bar.set_postfix(variant=variant, repeat=repeat + 1)
                missing = [name for name in peak_references(variant) if name in failed]
                if missing:
                    failed[variant] = f"it takes the peak of {missing[0]!r}, which failed"
                    continue
                try:
                    job = {**common, "variant": resolve_peaks(variant, runs), "profile": profile and repeat == 0}
                    runs[variant].append({**_spawn(job), "variant": variant, "resolved_variant": job["variant"]})
                except UserError as err:
                    if variant == "baseline":  # every ratio needs it
                        raise
                    failed[variant] = str(err)
                    tqdm.write(f"{err}\n(the other variants go on)")
                    continue
                log.write(json.dumps({"repeat": repeat, **runs[variant][-1]}) + "\n")
                log.flush()
                bar.update(1)
    result = summarise({v: r for v, r in runs.items() if v not in failed}, peak)
    result["failed"] = failed
    result["setting"] = {**common, "variants": variants, "repeats": repeats}
    result["environment"] = run_stamp()
    write_outputs(result, out_dir)
    return result


def summarise(runs: dict[str, list[dict]], matmul_peak_tflops: float) -> dict:
    """Per variant: median/min/max step time, tokens/s, peak memory, TFLOP/s, utilisation, ratios to baseline."""
    rows = []
    for variant, results in runs.items():
        times = sorted(t for r in results for t in r["step_times"])
        median = statistics.median(times)
        first = results[0]
        achieved = first["flops_per_step"] / median / 1e12
        rows.append({
            "variant": variant,
            "step_time_s": median,
            "step_time_min_s": times[0],
            "step_time_max_s": times[-1],
            "timed_steps": len(times),
            "tokens_per_s": first["tokens_per_step"] / median,
            "peak_allocated_gib": max(r["peak_allocated_gib"] for r in results),
            "peak_reserved_gib": max(r["peak_reserved_gib"] for r in results),
            "tflops_per_step": first["flops_per_step"] / 1e12,
            "achieved_tflops": achieved,
            "utilisation": achieved / matmul_peak_tflops if matmul_peak_tflops else None,
            "final_loss": statistics.mean(r["losses"][-1] for r in results),
            "patched": first.get("patched"),
            "recompute": first.get("recompute"),
            "profile": first.get("profile"),
        })  # fmt: skip
    baseline = next(r for r in rows if r["variant"] == "baseline")
    for row in rows:
        row["speedup"] = baseline["step_time_s"] / row["step_time_s"]
        row["time_ratio"] = row["step_time_s"] / baseline["step_time_s"]
        row["memory_ratio"] = row["peak_allocated_gib"] / baseline["peak_allocated_gib"]
    return {"matmul_peak_tflops": matmul_peak_tflops, "variants": rows}


COLUMNS = [
    ("variant", "variant", "{}"),
    ("step_time_s", "step s (median)", "{:.3f}"),
    ("step_time_min_s", "min", "{:.3f}"),
    ("step_time_max_s", "max", "{:.3f}"),
    ("time_ratio", "x baseline", "{:.2f}"),
    ("tokens_per_s", "tokens/s", "{:,.0f}"),
    ("peak_allocated_gib", "peak GiB", "{:.1f}"),
    ("memory_ratio", "mem x", "{:.2f}"),
    ("achieved_tflops", "TFLOP/s", "{:.0f}"),
    ("utilisation", "util", "{:.0%}"),
    ("final_loss", "loss", "{:.4f}"),
]


def table(result: dict) -> str:
    """The result as a markdown table (what the terminal and the docs show)."""
    head = "| " + " | ".join(title for _, title, _ in COLUMNS) + " |"
    rule = "|" + "|".join(" --- " for _ in COLUMNS) + "|"
    lines = [head, rule]
    for row in result["variants"]:
        cells = [fmt.format(row[key]) if row[key] is not None else "-" for key, _, fmt in COLUMNS]
        lines.append("| " + " | ".join(cells) + " |")
    for variant, why in result.get("failed", {}).items():
        lines.append(f"\n{variant} failed: {why.splitlines()[-1] if why else '?'}")
    env = result["environment"]
    lines.append(
        f"\n{env['device']}, torch {env['torch']}, {env['date']}, commit {env['commit']}; "
        f"matmul peak {result['matmul_peak_tflops']:.0f} TFLOP/s"
    )
    return "\n".join(lines)


def write_outputs(result: dict, out_dir: Path) -> None:
    """bench.json (everything), bench.csv (one row per variant), bench.md (the table), bench.png."""
    (out_dir / "bench.json").write_text(json.dumps(result, indent=2) + "\n")
    with (out_dir / "bench.csv").open("w", newline="") as handle:
        fields = [key for key, _, _ in COLUMNS] + ["tflops_per_step", "peak_reserved_gib", "speedup"]
        writer = csv.DictWriter(handle, fieldnames=fields, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(result["variants"])
    (out_dir / "bench.md").write_text(table(result) + "\n")
    plot(result, out_dir / "bench.png")
    profiles = {row["variant"]: row["profile"] for row in result["variants"] if row.get("profile")}
    if profiles:
        from tiletune.bench.profile import profile_table

        (out_dir / "profile.md").write_text(profile_table(profiles) + "\n")


def short_label(variant: str) -> str:
    """A variant's name for a plot axis: its config overrides abbreviated (`gradient_checkpointing=auto` -> `gc auto`)."""
    name, *overrides = variant.split(":")
    words = [o.replace("gradient_checkpointing_budget=", "budget ").replace("gradient_checkpointing=", "gc ")
             for o in overrides]
    return " : ".join([name, *words])


def plot(result: dict, path: Path) -> None:
    """Horizontal bars of median step time (min-max whiskers) and peak memory per variant, each
    labelled with its ratio to the baseline (the first variant) and a line at the baseline's value."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["variants"]
    labels = [short_label(r["variant"]) for r in rows]
    medians = [r["step_time_s"] for r in rows]
    spread = [[m - r["step_time_min_s"] for m, r in zip(medians, rows)], [r["step_time_max_s"] - m for m, r in zip(medians, rows)]]
    memory = [r["peak_allocated_gib"] for r in rows]
    fig, (time_ax, mem_ax) = plt.subplots(1, 2, figsize=(13, 1.2 + 0.38 * len(rows)), dpi=110, sharey=True)
    time_ax.barh(labels, medians, xerr=spread, capsize=3, color="#4c72b0")
    mem_ax.barh(labels, memory, color="#dd8452")
    slowest = [r["step_time_max_s"] for r in rows]
    for ax, values, ends, unit in ((time_ax, medians, slowest, "step time (s), median, min-max"),
                                   (mem_ax, memory, memory, "peak memory allocated (GiB)")):
        ax.axvline(values[0], color="grey", linestyle="--", linewidth=1)
        for y, (value, end) in enumerate(zip(values, ends)):
            ax.text(end, y, f" {value / values[0]:.2f}x" if values[0] else "", va="center", fontsize=8)
        ax.set_xlabel(unit)
        ax.set_xlim(0, max(values) * 1.15 or 1)
        ax.grid(axis="x", alpha=0.3)
    time_ax.invert_yaxis()  # first variant on top
    env = result["environment"]
    fig.suptitle(f"tiletune bench on {env['device']}, commit {env.get('commit', '?')} (ratios: x the first variant)")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
