"""What keeps a run's output_dir safe: one run per folder, checkpoints whose files are checked against the sizes
and hashes recorded when they were written, the clean stops (`RunStopped`; the stop on SIGINT/SIGTERM is
`callbacks.StopOnSignal`) and the search for the layer where a loss went non-finite.

Exit codes of `tiletune train` besides 0, 1 and 2 (a mistake, or another run holding the output_dir):
`EXIT_STOPPED` after a signal (a checkpoint was written), `EXIT_DISK_FULL` when a save ran out of space (the
checkpoint before it is intact), `EXIT_NONFINITE` at a NaN or infinite loss (before the optimizer stepped on
it), and 128 + the signal's number when a second signal stopped it at once.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import socket
from contextlib import contextmanager
from pathlib import Path

import torch

from tiletune.errors import UserError

log = logging.getLogger("tiletune")
EXIT_STOPPED = 75  # sysexits' EX_TEMPFAIL: run the same command with resume_from_checkpoint=true
EXIT_DISK_FULL = 74  # sysexits' EX_IOERR
EXIT_NONFINITE = 65  # sysexits' EX_DATAERR
LOCK_NAME = ".tiletune.lock"
MANIFEST_NAME = "tiletune_manifest.json"


class RunStopped(Exception):
    """The run stopped early but cleanly; `checkpoint` (or None) is the one to resume from."""

    def __init__(self, message: str, checkpoint: Path | None, exit_code: int):
        super().__init__(message)
        self.checkpoint, self.exit_code = checkpoint, exit_code


# ---- one run per output_dir ----------------------------------------------------------------------


@contextmanager
def output_dir_lock(output_dir: Path):
    """Hold `output_dir/.tiletune.lock` while the run lasts: another live run's lock refuses this one, a lock left
    by a run that died on this host is taken over."""
    if output_dir.exists() and not output_dir.is_dir():
        raise UserError(f"output_dir {output_dir} is a file; choose a folder")
    output_dir.mkdir(parents=True, exist_ok=True)
    path = output_dir / LOCK_NAME
    staged = path.with_name(f"{LOCK_NAME}.{os.getpid()}")
    staged.write_text(json.dumps({"host": socket.gethostname(), "pid": os.getpid()}))
    try:
        while not _link(staged, path):
            holder = _lock_holder(path)
            if holder is not None:
                raise UserError(f"output_dir {output_dir} is in use by another run (pid {holder['pid']} on "
                                f"{holder['host']}); wait for it to end or choose another output_dir "
                                f"(if that run is gone, delete {path})")  # fmt: skip
            log.warning("taking over %s: the run that left it is no longer running", path)
            path.unlink(missing_ok=True)
    finally:
        staged.unlink()
    try:
        yield
    finally:
        path.unlink(missing_ok=True)


def _link(source: Path, target: Path) -> bool:
    """Create `target` with `source`'s content in one step, unless it exists already."""
    try:
        os.link(source, target)
    except FileExistsError:
        return False
    return True


def _lock_holder(path: Path) -> dict | None:
    """Who holds the lock, or None when it was left by a run that is no longer running (or cannot be read)."""
    try:
        holder = json.loads(path.read_text())
        host, pid = holder["host"], int(holder["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if host != socket.gethostname():
        return holder  # no way to check a process on another machine
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        pass  # alive, another user's
    return holder


# ---- checkpoint manifests ------------------------------------------------------------------------


def write_manifest(checkpoint: Path) -> None:
    """Record every file's size and SHA-256 in the checkpoint (called once it is completely written)."""
    files = {str(p.relative_to(checkpoint)): _describe(p) for p in sorted(checkpoint.rglob("*")) if p.is_file()}
    (checkpoint / MANIFEST_NAME).write_text(json.dumps({"files": files}, indent=1) + "\n")


def checkpoint_problem(checkpoint: Path) -> str | None:
    """What is wrong with a checkpoint's files against its manifest, or None when they all match."""
    manifest = checkpoint / MANIFEST_NAME
    if not manifest.is_file():  # checkpoints move into place whole, manifest included: this one predates manifests
        if (checkpoint / "trainer_state.json").is_file():  # the Trainer's last file: complete, just not verifiable
            log.info("%s has no %s (written before tiletune recorded them): resumed unverified", checkpoint, MANIFEST_NAME)
            return None
        return f"no {MANIFEST_NAME} and no trainer_state.json (cut short)"
    try:
        recorded = json.loads(manifest.read_text())["files"]
    except (ValueError, KeyError):
        return f"{MANIFEST_NAME} is unreadable"
    for name, expected in recorded.items():
        path = checkpoint / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != expected["bytes"]:
            return f"{name} holds {path.stat().st_size} bytes, {expected['bytes']} were written"
        if _describe(path)["sha256"] != expected["sha256"]:
            return f"{name} does not match the hash recorded when it was written"
    return None


def _describe(path: Path) -> dict:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(1 << 20):
            digest.update(chunk)
    return {"bytes": path.stat().st_size, "sha256": digest.hexdigest()}


# ---- non-finite loss -----------------------------------------------------------------------------


def first_nonfinite_output(model, inputs: dict) -> str | None:
    """Run the batch's forward again, watching every module: the first one to finish with NaN or Inf in its
    output (innermost first), or None when all stay finite."""
    found: list[str] = []

    def watch(name):
        def hook(module, args, output):
            if not found and any(not torch.isfinite(t).all() for t in _tensors(output)):
                found.append(name)

        return hook

    handles = [module.register_forward_hook(watch(name)) for name, module in model.named_modules() if name]
    try:
        with torch.no_grad():
            model(**inputs)
    finally:
        for handle in handles:
            handle.remove()
    return found[0] if found else None


def _tensors(output) -> list:
    """The floating-point tensors in a module's output (a tensor, a tuple, a ModelOutput)."""
    if isinstance(output, torch.Tensor):
        return [output] if output.is_floating_point() else []
    if isinstance(output, dict):
        output = list(output.values())
    if isinstance(output, (tuple, list)):
        return [t for item in output for t in _tensors(item)]
    return []
