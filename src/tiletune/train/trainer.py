"""`tiletune train`: config -> tokenizer, template, data, model -> Trainer -> outputs in `output_dir`.

Outputs: the adapter (or model) with its tokenizer, trainer_log.jsonl, training_loss.png (`plot_loss`),
all_results.json, checkpoint-N every `save_steps` (written to a staging folder, given a manifest of its files'
sizes and hashes, and renamed into place, so a crash mid-save never leaves a checkpoint that looks complete),
and with `do_predict`, generated_predictions.jsonl and predict_results.json. `safety.py` holds the lock on
output_dir, the manifests and the clean stops, `callbacks.StopOnSignal` the stop on SIGINT/SIGTERM.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import shutil
import sys
from contextlib import ExitStack
from pathlib import Path

import torch

from tiletune.config import TuneConfig
from tiletune.errors import UserError
from tiletune.train.safety import (
    EXIT_DISK_FULL,
    EXIT_NONFINITE,
    EXIT_STOPPED,
    LOCK_NAME,
    RunStopped,
    checkpoint_problem,
    first_nonfinite_output,
    output_dir_lock,
    write_manifest,
)

log = logging.getLogger("tiletune")
STAGING_DIR = ".staging"
CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")


def run_train(cfg: TuneConfig, dry_run: bool = False) -> dict:
    """Run what the config asks for (train / eval / predict); returns the metrics written.

    Raises `RunStopped` when a signal, a full disk or a non-finite loss ended training early but cleanly."""
    with ExitStack() as held:  # holds the output_dir lock until the run ends, however it ends
        return _run(cfg, dry_run, held)


def _run(cfg: TuneConfig, dry_run: bool, held: ExitStack) -> dict:
    from transformers import set_seed

    from tiletune.data.processing import build_splits
    from tiletune.data.templates import get_template
    from tiletune.train.callbacks import StopOnSignal, peak_memory_gib
    from tiletune.train.model import (
        compute_dtype,
        load_model,
        load_tokenizer,
        set_checkpointing,
    )

    _configure_logging()
    do_train, do_eval, do_predict = (bool(cfg.train_arg(k)) for k in ("do_train", "do_eval", "do_predict"))
    if not (do_train or do_eval or do_predict):
        raise UserError("nothing to do: set do_train, do_eval or do_predict to true")
    kernel_spec = _kernel_spec(cfg)  # a bad `kernels:` block fails before anything heavy loads
    output_dir = cfg.output_dir
    resume = find_resume_checkpoint(cfg, output_dir) if do_train else None
    main_process = int(os.environ.get("RANK", "0")) == 0  # under torchrun, one process writes the outputs
    if not dry_run and main_process:
        held.enter_context(output_dir_lock(output_dir))
        check_output_dir(cfg, output_dir, resuming=resume is not None, training=do_train)
    set_seed(cfg.train_arg("seed", 42))

    tokenizer = load_tokenizer(cfg)
    template = get_template(cfg.template, tokenizer, cfg.stage, cfg.default_system)
    template.fix_tokenizer(tokenizer)
    splits = build_splits(cfg, tokenizer, template)
    model = load_model(cfg, tokenizer, trainable=do_train)
    kernel_report = _apply_kernels(model, kernel_spec, None if dry_run else compute_dtype(cfg))
    recompute_plan = _plan_recomputation(cfg, model) if do_train and not dry_run else None
    summary = _summary(cfg, model, splits, template)
    log.info("%s", json.dumps(summary))
    if dry_run:
        print(_dry_run_report(summary, tokenizer, splits))
        return summary

    output_dir.mkdir(parents=True, exist_ok=True)
    if kernel_report is not None and main_process:
        kernel_report.save(output_dir)
    if recompute_plan is not None and main_process:
        (output_dir / "recompute.json").write_text(json.dumps(recompute_plan.to_dict(), indent=2) + "\n")
    metrics: dict = {}
    if do_train or do_eval:
        trainer = _make_trainer(cfg, model, tokenizer, splits, output_dir)
    if do_train:
        with StopOnSignal() as stop:
            trainer.add_callback(stop)
            result = trainer.train(resume_from_checkpoint=str(resume) if resume else None)
        if stop.stopped and trainer.state.global_step < trainer.state.max_steps:
            checkpoint = complete_checkpoints(output_dir)[-1]
            raise RunStopped(f"stopped by {stop.received or 'a signal to another process'} at step {trainer.state.global_step}; checkpoint: {checkpoint}",
                             checkpoint, EXIT_STOPPED)  # fmt: skip
        trainer.save_model()
        trainer.save_state()
        if kernel_report is not None and main_process:  # again, with the fallbacks seen at run time
            kernel_report.save(output_dir)
        train_metrics = dict(result.metrics)
        train_metrics["peak_memory_gib"] = round(peak_memory_gib(), 3)
        trainer.log_metrics("train", train_metrics)
        trainer.save_metrics("train", train_metrics)
        metrics.update(train_metrics)
        if cfg.plot_loss and main_process:
            from tiletune.train.plots import plot_loss

            plot_loss(output_dir)
    if do_eval:
        eval_metrics = trainer.evaluate()
        trainer.log_metrics("eval", eval_metrics)
        trainer.save_metrics("eval", eval_metrics)
        metrics.update(eval_metrics)
    if do_predict and splits.predict is not None and main_process:
        from tiletune.train.host_tables import tables_to_device
        from tiletune.train.predict import run_predict

        if do_train and cfg.checkpointing != "off":
            set_checkpointing(model, enabled=False)
            tables_to_device(model)  # `gradient_checkpointing: auto` may have left them on the host
        predict_metrics = run_predict(cfg, model, tokenizer, template, splits.predict, output_dir)
        _merge_all_results(output_dir, predict_metrics)
        print(json.dumps(predict_metrics, indent=2))
        metrics.update(predict_metrics)
    return metrics


def _kernel_spec(cfg: TuneConfig):
    if cfg.kernels is None:
        return None
    from tiletune.patch import parse_kernel_spec

    spec = parse_kernel_spec(cfg.kernels)
    return spec if spec.ops else None


def _plan_recomputation(cfg: TuneConfig, model):
    """With `gradient_checkpointing: auto`, choose each layer's recomputation for the longest batch."""
    if cfg.checkpointing != "auto":
        return None
    from tiletune.train.model import compute_dtype
    from tiletune.train.preference import recompute_probe
    from tiletune.train.recompute import plan_recomputation

    if cfg.train_arg("deepspeed") or cfg.train_arg("fsdp"):
        raise UserError("gradient_checkpointing=auto plans for one device holding the whole model; with deepspeed "
                        "or fsdp set gradient_checkpointing=true")  # fmt: skip
    if torch.cuda.is_available():  # the probe measures on the device the Trainer will train on
        model.to(torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))))
    rows, probe_loss = recompute_probe(cfg, cfg.train_arg("per_device_train_batch_size", 8))
    plan = plan_recomputation(model, rows, cfg.cutoff_len, compute_dtype(cfg), cfg.gradient_checkpointing_budget,
                              cfg.use_reentrant_gc, cfg.gradient_checkpointing_offload, probe_loss,
                              host_budget_gib=cfg.gradient_checkpointing_host_budget)
    print(plan.summary())
    return plan


def _apply_kernels(model, spec, compile_dtype: torch.dtype | None):
    """Compile the `kernels:` selection's kernels for `compile_dtype` side by side (on a GPU; None: not now),
    patch them into the model and show the one-screen summary."""
    if spec is None:
        return None
    from tiletune.patch import apply_kernels
    from tiletune.patch.warmup import compile_ahead

    if compile_dtype is not None:
        compile_ahead(model, spec, compile_dtype)
    report = apply_kernels(model, spec)
    print(report.summary())
    return report


# ---- output directory and resuming -------------------------------------------------------------


def find_resume_checkpoint(cfg: TuneConfig, output_dir: Path) -> Path | None:
    """The checkpoint to resume from: `resume_from_checkpoint` as a path, or when true the last one whose files
    match their manifest (a damaged one is named and passed over)."""
    value = cfg.resume_from_checkpoint
    if value in (None, False):
        return None
    if value is True:
        checkpoints = complete_checkpoints(output_dir)
        if not checkpoints:
            raise UserError(f"resume_from_checkpoint is true but {output_dir} holds no checkpoint-N folder")
        for checkpoint in reversed(checkpoints):
            problem = checkpoint_problem(checkpoint)
            if problem is None:
                return checkpoint
            log.warning("%s is damaged (%s); trying the one before it", checkpoint, problem)
        raise UserError(f"every checkpoint in {output_dir} is damaged (see the warnings above); start again with "
                        "overwrite_output_dir=true")  # fmt: skip
    path = Path(value)
    if not (path / "trainer_state.json").is_file():
        raise UserError(f"resume_from_checkpoint={value!r} is not a checkpoint folder (no trainer_state.json in it)")
    problem = checkpoint_problem(path)
    if problem is not None:
        intact = [p for p in complete_checkpoints(path.parent) if p != path and checkpoint_problem(p) is None]
        offer = f"resume_from_checkpoint={intact[-1]} is intact" if intact else "no other checkpoint beside it is intact"
        raise UserError(f"resume_from_checkpoint={value!r} is damaged ({problem}); {offer}")
    return path


def complete_checkpoints(output_dir: Path) -> list[Path]:
    """checkpoint-N folders in `output_dir`, oldest first (staged saves only appear once complete)."""
    if not output_dir.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in output_dir.iterdir() if (m := CHECKPOINT.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found)]


def check_output_dir(cfg: TuneConfig, output_dir: Path, resuming: bool, training: bool) -> None:
    """Refuse to write over another run unless `overwrite_output_dir` (or resuming it)."""
    if not training or resuming or cfg.overwrite_output_dir or not output_dir.is_dir():
        return
    existing = sorted(p.name for p in output_dir.iterdir() if p.name not in (STAGING_DIR, LOCK_NAME))
    if existing:
        shown = ", ".join(existing[:4]) + (" ..." if len(existing) > 4 else "")
        raise UserError(
            f"output_dir {output_dir} already holds a run ({shown}); set overwrite_output_dir=true to replace it, "
            "resume_from_checkpoint=true to continue it, or choose another output_dir"
        )


def _merge_all_results(output_dir: Path, metrics: dict) -> None:
    path = output_dir / "all_results.json"
    merged = json.loads(path.read_text()) if path.is_file() else {}
    merged.update(metrics)
    path.write_text(json.dumps(merged, indent=4, sort_keys=True) + "\n")


# ---- the Trainer -------------------------------------------------------------------------------


def training_arguments(cfg: TuneConfig, output_dir: Path, model):
    """Seq2SeqTrainingArguments from the config's Trainer keys, with LLaMA-Factory's conventions."""
    from transformers import Seq2SeqTrainingArguments

    from tiletune.train.optimizers import trainer_keys

    kwargs = dict(cfg.training)
    kwargs.update(trainer_keys(cfg, model))  # use_galore / use_apollo: the Trainer's own optimizers
    kwargs["output_dir"] = str(output_dir)
    kwargs.setdefault("report_to", "none")
    kwargs["remove_unused_columns"] = False
    kwargs["include_num_input_tokens_seen"] = "non_padding"
    kwargs.setdefault("dataloader_pin_memory", torch.cuda.is_available())
    kwargs.setdefault("use_cpu", not torch.cuda.is_available())  # also makes torchrun on CPUs use gloo DDP
    if cfg.checkpointing != "off":
        # Checkpointing is set up on the model, not by the Trainer, which would otherwise let DDP search
        # for unused parameters: with checkpointed layers that marks gradients ready twice.
        kwargs.setdefault("ddp_find_unused_parameters", False)
    kwargs.pop("resume_from_checkpoint", None)
    if cfg.warmup_ratio and not kwargs.get("warmup_steps"):
        kwargs["warmup_steps"] = cfg.warmup_ratio  # a float below 1 is a ratio of the total steps
    if cfg.disable_shuffling:
        kwargs["train_sampling_strategy"] = "sequential"
    if kwargs.get("deepspeed"):
        kwargs["deepspeed"] = _deepspeed_config(kwargs["deepspeed"])
    try:
        return Seq2SeqTrainingArguments(**kwargs)
    except ValueError as err:  # the Trainer's own consistency checks
        raise UserError(f"training arguments: {err}") from None


def _deepspeed_config(value):
    if isinstance(value, str):
        if not Path(value).is_file():
            raise UserError(f"deepspeed config {value!r} not found; give the path to a DeepSpeed JSON file")
        try:
            json.loads(Path(value).read_text())
        except json.JSONDecodeError as err:
            raise UserError(f"{value}:{err.lineno}: malformed JSON ({err.msg}); fix the file") from None
    try:
        import deepspeed  # noqa: F401
    except ImportError:
        raise UserError("deepspeed is set but DeepSpeed is not installed; pip install 'tiletune[deepspeed]'") from None
    return value


def _make_trainer(cfg: TuneConfig, model, tokenizer, splits, output_dir: Path):
    from transformers.trainer_callback import PrinterCallback
    from transformers.trainer_callback import ProgressCallback as PlainProgress
    from transformers.trainer_utils import rotate_checkpoints

    from tiletune.train.callbacks import JsonlLogCallback, ProgressCallback
    from tiletune.train.model import pissa_convert_callback
    from tiletune.train.optimizers import build_optimizer

    base, arguments, stage_kwargs = _stage(cfg, model, tokenizer)

    class TuneTrainer(base):
        """A Trainer with the config's optimizer, whose checkpoints appear in output_dir only once they are complete,
        stopping at a non-finite loss before the optimizer steps on it."""

        staging = False

        def compute_loss(self, model, inputs, *args, **kwargs):
            result = super().compute_loss(model, inputs, *args, **kwargs)
            loss = result[0] if isinstance(result, tuple) else result
            if cfg.nonfinite_loss == "skip" and not torch.isfinite(loss):  # before its backward: no gradient from it
                layer = first_nonfinite_output(model, inputs)
                log.warning("%s; nonfinite_loss=skip: this micro-batch adds no gradient",
                            _nonfinite_where(loss.item(), self.state.global_step + 1, layer))  # fmt: skip
                zero = loss.new_zeros((), requires_grad=True)
                return (zero, *result[1:]) if isinstance(result, tuple) else zero
            return result

        def training_step(self, model, inputs, num_items_in_batch=None):
            loss = super().training_step(model, inputs, num_items_in_batch)
            if not torch.isfinite(loss):
                layer = first_nonfinite_output(model, self._prepare_inputs(inputs))
                raise _nonfinite_loss(loss.item(), self.state.global_step + 1, layer, Path(self.args.output_dir))
            return loss

        def create_optimizer(self, model=None):
            if self.optimizer is None:
                self.optimizer = build_optimizer(cfg, self.model if model is None else model, self.args)
            return super().create_optimizer(model)

        def _run_epoch(self, *args, **kwargs):
            if self.state.global_step >= self.state.max_steps:  # resumed from the last step: transformers would
                self.control.should_training_stop = True  # train one more before checking
                return
            super()._run_epoch(*args, **kwargs)

        def _get_output_dir(self, trial):
            run_dir = super()._get_output_dir(trial)
            return os.path.join(run_dir, STAGING_DIR) if self.staging else run_dir

        def _save_checkpoint(self, model, trial):
            run_dir = Path(self._get_output_dir(trial))
            name = f"checkpoint-{self.state.global_step}"
            staged = run_dir / STAGING_DIR / name
            if self.args.should_save:
                shutil.rmtree(staged, ignore_errors=True)  # left by a run killed while writing it
            self.staging = True
            try:
                super()._save_checkpoint(model, trial)
            except OSError as err:
                if err.errno != errno.ENOSPC:
                    raise
                shutil.rmtree(staged, ignore_errors=True)
                raise _disk_full(run_dir, name) from None
            finally:
                self.staging = False
            self.accelerator.wait_for_everyone()
            if self.args.should_save:
                write_manifest(staged)
                _move_into_place(staged, run_dir / name)
                rotate_checkpoints(
                    output_dir=str(run_dir),
                    save_total_limit=self.args.save_total_limit,
                    best_model_checkpoint=self.state.best_model_checkpoint,
                    use_mtime=False,
                )
            self.accelerator.wait_for_everyone()

    if cfg.train_arg("eval_strategy") not in (None, "no") and splits.eval is None:
        raise UserError("eval_strategy is set but there is no eval data; set eval_dataset or val_size")
    trainer = TuneTrainer(
        model=model,
        args=arguments(training_arguments(cfg, output_dir, model)),
        train_dataset=splits.train,
        eval_dataset=splits.eval,
        processing_class=tokenizer,
        callbacks=[JsonlLogCallback(output_dir)] + ([pissa_convert_callback()] if cfg.pissa_convert else []),
        **stage_kwargs,
    )
    trainer.remove_callback(PlainProgress)
    trainer.remove_callback(PrinterCallback)
    trainer.add_callback(ProgressCallback())
    return trainer


def _nonfinite_where(loss: float, step: int, layer: str | None) -> str:
    """The loss, the step and the first module whose output went non-finite."""
    where = (f"the first output that went non-finite is {layer}'s" if layer else
             "every module's output was finite when the batch ran again: the loss itself is not (a batch without "
             "a label token?)")  # fmt: skip
    return f"loss is {loss} at step {step}; {where}"


def _nonfinite_loss(loss: float, step: int, layer: str | None, run_dir: Path) -> RunStopped:
    """The stop at a non-finite loss (`nonfinite_loss: stop`), naming where it went non-finite."""
    intact = complete_checkpoints(run_dir)
    last = f"{intact[-1]} is the last checkpoint" if intact else "no checkpoint was written"
    return RunStopped(f"{_nonfinite_where(loss, step, layer)}; stopped before the optimizer step, {last}; "
                      "nonfinite_loss=skip would skip such micro-batches", intact[-1] if intact else None,
                      EXIT_NONFINITE)  # fmt: skip


def _disk_full(run_dir: Path, name: str) -> RunStopped:
    """The clean stop when a save runs out of space: the partial save removed, the checkpoint before it named."""
    intact = complete_checkpoints(run_dir)
    before = f"{intact[-1].name} before it is intact" if intact else "there is no earlier checkpoint"
    return RunStopped(f"disk full while writing {name} in {run_dir}; the partial save was removed and {before}; "
                      "free some space and resume", intact[-1] if intact else None, EXIT_DISK_FULL)  # fmt: skip


def _stage(cfg: TuneConfig, model, tokenizer):
    """The stage's Trainer class, its arguments from the Seq2SeqTrainingArguments, and extra Trainer keywords."""
    from tiletune.train import preference

    if cfg.stage in preference.STAGES:
        from tiletune.train.model import load_model

        return preference.preference_stage(cfg, model, tokenizer, load_model)
    from transformers import Trainer

    from tiletune.data.collator import data_collator

    return Trainer, (lambda args: args), {"data_collator": data_collator(cfg, tokenizer)}


def _move_into_place(staged: Path, final: Path) -> None:
    """Rename a fully written checkpoint to its final name (replacing one of an overwritten run)."""
    if final.exists():
        old = final.with_name(f".replaced-{final.name}")
        os.replace(final, old)
        os.replace(staged, final)
        shutil.rmtree(old)
    else:
        os.replace(staged, final)


# ---- reporting ---------------------------------------------------------------------------------


def _summary(cfg: TuneConfig, model, splits, template) -> dict:
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    return {
        "stage": cfg.stage,
        "finetuning_type": cfg.finetuning_type,
        "template": template.name,
        "dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
        "trainable_params": trainable,
        "all_params": total,
        **(splits.stats or {}),
    }


def _dry_run_report(summary: dict, tokenizer, splits) -> str:
    from tiletune.data.processing import example_ids

    lines = ["dry run: config, model and data are valid"]
    lines += [f"  {key}: {value}" for key, value in summary.items()]
    if splits.train is not None and len(splits.train):
        lengths = [len(example_ids(row)) for row in splits.train]
        lines.append(f"  train tokens: {sum(lengths)} (longest example {max(lengths)})")
        first = splits.train[0]
        lines.append("  first example, as the model sees it:")
        lines.append("    " + tokenizer.decode(example_ids(first)).replace("\n", "\n    "))
    return "\n".join(lines)


def _configure_logging() -> None:
    logging.basicConfig(
        stream=sys.stderr, level=logging.INFO, format="[%(levelname)s|%(name)s] %(message)s", force=False
    )
    for noisy in ("httpx", "urllib3", "filelock", "datasets"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
