"""The `tiletune` command line: one thin function per verb, each calling a module below.

A `UserError` anywhere becomes one line on stderr and exit code 2; `--debug` shows the traceback.
`tiletune train` stopped early but cleanly (a signal, a full disk) exits with `safety.EXIT_STOPPED` or
`safety.EXIT_DISK_FULL` and prints the command that resumes it.
"""

from __future__ import annotations

import logging
import shlex
import sys

import click

from tiletune.errors import UserError
from tiletune.train.presets import PRESETS

# peft imports bitsandbytes whenever it is installed; on a CPU (or offline) machine bitsandbytes then looks for
# an optional hub kernel (through `kernels`) that tiletune never runs and logs the miss on stderr, ahead of
# tiletune's own one-line errors. Quiet unless --debug.
IMPORT_TIME_NOISE = ("bitsandbytes.backends.cpu.ops", "kernels._internals.hf_hub")


class _Group(click.Group):
    """A click group that turns a UserError into one line and exit code 2."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except UserError as err:
            if ctx.obj and ctx.obj.get("debug"):
                raise
            click.echo(f"tiletune: error: {err}", err=True)
            sys.exit(2)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--debug", is_flag=True, help="Show full tracebacks for errors.")
@click.version_option(package_name="tiletune")
@click.pass_context
def main(ctx: click.Context, debug: bool) -> None:
    """Fine-tune LLMs with LLaMA-Factory configs and verified TileLang kernels."""
    ctx.ensure_object(dict)
    ctx.obj["debug"] = debug
    if not debug:
        for name in IMPORT_TIME_NOISE:
            logging.getLogger(name).setLevel(logging.ERROR)


# ---- train (issue: tiletune train) ------------------------------------------------------------


@main.command(context_settings={"ignore_unknown_options": False})
@click.argument("config", type=click.Path(dir_okay=False))
@click.argument("overrides", nargs=-1)
@click.option("--dry-run", is_flag=True, help="Validate the config, load the model and tokenize the data; do not train.")
def train(config: str, overrides: tuple[str, ...], dry_run: bool) -> None:
    """Fine-tune from a LLaMA-Factory-style CONFIG (YAML/JSON), with key=value OVERRIDES.

    FORCE_TORCHRUN=1 (with NPROC_PER_NODE, NNODES, ...) starts it on several processes through torchrun.
    """
    from tiletune.config import load_config
    from tiletune.train.launch import torchrun_command
    from tiletune.train.safety import RunStopped
    from tiletune.train.trainer import run_train

    command = torchrun_command(["train", config, *overrides] + (["--dry-run"] if dry_run else []))
    if command is not None:
        load_config(config, overrides)  # a config mistake is reported once, not by every process
        sys.exit(_run_torchrun(command))

    try:
        run_train(load_config(config, overrides), dry_run=dry_run)
    except RunStopped as stop:
        click.echo(f"tiletune: {stop}", err=True)
        if stop.checkpoint is not None:
            kept = [o for o in overrides if not o.startswith("resume_from_checkpoint=")]
            click.echo("resume with: " + shlex.join(["tiletune", "train", config, *kept, "resume_from_checkpoint=true"]),
                       err=True)  # fmt: skip
        sys.exit(stop.exit_code)


def _run_torchrun(command: list[str]) -> int:
    """Run torchrun and return its exit code; the workers stop cleanly on Ctrl-C (which reaches them directly)
    and on a SIGTERM sent here (passed on), so this process waits for them rather than dying first."""
    import signal
    import subprocess

    child = subprocess.Popen(command)
    previous = {signal.SIGINT: signal.signal(signal.SIGINT, signal.SIG_IGN),
                signal.SIGTERM: signal.signal(signal.SIGTERM, lambda signum, frame: child.send_signal(signum))}  # fmt: skip
    try:
        return child.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


# ---- hipify / env -------------------------------------------------------------------------------


@main.command()
@click.argument("paths", nargs=-1, type=click.Path())
@click.option("--explain", "explain_rule", metavar="RULE", help="Show one lint rule: the pitfall, what AMD hardware does "
              "differently, a CUDA before and HIP after, the fix; translates nothing.")
@click.option("--out", "out", type=click.Path(file_okay=False), help="Directory for the HIP sources (mirrors the input tree; .cu becomes .hip).")
@click.option("--inplace", is_flag=True, help="Rewrite the inputs, keeping each original as <name>.prehip.")
@click.option("--lint-only", is_flag=True, help="Only run the migration lint on the CUDA sources; translate nothing.")
@click.option("--engine", type=click.Choice(["auto", "torch", "perl", "clang"]), default="auto", show_default=True,
              help="Translator: hipify-clang, hipify-perl, or torch.utils.hipify's table; auto takes the first available.")
@click.option("--format", "fmt", type=click.Choice(["text", "json", "sarif"]), default="text", show_default=True,
              help="Format of the report printed on stdout.")
@click.option("--report-dir", type=click.Path(file_okay=False),
              help="Also write hipify-report.{txt,json,sarif} here (default: the --out directory).")
@click.option("--strict", is_flag=True, help="Exit 1 on findings of severity error, compile errors, or a compile check that cannot run.")
@click.option("--compile-check", is_flag=True, help="Compile the translation with hipcc and map errors back to CUDA lines.")
@click.option("--offload-arch", default="gfx90a", show_default=True, help="AMD target for --compile-check (gfx90a, gfx942, gfx1100...).")
@click.option("--hipcc-flag", "hipcc_flags", multiple=True, help="Extra hipcc flag for --compile-check (repeatable), e.g. -I/path/to/include.")
@click.option("-D", "--define", "defines", multiple=True, metavar="NAME",
              help="A macro the project's HIP build defines (repeatable): `#ifdef NAME` code is linted as compiled.")
@click.option("-U", "--undef", "undefines", multiple=True, metavar="NAME",
              help="A macro the project's HIP build leaves undefined (repeatable), e.g. a feature flag it keeps off: "
                   "code under `#ifdef NAME` is not linted.")
@click.option("--project", type=click.Path(file_okay=False),
              help="The root of the project the sources belong to: where it keeps a HIP back end beside the CUDA one "
                   "(`hip_util.hpp` beside `cuda_util.cuh`, `hipCheck` beside `cudaCheck`), the translation calls those "
                   "HIP twins of its CUDA-named API and headers.")
@click.option("--std", "cxx_std", type=click.Choice(["c++11", "c++14", "c++17", "c++20", "c++23"]), default="c++17",
              show_default=True, help="The C++ standard the project's HIP build compiles (its -std; hipcc's own default "
                                      "is gnu++17): `register`, an error from C++17, only warns before it.")
@click.pass_context
def hipify(ctx: click.Context, paths: tuple[str, ...], explain_rule: str | None, out: str | None, inplace: bool,
           lint_only: bool, engine: str, fmt: str, report_dir: str | None, strict: bool, compile_check: bool,
           offload_arch: str, hipcc_flags: tuple[str, ...], defines: tuple[str, ...], undefines: tuple[str, ...],
           cxx_std: str, project: str | None) -> None:
    """Translate CUDA sources under PATHS to HIP and report what needs a human on AMD GPUs."""
    from pathlib import Path

    from tiletune.port.hipify import run_hipify
    from tiletune.port.preprocessor import Build, cxx_standard
    from tiletune.port.report import RENDERERS, explain, write_reports

    if explain_rule:
        click.echo(explain(explain_rule), nl=False)
        return
    if not paths:
        raise UserError("hipify needs PATHS (CUDA files or folders) to translate, or --explain RULE")
    if both := sorted(set(defines) & set(undefines)):
        raise UserError(f"hipify: {', '.join(both)} given to both --define and --undef; keep one")

    report = run_hipify(list(paths), out, engine=engine, inplace=inplace, lint_only=lint_only,
                        compile_check=compile_check, offload_arch=offload_arch, hipcc_flags=hipcc_flags,
                        build=Build(frozenset(defines), frozenset(undefines), cxx_standard(cxx_std)), project=project)
    click.echo(RENDERERS[fmt](report), nl=False)
    if report_dir or out:
        written = write_reports(report, Path(report_dir or out))
        click.echo(f"reports: {', '.join(map(str, written))}", err=True)
    if strict and report.strict_failures():
        ctx.exit(1)


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.option("--strict", is_flag=True, help="Exit 1 when any check fails.")
@click.option("--library", type=click.Path(file_okay=False),
              help="Also check a kernel library (`tiletune kernels build`) against this machine (default: $TILETUNE_KERNEL_LIBRARY).")
@click.pass_context
def env(ctx: click.Context, as_json: bool, strict: bool, library: str | None) -> None:
    """Check this machine: GPU, torch build, library versions and toolchains against the compatibility matrix."""
    from tiletune.env import collect_environment, render_json, render_text

    report = collect_environment(library)
    click.echo(render_json(report) if as_json else render_text(report), nl=False)
    if strict and report.failed:
        ctx.exit(1)


# ---- bench --------------------------------------------------------------------------------------


@main.command()
@click.argument("config", type=click.Path(dir_okay=False))
@click.argument("overrides", nargs=-1)
@click.option("--variants", default="baseline,all", show_default=True,
              help="Comma-separated: baseline, all, an op name (rms_norm, swiglu, ...), liger, bnb, llamafactory "
                   "(stage dpo/kto: LLaMA-Factory's full-logits log-probs), liger_fused (stage dpo/kto: "
                   "Liger-Kernel's fused linear preference losses); each may add "
                   "config overrides as NAME:key=value[:key=value], e.g. all:gradient_checkpointing=auto.")
@click.option("--ablation", is_flag=True, help="baseline, each op alone, all, and liger when installed; "
              "--variants adds more to the same run.")
@click.option("--model-preset", help=f"Random-init model of a known shape: {', '.join(PRESETS)}.")
@click.option("--layers", type=int, help="With --model-preset: keep only this many decoder layers.")
@click.option("--batch", type=int, help="Sequences per step (default: the config's per_device_train_batch_size).")
@click.option("--seq", type=int, help="Tokens per sequence (default: the config's cutoff_len).")
@click.option("--steps", default=10, show_default=True, help="Timed steps per run.")
@click.option("--warmup", default=3, show_default=True, help="Untimed steps first.")
@click.option("--repeats", default=2, show_default=True, help="Fresh-process runs per variant, interleaved.")
@click.option("--profile", is_flag=True, help="Profile two extra steps per variant (GPU): profile.md, device time by kernel category and what is live at the peak, by allocating line.")
@click.option("--out", "out_dir", default="bench", show_default=True, type=click.Path(file_okay=False))
def bench(config, overrides, variants, ablation, model_preset, layers, batch, seq, steps, warmup, repeats, profile,
          out_dir) -> None:
    """Step time, tokens/s, memory and FLOP utilisation of kernel variants of the CONFIG's training step."""
    from pathlib import Path

    from tiletune.bench.runner import ablation_variants, run_bench, table
    from tiletune.config import load_config

    cfg = load_config(config, overrides)
    given = [v.strip() for v in variants.split(",") if v.strip()]
    chosen = list(dict.fromkeys(ablation_variants() + given)) if ablation else given
    result = run_bench(
        str(Path(config).resolve()), list(overrides), chosen, Path(out_dir), model_preset,
        batch or cfg.train_arg("per_device_train_batch_size"), seq or cfg.cutoff_len, steps, warmup, repeats,
        profile=profile, layers=layers, stage=cfg.stage,
    )  # fmt: skip
    click.echo(table(result))


# ---- kernels ------------------------------------------------------------------------------------


@main.group(invoke_without_command=True)
@click.pass_context
def kernels(ctx: click.Context) -> None:
    """List kernel ops and implementations, lower them for a target, or precompile for a config."""
    if ctx.invoked_subcommand is None:
        ctx.invoke(kernels_list)


@kernels.command("list")
def kernels_list() -> None:
    """Every op with its implementations, whether each can run here and why not, target and cache."""
    from tiletune.kernels import _tilelang, registry

    version = _tilelang.version()
    click.echo(f"TileLang: {version or 'not installed (pip install tilelang)'}")
    click.echo(f"target here: {_tilelang.device_target() or 'none (no CUDA or ROCm GPU visible)'}")
    click.echo(f"kernel cache: {_tilelang.tilelang_cache_dir()}")
    click.echo(f"\n{'op':20s} {'binds to':12s} {'impl':10s} {'runs here':9s} notes")
    for op, definition in registry.ops().items():
        roles = ",".join(b.role for b in definition.bindings) + (" (opt-in)" if definition.opt_in else "")
        for name, impl in registry.impls(op).items():
            reason = impl.unavailable()
            click.echo(f"{op:20s} {roles:12s} {name:10s} {'no' if reason else 'yes':9s} {reason or impl.description}")


@kernels.command("lower")
@click.option("--target", "targets", multiple=True, metavar="TARGET",
              help="cuda:sm_80, cuda:sm_90, hip:gfx90a, hip:gfx942, hip:gfx1100 (repeatable; default: all).")
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False), help="Directory to write into.")
@click.option("--kernel", "kernels", multiple=True, metavar="NAME",
              help="Only this kernel (repeatable; default: all; the names of the files it writes: rms_norm_fwd, attention_bwd, ...).")
def kernels_lower(targets: tuple[str, ...], out_dir: str, kernels: tuple[str, ...]) -> None:
    """Write every kernel's device source for each TARGET to OUT/<target>/, without a GPU."""
    from tiletune.kernels.lowering import lower_all

    failures = lower_all(targets or None, out_dir, echo=click.echo, kernels=kernels)
    if failures:
        for line in failures:
            click.echo(f"FAILED {line}", err=True)
        sys.exit(1)


def _meta_model(cfg, preset: str | None):
    """CONFIG's model (or a preset's shape) on the meta device, with the config's LoRA wrappers: its structure only."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from tiletune.train.model import prepare_for_training
    from tiletune.train.presets import preset_config

    if preset:
        model_config = preset_config(preset)
    else:
        model_config = AutoConfig.from_pretrained(cfg.model_name_or_path, trust_remote_code=cfg.trust_remote_code)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(model_config, trust_remote_code=cfg.trust_remote_code)
    if cfg.finetuning_type == "lora" and not cfg.adapter_name_or_path:
        model = prepare_for_training(cfg, model)  # the LoRA wrappers lora_linear patches, at the config's rank
    return model


@kernels.command("warmup")
@click.argument("config", type=click.Path(dir_okay=False))
@click.argument("overrides", nargs=-1)
def kernels_warmup(config: str, overrides: tuple[str, ...]) -> None:
    """Compile ahead of time every kernel CONFIG's `kernels:` block needs (on this machine's GPU)."""
    from tiletune.config import load_config
    from tiletune.patch.warmup import warmup_kernels
    from tiletune.train.model import compute_dtype

    cfg = load_config(config, overrides)
    done = warmup_kernels(_meta_model(cfg, None), cfg.kernels, compute_dtype(cfg))
    for line in done:
        click.echo(f"compiled {line}")
    if not done:
        click.echo("nothing to compile: the config selects no TileLang kernel")


@kernels.command("build")
@click.argument("config", type=click.Path(dir_okay=False))
@click.argument("overrides", nargs=-1)
@click.option("--target", "targets", multiple=True, metavar="TARGET",
              help="cuda:sm_90, hip:gfx942, ... (repeatable; default: this machine's GPU).")
@click.option("--model-preset", "model_presets", multiple=True,
              help=f"Build for a known model shape instead of CONFIG's model (repeatable: one library for all): {', '.join(PRESETS)}.")
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False), help="Library folder (one per target inside).")
def kernels_build(config: str, overrides: tuple[str, ...], targets: tuple[str, ...], model_presets: tuple[str, ...], out_dir: str) -> None:
    """Compile every kernel CONFIG's model needs into one library per TARGET (`kernels: {library: OUT/<target>}`).

    The kernels are found by running each op once on this machine's GPU; each target's library is compiled
    with its own compiler (nvcc; hipcc from ROCm >= 6), or written as a source package with build.sh.
    """
    from pathlib import Path

    from tqdm import tqdm

    from tiletune.config import load_config
    from tiletune.kernels import _tilelang, library
    from tiletune.patch.warmup import record_kernels
    from tiletune.train.model import compute_dtype

    if not _tilelang.installed():
        raise UserError("kernels build needs TileLang to compile the kernels: pip install tilelang")
    here = _tilelang.device_target()
    if here is None:
        raise UserError("kernels build runs each op once on this machine's GPU to learn which kernels the model needs; "
                        "no CUDA or ROCm GPU is visible")  # fmt: skip
    for target in targets:
        try:
            _tilelang.parse_target(target)
        except ValueError as err:
            raise UserError(f"--target: {err}") from None
    cfg = load_config(config, overrides)
    recorded = {}
    for preset in model_presets or (None,):
        recorded |= record_kernels(_meta_model(cfg, preset), cfg.kernels, compute_dtype(cfg))
    if not recorded:
        raise UserError(f"kernels build: {config}'s `kernels:` selects no TileLang kernel for this model; nothing to build")
    for target in targets or (here,):
        with tqdm(total=2 * len(recorded), desc=f"kernels build {target}", unit="kernel") as bar:
            manifest = library.build(recorded.items(), target, out_dir, progress=lambda _: bar.update())
        where = Path(out_dir) / target.replace(":", "-")
        if manifest.library:
            click.echo(f"{target}: {len(manifest.kernels)} kernels in {where / manifest.library}; "
                       f"train with `kernels: {{all: true, library: {where}}}`")  # fmt: skip
        else:
            click.echo(f"{target}: source package in {where} ({manifest.why_not_compiled}); run its build.sh where that compiler is")


# ---- verify -------------------------------------------------------------------------------------


def _floor_ulps() -> float:
    """numerics.FLOOR_ULPS, read when verify runs: loading the command line does not import torch."""
    from tiletune.numerics import FLOOR_ULPS

    return FLOOR_ULPS


@main.command()
@click.argument("config", type=click.Path(dir_okay=False))
@click.argument("overrides", nargs=-1)
@click.option("--out", "out_dir", type=click.Path(file_okay=False), help="Report folder (default: <output_dir>/verify).")
@click.option("--batches", default=2, show_default=True, help="Batches of the config's batch size to compare on.")
@click.option("--seq", type=int, help="Tokens per sequence (default: min(cutoff_len, 512)).")
@click.option("--random-tokens", is_flag=True, help="Random token ids instead of the config's dataset.")
@click.option("--k", default=2.0, show_default=True, help="Pass when kernel error <= k x stock error.")
@click.option("--floor-ulps", type=float, default=_floor_ulps, show_default="2",
              help="Also pass when every element is within this many ulps (in the run's dtype) of the reference.")
@click.option("--save-golden", type=click.Path(dir_okay=False), help="Write inputs + stock tensors to this safetensors file.")
@click.option("--against", type=click.Path(dir_okay=False), help="Compare this machine's run with a golden file.")
@click.option("--tolerance", type=float, help="Relative error allowed against a golden file / between loss curves.")
@click.option("--steps", default=0, show_default=True, help="Also train stock and patched N steps and compare losses.")
@click.option("--seed", default=0, show_default=True)
@click.option("--model-preset", help=f"Random-init model of a known shape: {', '.join(PRESETS)}.")
@click.option("--layers", type=int, help="With --model-preset: keep only this many decoder layers.")
def verify(config, overrides, out_dir, batches, seq, random_tokens, k, floor_ulps, save_golden, against, tolerance, steps,
           seed, model_preset, layers):  # fmt: skip
    """Per-layer forward/gradient error of the kernel-patched model vs the stock one.

    Exit 0: PASS; 1: FAIL; 2: a mistake in the input; 3: NOT VERIFIED, a selected kernel cannot run on this
    machine (no GPU, no TileLang target): it would run its PyTorch reference, the stock computation, so nothing of
    it is checked (the kernels that can run are still compared; with none, no run is made).
    """
    import sys
    from pathlib import Path

    from tiletune.config import load_config
    from tiletune.verify.report import golden_table, verdict_table
    from tiletune.verify.run import VerifyOptions, run_verify

    cfg = load_config(config, overrides)
    options = VerifyOptions(
        out_dir=Path(out_dir) if out_dir else cfg.output_dir / "verify", batches=batches, seq=seq,
        random_tokens=random_tokens, k=k, floor_ulps=floor_ulps, save_golden=Path(save_golden) if save_golden else None,
        against=Path(against) if against else None, tolerance=tolerance, steps=steps, seed=seed,
        preset=model_preset, layers=layers,
    )  # fmt: skip
    result = run_verify(cfg, options)
    if "tensors" in result:
        click.echo(verdict_table(result["tensors"]))
    if "golden" in result:
        click.echo(golden_table(result["golden"]["tensors"]))
    if "convergence" in result:
        conv = result["convergence"]
        click.echo(f"convergence over {conv['steps']} steps: largest relative loss gap {conv['max_relative_gap']:.2e} "
                   f"(tolerance {conv['tolerance']:.0e}) {'pass' if conv['passed'] else 'FAIL'}")  # fmt: skip
    quantized = [row for row in result.get("quantization", []) if row["rel_l2"] is not None]
    if quantized:
        worst = max(quantized, key=lambda row: row["rel_l2"])
        errs = sorted(row["rel_l2"] for row in quantized)
        click.echo(f"quantization error of the {len(errs)} quantized layers against their original weights (not gated): "
                   f"median {errs[len(errs) // 2]:.3g}, worst {worst['rel_l2']:.3g} ({worst['layer']}, {worst['kind']})")
    for note in result.get("accumulation", []):
        click.echo(f"accumulation: {note}")
    for warning in result.get("warnings", []):
        click.echo(f"warning: {warning}")
    if "not_verified" in result:
        click.echo(f"not verified: {result['not_verified']}")
    click.echo(f"verify: {result['outcome'].upper()} (report in {options.out_dir})")
    sys.exit({"pass": 0, "fail": 1, "not verified": 3}[result["outcome"]])


# ---- export / chat ------------------------------------------------------------------------------


@main.command()
@click.argument("config", type=click.Path(dir_okay=False))
@click.argument("overrides", nargs=-1)
def export(config: str, overrides: tuple[str, ...]) -> None:
    """Merge the CONFIG's LoRA adapters into the base model and write it to `export_dir`."""
    from tiletune.config import load_config
    from tiletune.train.export import run_export

    click.echo(f"exported to {run_export(load_config(config, overrides))}")


@main.command()
@click.argument("config", type=click.Path(dir_okay=False))
@click.argument("overrides", nargs=-1)
@click.option("--kernels", "kernel_spec", help="Kernels to patch in, as in the `kernels:` key (e.g. all, rms_norm).")
def chat(config: str, overrides: tuple[str, ...], kernel_spec: str | None) -> None:
    """Chat in the terminal with the CONFIG's model (and adapters) in its chat template."""
    from tiletune.config import load_config
    from tiletune.train.chat import load_session, run_chat

    cfg = load_config(config, overrides + ((f"kernels={kernel_spec}",) if kernel_spec else ()))
    session, kernel_summary = load_session(cfg)
    if kernel_summary:
        click.echo(kernel_summary, err=True)
    run_chat(session, sys.stdin, lambda text: click.echo(text, nl=False))


# ---- llamafactory -------------------------------------------------------------------------------


@main.group("llamafactory")
def llamafactory_group() -> None:
    """Run LLaMA-Factory itself (when installed) with tiletune's kernels."""


@llamafactory_group.command("train")
@click.argument("config", type=click.Path(dir_okay=False))
@click.argument("overrides", nargs=-1)
def llamafactory_train(config: str, overrides: tuple[str, ...]) -> None:
    """LLaMA-Factory's training for CONFIG, with the `kernels:` block patched into the model it loads."""
    from tiletune.train.llamafactory import run_llamafactory_train

    run_llamafactory_train(config, overrides)
