"""`tiletune llamafactory train CONFIG.yaml`: LLaMA-Factory's own training, with tiletune's kernels.

The `kernels:` block is taken out of the config; every other key goes to LLaMA-Factory's
`run_exp` unchanged, so LLaMA-Factory parses and runs it exactly as `llamafactory-cli train` would.
Every model LLaMA-Factory loads (its `load_model`, wrapped for the run) gets `apply_kernels`, and a
trainer callback writes kernels.json into `output_dir` when training starts and again when it ends
(with the fallbacks seen at run time). Tested with LLaMA-Factory 0.9.5 (docs/llamafactory.md).
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Iterable, Iterator
from typing import Any

from tiletune.errors import UserError

TESTED_VERSIONS = ("0.9.5",)
INSTALL_HINT = f"pip install llamafactory=={TESTED_VERSIONS[-1]}"


def split_config(path: str, overrides: Iterable[str] = ()) -> tuple[dict[str, Any], Any]:
    """(LLaMA-Factory's arguments, the validated `kernels:` spec or None) from a config and overrides."""
    from tiletune.config import read_raw_config
    from tiletune.patch import parse_kernel_spec

    args = read_raw_config(path, overrides)
    kernels = args.pop("kernels", None)
    spec = parse_kernel_spec(kernels) if kernels is not None else None
    return args, spec if spec is not None and spec.ops else None


def run_llamafactory_train(path: str, overrides: Iterable[str] = ()) -> None:
    """Run LLaMA-Factory's training for the config at `path`, kernels patched into its models."""
    args, spec = split_config(path, overrides)
    try:
        from llamafactory.train.tuner import run_exp
    except ImportError as err:
        raise UserError(f"LLaMA-Factory is not importable here ({err}); install it: {INSTALL_HINT}") from None
    if spec is None:
        run_exp(args=args)
        return
    with kernels_on_loaded_models(spec):
        run_exp(args=args, callbacks=[_kernel_report_callback()])


@contextlib.contextmanager
def kernels_on_loaded_models(spec) -> Iterator[None]:
    """Within the block, every model LLaMA-Factory's `load_model` returns has `spec`'s kernels applied.

    The workflows import `load_model` by name, so each `llamafactory` module holding it is patched.
    """
    import llamafactory.model.loader as loader
    import llamafactory.train.tuner  # noqa: F401  (imports every workflow module)

    from tiletune.patch import apply_kernels

    original = loader.load_model

    @functools.wraps(original)
    def load_model(*args, **kwargs):
        model = original(*args, **kwargs)
        print(apply_kernels(model, spec).summary())
        return model

    holders = [m for name, m in list(sys.modules.items())
               if name.startswith("llamafactory") and getattr(m, "load_model", None) is original]  # fmt: skip
    for module in holders:
        module.load_model = load_model
    try:
        yield
    finally:
        for module in holders:
            module.load_model = original


def _kernel_report_callback():
    """A TrainerCallback writing the trained model's kernels.json into output_dir (main process only)."""
    from transformers import TrainerCallback

    class KernelReport(TrainerCallback):
        def _save(self, args, state, model=None, **kwargs):
            report = getattr(model, "_tiletune_kernels", None)
            if report is not None and state.is_world_process_zero:
                report.save(args.output_dir)

        def on_train_begin(self, args, state, control, **kwargs):
            self._save(args, state, **kwargs)

        def on_train_end(self, args, state, control, **kwargs):
            self._save(args, state, **kwargs)

    return KernelReport()
