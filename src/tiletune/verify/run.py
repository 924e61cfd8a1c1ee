"""`tiletune verify`: per-layer numerics of the kernel-patched model against the stock one.

Three runs over the same weights and inputs: the stock model and the patched model in the configured
dtype, and the stock model in high precision (float32 on a GPU, float64 on the CPU) as the reference
both are measured against. Golden files carry the inputs and the stock run to another machine;
`--steps` trains both models a few steps from the same start and compares the loss curves.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import re
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from tiletune.config import TuneConfig
from tiletune.errors import UserError
from tiletune.numerics import DTYPE_TOLERANCE, FLOOR_ULPS, compare_runs, errors
from tiletune.patch import apply_kernels, parse_kernel_spec
from tiletune.patch.warmup import compile_ahead
from tiletune.verify.capture import run_and_capture, watched_modules
from tiletune.verify.losses import (
    PREFERENCE_STAGES,
    StepLoss,
    preference_rows,
    reference_step_loss,
    step_loss,
)

log = logging.getLogger("tiletune.verify")
FP16_MAX = torch.finfo(torch.float16).max
NOT_VERIFIED = "not verified"


@dataclass
class VerifyOptions:
    """What `tiletune verify` was asked for, beyond the config."""

    out_dir: Path
    batches: int = 2
    seq: int | None = None
    random_tokens: bool = False
    k: float = 2.0
    floor_ulps: float = FLOOR_ULPS
    save_golden: Path | None = None
    against: Path | None = None
    tolerance: float | None = None
    steps: int = 0
    seed: int = 0
    preset: str | None = None  # a random-init model shape instead of model_name_or_path
    layers: int | None = None  # keep only this many decoder layers of the preset


# ---- set-up ------------------------------------------------------------------------------------


def prepare(cfg: TuneConfig, options: VerifyOptions):
    """The model set up as for training (LoRA weights made non-trivial), its inputs, the device and dtype."""
    from tiletune.train.model import compute_dtype, set_checkpointing

    dtype = compute_dtype(cfg)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(options.seed)
    if options.preset:
        model, tokenizer, template = _preset_model(cfg, options, dtype, device), None, None
    else:
        model, tokenizer, template = _configured_model(cfg)
    set_checkpointing(model, enabled=False)  # same numerics; keeps the hooks to one call per module
    _randomise_adapters(model, options.seed)
    model.to(device)
    batches = _inputs(cfg, options, tokenizer, template, model.config.vocab_size)
    return model, batches, device, dtype


def _configured_model(cfg: TuneConfig):
    from tiletune.data.templates import get_template
    from tiletune.train.model import load_model, load_tokenizer

    tokenizer = load_tokenizer(cfg)
    template = get_template(cfg.template, tokenizer, cfg.stage, cfg.default_system)
    template.fix_tokenizer(tokenizer)
    return load_model(cfg, tokenizer, trainable=True), tokenizer, template


def _preset_model(cfg: TuneConfig, options: VerifyOptions, dtype, device):
    from tiletune.train.model import prepare_for_training
    from tiletune.train.presets import preset_model

    return prepare_for_training(cfg, preset_model(cfg, options.preset, device, options.layers, options.seed))


def _randomise_adapters(model, seed: int) -> None:
    """LoRA B starts at zero, which would make every adapter gradient trivially equal: draw A and B afresh."""
    generator = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        if "lora_A" in name or "lora_B" in name:
            with torch.no_grad():
                param.copy_(torch.randn(param.shape, generator=generator) * 0.02)


def _inputs(cfg: TuneConfig, options: VerifyOptions, tokenizer, template, vocab: int) -> list[dict]:
    batch = cfg.train_arg("per_device_train_batch_size", 1)
    seq = options.seq or min(cfg.cutoff_len, 512)
    random_data = options.random_tokens or options.preset or not cfg.dataset
    if cfg.stage in PREFERENCE_STAGES:
        return _preference_inputs(cfg, options, tokenizer, template, vocab, batch, seq, random_data)
    generator = torch.Generator().manual_seed(options.seed)
    if random_data:
        return [
            {"input_ids": (ids := torch.randint(0, vocab, (batch, seq), generator=generator)), "labels": ids.clone()}
            for _ in range(options.batches)
        ]
    from transformers import DataCollatorForSeq2Seq

    needed = batch * options.batches
    train = _training_rows(cfg, tokenizer, template, options.batches, batch)
    collate = DataCollatorForSeq2Seq(tokenizer, label_pad_token_id=-100)
    rows = [{k: train[i][k][:seq] for k in ("input_ids", "attention_mask", "labels")} for i in range(needed)]
    return [
        {k: v for k, v in collate(rows[i : i + batch]).items() if k in ("input_ids", "labels")}
        for i in range(0, needed, batch)
    ]


def _training_rows(cfg: TuneConfig, tokenizer, template, batches: int, batch: int):
    """cfg's training data, tokenised as training does, with at least `batches` x `batch` rows."""
    from tiletune.data.processing import build_splits

    train = build_splits(cfg, tokenizer, template).train
    needed = batches * batch
    if len(train) < needed:
        raise UserError(f"verify needs {needed} examples ({batches} batches of {batch}); the data has {len(train)}")
    return train


def _preference_inputs(cfg: TuneConfig, options: VerifyOptions, tokenizer, template, vocab: int, batch: int, seq: int,
                       random_data: bool) -> list[dict]:  # fmt: skip
    """Batches of `batch` pairs (DPO) or answers (KTO), from the data or of random tokens."""
    from tiletune.data.processing import random_rows

    needed = batch * options.batches
    if random_data:
        columns = random_rows(cfg.stage, needed, seq, vocab, options.seed)
        rows = [dict(zip(columns, values, strict=True)) for values in zip(*columns.values(), strict=True)]
    else:
        train = _training_rows(cfg, tokenizer, template, options.batches, batch)
        rows = [train[i] for i in range(needed)]
    pad_id = tokenizer.pad_token_id if tokenizer is not None and tokenizer.pad_token_id is not None else 0
    return [preference_rows(cfg, rows[i : i + batch], seq, pad_id) for i in range(0, needed, batch)]


def fingerprint(model) -> str:
    """Identifies the model: its config and a sample of every weight (what a golden file must match)."""
    config = model.get_base_model().config if hasattr(model, "get_base_model") else model.config
    digest = hashlib.sha256(json.dumps(config.to_diff_dict(), sort_keys=True, default=str).encode())
    for name, param in sorted(model.named_parameters()):
        sample = param.detach().flatten()[:256].double().cpu()
        digest.update(name.encode() + f"{float(sample.sum()):.6e}".encode())
    return digest.hexdigest()[:16]


# ---- the three runs ----------------------------------------------------------------------------


def capture_three(cfg: TuneConfig, model, spec, batches, device, dtype, watch_extra: list[str]):
    """(stock, patched, reference) captures and the PatchReport; the model ends in the reference dtype."""
    watch = watched_modules(model, watch_extra)
    stock = run_and_capture(model, batches, watch, dtype, device, step_loss(cfg))
    report = apply_kernels(model, spec)
    try:
        patched = run_and_capture(model, batches, watch, dtype, device, step_loss(cfg, spec))
    finally:
        report.revert()
    reference_dtype = torch.float32 if device.type == "cuda" else torch.float64
    model.to(reference_dtype)
    with _experts_running(model, reference_dtype):
        reference = run_and_capture(model, batches, watch, reference_dtype, device, reference_step_loss(cfg))
    return stock, patched, reference, report


@contextmanager
def _experts_running(model, dtype: torch.dtype):
    """MoE experts through transformers' eager loop for a float64 run (its default grouped_mm takes no float64;
    the arithmetic is the same), restored afterwards; nothing for other models or dtypes."""
    from tiletune.patch.sites import causal_lm

    base = causal_lm(model)[0]
    current = getattr(base.config, "_experts_implementation", None)
    if dtype != torch.float64 or current in (None, "eager") or not hasattr(base, "set_experts_implementation"):
        yield
        return
    saved = base.get_experts_implementation()
    base.set_experts_implementation("eager")
    try:
        yield
    finally:
        base.set_experts_implementation(saved)


def dtype_warnings(captured: dict, dtype: torch.dtype) -> list[str]:
    """fp16 runs whose activations come near the largest float16 value."""
    if dtype != torch.float16:
        return []
    near = [name for name, t in captured.items() if t.abs().max() > FP16_MAX / 4]
    return [f"fp16: {name} reaches {float(captured[name].abs().max()):.3g}, near float16's range" for name in near]


def not_running(spec) -> dict[str, str]:
    """The selected ops whose implementation cannot run on this machine, with the reason: each would run its
    PyTorch reference instead, which computes what the stock model does, so verify checks nothing of them."""
    from tiletune.kernels.registry import REFERENCE, get

    return {s.op: f"{s.impl}: {reason}" for s in spec.ops
            if s.impl != REFERENCE and (reason := get(s.op, s.impl).unavailable())}


def not_verified(skipped: dict[str, str]) -> str:
    """What verify could not check here and why (the ops grouped by reason), and what to do instead."""
    by_reason: dict[str, list[str]] = {}
    for op, reason in skipped.items():
        by_reason.setdefault(reason, []).append(op)
    ops = "; ".join(f"{', '.join(names)} ({reason})" for reason, names in by_reason.items())
    return (f"{ops} cannot run on this machine: each would run its PyTorch reference, which computes what the stock "
            "model does. Verify where they run (`tiletune kernels` lists where), or check the references themselves "
            "with kernels=all=reference")


def accumulation_differences(spec, bound: set[str] | None = None) -> list[str]:
    """Kernels whose arithmetic runs in another dtype than the stock (reference) implementation's; with `bound`,
    only those ops (the ones the model has a site for)."""
    from tiletune.kernels.registry import REFERENCE, get

    notes = []
    for selection in spec.ops:
        if bound is not None and selection.op not in bound:
            continue
        chosen, stock = get(selection.op, selection.impl), get(selection.op, REFERENCE)
        if chosen.accumulation != stock.accumulation:
            notes.append(
                f"{selection.op}: {selection.impl} computes in {chosen.accumulation}, the stock implementation in "
                f"{stock.accumulation}"
            )
    return notes


# ---- golden files ------------------------------------------------------------------------------


def save_golden(path: Path, batches, stock: dict, meta: dict) -> None:
    """The inputs and the stock run's tensors in one safetensors file, with the metadata as JSON."""
    from safetensors.torch import save_file

    if path.exists():
        raise UserError(f"golden file {path} already exists; choose another name or move it away")
    tensors = {f"input.{i}.{k}": v.contiguous() for i, b in enumerate(batches) for k, v in b.items()}
    tensors.update({f"stock.{k}": v.contiguous() for k, v in stock.items()})
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path), metadata={"tiletune_golden": json.dumps(meta)})


def load_golden(path: Path, model_print: str):
    """(batches, stock tensors, metadata) of a golden file made from the same model."""
    from safetensors import safe_open

    if not path.is_file():
        raise UserError(f"golden file {path} not found")
    with safe_open(str(path), "pt") as handle:
        raw_meta = (handle.metadata() or {}).get("tiletune_golden")
        if raw_meta is None:
            raise UserError(f"{path} is not a tiletune golden file (no tiletune_golden metadata)")
        meta = json.loads(raw_meta)
        if meta["fingerprint"] != model_print:
            raise UserError(
                f"golden file {path} was made from a different model or config (fingerprint {meta['fingerprint']}, "
                f"this one {model_print}); make it with the same model_name_or_path, finetuning keys and seed"
            )
        tensors = {key: handle.get_tensor(key) for key in handle.keys()}
    count = len({k.split(".")[1] for k in tensors if k.startswith("input.")})
    batches = [{key.split(".", 2)[2]: value for key, value in tensors.items() if key.startswith(f"input.{i}.")}
               for i in range(count)]  # fmt: skip
    stock = {k.removeprefix("stock."): v for k, v in tensors.items() if k.startswith("stock.")}
    return batches, stock, meta


def golden_tolerances(names, meta: dict, dtype: torch.dtype, k: float, fixed: float | None) -> dict[str, float]:
    """Per golden tensor, the relative error allowed against it: `fixed` when given, else the larger of the
    dtype's tolerance and (1 + k) x the golden run's own error against its high-precision reference.

    A run within k x the stock error of the truth is within (1 + k) x of the golden stock run, so this
    bound is the precision policy seen from the golden tensors; a model whose bf16 noise is large
    (random weights, long sequences) is not failed for noise the stock run has too.
    """
    stock_error = meta.get("stock_error", {})  # absent in golden files from before 2026-12-03
    return {name: fixed or max(DTYPE_TOLERANCE[dtype], (1 + k) * stock_error.get(name, 0.0)) for name in names}


def compare_to_golden(captured: dict, golden: dict, tolerances: dict[str, float]) -> list[dict]:
    """Every golden tensor against this machine's run: errors and pass when finite and rel_l2 <= its tolerance."""
    rows = []
    for name, want in golden.items():
        if name not in captured:
            rows.append({"name": name, "passed": False, "missing": True})
            continue
        err = errors(captured[name], want)
        passed = err.finite and err.rel_l2 <= tolerances[name]
        rows.append({"name": name, **err.to_dict(), "tolerance": tolerances[name], "passed": passed})
    return sorted(rows, key=lambda r: (r["passed"], -r.get("rel_l2", float("inf")) / r.get("tolerance", 1.0)))


# ---- convergence -------------------------------------------------------------------------------


def loss_curve(model, batches, steps: int, lr: float, dtype, device, seed: int, loss_of: StepLoss) -> list[float]:
    """Losses of `steps` AdamW steps of `loss_of` over `batches` (cycled), from the model's current weights."""
    from tiletune.train.model import autocast

    torch.manual_seed(seed)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr)
    losses = []
    for step in range(steps):
        batch = batches[step % len(batches)]
        with autocast(device, dtype):
            loss = loss_of(model, batch, device)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def convergence(cfg: TuneConfig, model, spec, batches, steps: int, lr: float, dtype, device, seed: int,
                tolerance: float) -> dict:  # fmt: skip
    """Stock and patched loss curves from the same weights and data, their largest relative gap, a verdict.

    The trainable weights are restored afterwards, so later checks see the model as it was.
    """
    start = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}

    def restore():
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name in start:
                    param.copy_(start[name])

    stock = loss_curve(model, batches, steps, lr, dtype, device, seed, step_loss(cfg))
    restore()
    report = apply_kernels(model, spec)
    try:
        patched = loss_curve(model, batches, steps, lr, dtype, device, seed, step_loss(cfg, spec))
    finally:
        report.revert()
        restore()
    gap = max(abs(a - b) / max(abs(a), 1e-12) for a, b in zip(stock, patched))
    finite = all(math.isfinite(loss) for loss in patched)
    return {"steps": steps, "stock": stock, "patched": patched, "max_relative_gap": gap, "tolerance": tolerance,
            "passed": finite and gap <= tolerance}  # fmt: skip


# ---- the command -------------------------------------------------------------------------------


def run_verify(cfg: TuneConfig, options: VerifyOptions) -> dict:
    """Run the checks the options ask for; write verify.json / verify.png; returns the result. Its `outcome`: "pass",
    "fail" (a tensor or the loss curve fails), or "not verified": some selected kernel cannot run here
    (`not_verified` says which and why; when none can, no run is made)."""
    from tiletune.env import run_stamp
    from tiletune.verify.report import heatmap

    spec = parse_kernel_spec(cfg.kernels)
    if cfg.stage == "rm":
        raise UserError("verify differentiates the pt, sft, dpo and kto losses; stage rm's value-head loss is not among "
                        "them: verify the same kernels with stage=dpo on the same pairs")  # fmt: skip
    if not spec.ops and options.against is None:
        raise UserError("verify compares the kernel-patched model with the stock one: set a kernels: block (e.g. kernels=all)")
    if (options.out_dir / "verify.json").exists():
        raise UserError(f"{options.out_dir} already holds a verify report; choose another --out or move it away")
    skipped = not_running(spec)
    running = dataclasses.replace(spec, ops=tuple(s for s in spec.ops if s.op not in skipped))
    unchecked = {"not_verified": not_verified(skipped)} if skipped else {}
    if spec.ops and not running.ops:  # nothing to compare: no run is made
        return _written({"environment": run_stamp(), "kernels": spec.to_dict(), **unchecked, "passed": False,
                         "outcome": NOT_VERIFIED}, options.out_dir)  # fmt: skip
    model, batches, device, dtype = prepare(cfg, options)
    model_print = fingerprint(model)
    probe = apply_kernels(model, running)
    bound = {entry.op for entry in probe.entries if entry.installed}
    probe.revert()
    result = {"environment": {**run_stamp(), "dtype": str(dtype).removeprefix("torch."), "seed": options.seed},
              "fingerprint": model_print, "kernels": spec.to_dict(), **unchecked, "passed": True,
              "accumulation": accumulation_differences(running, bound), "quantization": quantization_errors(model)}  # fmt: skip

    if options.against is not None:
        batches, golden, meta = load_golden(options.against, model_print)
        report = apply_kernels(model, spec)
        try:
            watch = watched_modules(model, sorted({_module_of(name) for name in golden} - {None}))
            captured = run_and_capture(model, batches, watch, dtype, device, step_loss(cfg, spec))
        finally:
            report.revert()
        tolerances = golden_tolerances(golden, meta, dtype, options.k, options.tolerance)
        rows = compare_to_golden(captured, golden, tolerances)
        result["golden"] = {"file": str(options.against), "made_on": meta["environment"], "k": options.k,
                            "fixed_tolerance": options.tolerance, "tensors": rows}  # fmt: skip
        result["passed"] = all(r["passed"] for r in rows)
    else:
        probe = apply_kernels(model, spec)  # which modules the kernels go to: watch those too
        extra = _patched_paths(probe)
        probe.revert()
        compile_ahead(model, running, dtype)
        if options.steps:
            lr = cfg.train_arg("learning_rate", 1e-4)
            tolerance = options.tolerance or 5 * DTYPE_TOLERANCE[dtype]
            result["convergence"] = convergence(cfg, model, spec, batches, options.steps, lr, dtype, device, options.seed,
                                                tolerance)  # fmt: skip
        stock, patched, reference, report = capture_three(cfg, model, spec, batches, device, dtype, extra)
        verdicts = compare_runs(stock, patched, reference, dtype, options.k, options.floor_ulps)
        result.update(
            k=options.k,
            floor_ulps=options.floor_ulps,
            patch=report.to_dict(),
            warnings=dtype_warnings(stock, dtype),
            tensors=[v.to_dict() for v in verdicts],
        )
        result["passed"] = all(v.passed for v in verdicts) and result.get("convergence", {}).get("passed", True)
        if options.save_golden is not None:
            meta = {"fingerprint": model_print, "environment": result["environment"], "kernels": "stock",
                    "stock_error": {v.name: v.stock.rel_l2 for v in verdicts}}  # fmt: skip
            save_golden(options.save_golden, batches, stock, meta)
        options.out_dir.mkdir(parents=True, exist_ok=True)
        heatmap(verdicts, options.out_dir / "verify.png")
    result["outcome"] = "fail" if not result["passed"] else NOT_VERIFIED if skipped else "pass"
    return _written(result, options.out_dir)


def _written(result: dict, out_dir: Path) -> dict:
    """`result`, saved as out_dir/verify.json."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "verify.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    return result


def quantization_errors(model) -> list[dict]:
    """Each quantized Linear's error against the original weight it was quantized from (relative L2, measured at
    load; None for a checkpoint saved quantized): what quantization costs, apart from the kernels' gate."""
    from tiletune.kernels.quant_linear import QuantLinear

    return [{"layer": name.removeprefix("base_model.model."), "kind": module.kind, "rel_l2": module.quantization_error}
            for name, module in model.named_modules() if isinstance(module, QuantLinear)]


def _module_of(captured_name: str) -> str | None:
    """`layers.3.mlp` for `b0.layers.3.mlp.output`; None for losses, parameter gradients and whole layers."""
    match = re.match(r"b\d+\.(layers\.\d+\.[^.].*)\.(output|input_grad)$", captured_name)
    return match.group(1) if match else None


def _patched_paths(report) -> list[str]:
    return sorted({f"layers.{e.layer}.{e.module}" for e in report.entries if e.layer >= 0})  # not model-level ops
