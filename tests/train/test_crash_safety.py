"""A run that dies: SIGINT/SIGTERM stop cleanly, one run per output_dir, resuming is bit-exact, a SIGKILL at any
moment (inside checkpoint writes too) never leaves a damaged checkpoint picked for resume, a full disk stops
cleanly. The killed runs are `tiletune train` subprocesses on the tiny Llama of conftest.py."""

import errno
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
import yaml
from safetensors.torch import load_file

from tiletune.config import build_config
from tiletune.errors import UserError
from tiletune.train.safety import (
    EXIT_DISK_FULL,
    EXIT_NONFINITE,
    EXIT_STOPPED,
    LOCK_NAME,
    RunStopped,
    checkpoint_problem,
)
from tiletune.train.trainer import (
    STAGING_DIR,
    complete_checkpoints,
    find_resume_checkpoint,
    run_train,
)

RECORDS = [{"instruction": f"say {w}", "input": "", "output": f"{w} {w}"} for w in "abcdefghijklmnopqrstuvwx"]

# Runs `tiletune train` in a subprocess. TT_STEP_SLEEP slows each micro-batch; TT_KILL="N:mode" sends SIGKILL at
# the N-th write into output_dir (torch.save, safetensors' save_file, the manifest, os.replace, shutil.rmtree),
# "before" it starts or "inside" it: a file cut to half its size, a folder half deleted.
DRIVER = """
import os, signal, sys
from pathlib import Path
import safetensors.torch, shutil, torch
out = os.environ["TT_OUT"]
calls = [0]
kill_at, _, mode = os.environ.get("TT_KILL", "0:before").partition(":")

def killing(write, path_arg):
    def wrapped(*args, **kwargs):
        path = str(args[path_arg])
        if not path.startswith(out):
            return write(*args, **kwargs)
        calls[0] += 1
        if calls[0] != int(kill_at):
            return write(*args, **kwargs)
        if mode == "inside" and write is rmtree:  # a folder half deleted
            for first in sorted(p for p in Path(path).rglob("*") if p.is_file())[:1]:
                os.remove(first)
        elif mode == "inside":  # a file half written (a folder's rename or manifest: just done)
            write(*args, **kwargs)
            if os.path.isfile(path):
                os.truncate(path, os.path.getsize(path) // 2)
        os.kill(os.getpid(), signal.SIGKILL)
    return wrapped

rmtree = shutil.rmtree

torch.save = killing(torch.save, 1)
safetensors.torch.save_file = killing(safetensors.torch.save_file, 1)
os.replace = killing(os.replace, 0)
shutil.rmtree = killing(shutil.rmtree, 0)
import tiletune.train.safety as safety
safety.write_manifest = killing(safety.write_manifest, 0)
if os.environ.get("TT_STEP_SLEEP"):
    import time
    from transformers import Trainer
    step = Trainer.training_step
    Trainer.training_step = lambda *a, **k: (time.sleep(float(os.environ["TT_STEP_SLEEP"])), step(*a, **k))[1]
from tiletune.cli import main
main(sys.argv[1:])
"""


@pytest.fixture(scope="module")
def base(tmp_path_factory, tiny_model_dir):
    """A tiny LoRA run's keys but output_dir: dropout (RNG), gradient accumulation, a checkpoint every 2 steps."""
    data = tmp_path_factory.mktemp("data")
    (data / "t.json").write_text(json.dumps(RECORDS))
    (data / "dataset_info.json").write_text(json.dumps({"t": {"file_name": "t.json"}}))
    return {
        "model_name_or_path": str(tiny_model_dir), "stage": "sft", "do_train": True, "finetuning_type": "lora",
        "lora_target": "all", "lora_dropout": 0.1, "dataset": "t", "dataset_dir": str(data), "template": "llama3",
        "cutoff_len": 64, "per_device_train_batch_size": 2, "gradient_accumulation_steps": 2, "learning_rate": 1e-3,
        "max_steps": 8, "logging_steps": 1, "save_steps": 2, "save_total_limit": 2, "plot_loss": True,
        "report_to": "none", "seed": 7,
    }  # fmt: skip


@pytest.fixture(scope="module")
def uninterrupted(base, tmp_path_factory):
    """The run uninterrupted: its logged losses and final adapter."""
    out = tmp_path_factory.mktemp("uninterrupted") / "out"
    run_train(build_config({**base, "output_dir": str(out)}))
    return losses(out), adapter(out)


@pytest.fixture
def setup(tmp_path, base):
    """`config(**keys)` writes the run's config file (output in tmp_path/out); `config.raw` is its keys."""
    raw = {**base, "output_dir": str(tmp_path / "out")}

    def config(**keys):
        path = tmp_path / "run.yaml"
        path.write_text(yaml.safe_dump({**raw, **keys}))
        return path

    config.raw = raw
    return config


def start(config_path, *overrides, kill=None, step_sleep=None):
    """`tiletune train` through DRIVER in a subprocess; its output goes to `proc.log` (run.log beside the config)."""
    out = yaml.safe_load(config_path.read_text())["output_dir"]
    env = {**os.environ, "TT_OUT": out, "TT_KILL": kill or "0:before", "TT_STEP_SLEEP": step_sleep or ""}
    log = config_path.with_name("run.log")
    with log.open("w") as handle:
        proc = subprocess.Popen([sys.executable, "-c", DRIVER, "train", str(config_path), *overrides], env=env,
                                stdout=handle, stderr=subprocess.STDOUT)  # fmt: skip
    proc.log = log
    return proc


def wait_for(condition, proc, timeout=60):
    deadline = time.monotonic() + timeout
    while not condition():
        assert proc.poll() is None, proc.log.read_text()[-3000:]
        assert time.monotonic() < deadline
        time.sleep(0.05)


def logged_steps(out):
    log = out / "trainer_log.jsonl"
    return [json.loads(line) for line in log.read_text().splitlines()] if log.is_file() else []


def losses(out):
    return [(r["step"], r["loss"]) for r in logged_steps(out) if "loss" in r]


def adapter(out):
    return load_file(out / "adapter_model.safetensors")


def resume_and_compare(setup, uninterrupted):
    """Resume the run in tmp_path/out to its end: the losses logged and the final adapter are the uninterrupted run's."""
    cfg = build_config({**setup.raw, "resume_from_checkpoint": True})
    run_train(cfg)
    out = cfg.output_dir
    expected_losses, expected_adapter = uninterrupted
    assert losses(out) == expected_losses
    final = adapter(out)
    assert final.keys() == expected_adapter.keys()
    assert all(torch.equal(final[k], expected_adapter[k]) for k in final)
    assert (out / "training_loss.png").is_file()


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_signal_saves_a_checkpoint_prints_the_resume_command_and_exits_75(setup, tmp_path, uninterrupted, sig):
    config = setup()
    proc = start(config, "plot_loss=true", step_sleep="0.5")
    out = tmp_path / "out"
    wait_for(lambda: len(logged_steps(out)) >= 2, proc)  # in step 3, between the checkpoints of steps 2 and 4
    proc.send_signal(sig)
    time.sleep(0.2)
    proc.send_signal(signal.SIGTERM if sig == signal.SIGINT else signal.SIGINT)  # the other one: torchrun's echo
    assert proc.wait(timeout=60) == EXIT_STOPPED, proc.log.read_text()[-3000:]
    output = proc.log.read_text()
    step = logged_steps(out)[-1]["step"]
    assert step == 3
    assert f"stopped by {sig.name} at step {step}; checkpoint: {out / f'checkpoint-{step}'}" in output
    assert f"resume with: tiletune train {config} plot_loss=true resume_from_checkpoint=true" in output
    assert checkpoint_problem(out / f"checkpoint-{step}") is None
    assert not (out / LOCK_NAME).exists()
    resume_and_compare(setup, uninterrupted)


def test_second_signal_stops_at_once_and_keeps_the_checkpoints(setup, tmp_path):
    proc = start(setup(save_steps=1), step_sleep="1")
    out = tmp_path / "out"
    wait_for(lambda: (out / "checkpoint-1").is_dir(), proc)
    proc.send_signal(signal.SIGINT)
    time.sleep(0.3)  # handled at once (sleeping is interrupted), while the step still has seconds to go
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=30) == 128 + signal.SIGINT
    assert [p.name for p in complete_checkpoints(out)] == ["checkpoint-1"]
    assert checkpoint_problem(out / "checkpoint-1") is None


def test_a_second_run_in_the_same_output_dir_is_refused_and_a_dead_runs_lock_is_not(setup, tmp_path):
    first = start(setup(max_steps=1000, save_steps=1000), step_sleep="1")
    out = tmp_path / "out"
    wait_for(lambda: (out / LOCK_NAME).is_file(), first)
    second = subprocess.run([sys.executable, "-m", "tiletune", "train", str(setup(overwrite_output_dir=True))],
                            check=False, capture_output=True, text=True)  # fmt: skip
    assert second.returncode == 2
    assert second.stderr.strip().splitlines() == [
        (f"tiletune: error: output_dir {out} is in use by another run (pid {first.pid} on {os.uname().nodename}); "
         f"wait for it to end or choose another output_dir (if that run is gone, delete {out / LOCK_NAME})")
    ]
    first.kill()
    first.wait()
    assert (out / LOCK_NAME).is_file()  # left by the killed run ...
    run_train(build_config({**setup.raw, "max_steps": 1, "overwrite_output_dir": True}))  # ... and taken over
    assert not (out / LOCK_NAME).exists()


# Kill moments among the 36 writes of a run: a save makes 8 (staging cleanup, adapter, training_args, optimizer,
# scheduler, RNG state, manifest, rename), from checkpoint-6 on a 9th deletes the oldest, the last 2 are the final
# adapter's. Each kind of write once, in the second save (writes 9-16, the first save's checkpoint intact beside it),
# inside it (a file torn, a folder half deleted, a rename or manifest just done) or before it; the first save's
# adapter torn (no complete checkpoint yet), the oldest checkpoint half deleted, the final adapter torn: 12.
KILLS = ["2:inside", "9:inside", "10:inside", "11:before", "12:inside", "13:before", "14:inside", "15:inside",
         "16:before", "16:inside", "25:inside", "35:inside"]


@pytest.mark.parametrize("kill", KILLS)
def test_sigkill_at_any_write_never_leaves_a_damaged_checkpoint_for_resume(setup, tmp_path, uninterrupted, kill):
    proc = start(setup(), kill=kill)
    assert proc.wait(timeout=120) == -signal.SIGKILL, proc.log.read_text()[-3000:]
    out = tmp_path / "out"
    cfg = build_config({**setup.raw, "resume_from_checkpoint": True})
    if not complete_checkpoints(out):
        with pytest.raises(UserError, match="holds no checkpoint"):
            find_resume_checkpoint(cfg, out)
        return
    assert checkpoint_problem(find_resume_checkpoint(cfg, out)) is None
    resume_and_compare(setup, uninterrupted)


def test_damaged_checkpoint_is_named_and_the_one_before_is_used(setup, tmp_path, caplog):
    run_train(build_config({**setup.raw, "max_steps": 4}))
    out = tmp_path / "out"
    optimizer = out / "checkpoint-4" / "optimizer.pt"
    optimizer.write_bytes(optimizer.read_bytes()[:100])
    cfg = build_config({**setup.raw, "resume_from_checkpoint": True})
    with caplog.at_level("WARNING", logger="tiletune"):
        assert find_resume_checkpoint(cfg, out) == out / "checkpoint-2"
    assert f"{out / 'checkpoint-4'} is damaged (optimizer.pt holds 100 bytes" in caplog.text
    explicit = build_config({**setup.raw, "resume_from_checkpoint": str(out / "checkpoint-4")})
    with pytest.raises(UserError, match=rf"is damaged \(optimizer.pt .*; resume_from_checkpoint={out / 'checkpoint-2'} is intact"):
        find_resume_checkpoint(explicit, out)


def test_disk_full_during_a_save_stops_cleanly_and_keeps_the_checkpoint_before(setup, tmp_path, monkeypatch):
    from transformers import Trainer

    save = Trainer._save_rng_state

    def full_at_step_4(self, output_dir):
        if self.state.global_step == 4:
            raise OSError(errno.ENOSPC, "No space left on device")
        save(self, output_dir)

    monkeypatch.setattr(Trainer, "_save_rng_state", full_at_step_4)
    out = tmp_path / "out"
    with pytest.raises(RunStopped, match=f"disk full while writing checkpoint-4 in {out}; the partial save was "
                                         "removed and checkpoint-2 before it is intact") as stopped:  # fmt: skip
        run_train(build_config(setup.raw))
    assert stopped.value.exit_code == EXIT_DISK_FULL and stopped.value.checkpoint == out / "checkpoint-2"
    assert [p.name for p in complete_checkpoints(out)] == ["checkpoint-2"]
    assert checkpoint_problem(out / "checkpoint-2") is None
    assert not any((out / STAGING_DIR).iterdir())
    assert not (out / LOCK_NAME).exists()


def test_nonfinite_loss_stops_naming_the_step_and_the_first_layer(setup, tmp_path, monkeypatch):
    from tiletune.train import model as model_module

    load, forwards = model_module.load_model, []

    def poison_layer_1_mlp(module, args, output):
        forwards.append(module)
        return output * float("inf") if len(forwards) > 4 else None  # from step 3 on (2 micro-batches a step)

    def load_poisoned(*args, **kwargs):
        model = load(*args, **kwargs)
        model.get_submodule("base_model.model.model.layers.1.mlp").register_forward_hook(poison_layer_1_mlp)
        return model

    monkeypatch.setattr(model_module, "load_model", load_poisoned)
    out = tmp_path / "out"
    with pytest.raises(RunStopped) as stopped:
        run_train(build_config({**setup.raw, "disable_gradient_checkpointing": True}))  # one forward a micro-batch
    assert str(stopped.value) == (
        "loss is nan at step 3; the first output that went non-finite is base_model.model.model.layers.1.mlp's; "
        f"stopped before the optimizer step, {out / 'checkpoint-2'} is the last checkpoint; "
        "nonfinite_loss=skip would skip such micro-batches"
    )
    assert stopped.value.exit_code == EXIT_NONFINITE and stopped.value.checkpoint == out / "checkpoint-2"


def test_nonfinite_loss_skip_drops_those_micro_batches_and_trains_on(setup, tmp_path, monkeypatch, caplog):
    """`nonfinite_loss: skip`: a micro-batch with a non-finite loss adds no gradient (warned, named) and the run
    finishes with finite adapter weights."""
    from safetensors.torch import load_file

    from tiletune.train import model as model_module

    load, forwards = model_module.load_model, []

    def poison_the_fifth_forward(module, args, output):  # and its run again that looks for the module
        forwards.append(module)
        return output * float("inf") if len(forwards) in (5, 6) else None

    def load_poisoned(*args, **kwargs):
        model = load(*args, **kwargs)
        model.get_submodule("base_model.model.model.layers.1.mlp").register_forward_hook(poison_the_fifth_forward)
        return model

    monkeypatch.setattr(model_module, "load_model", load_poisoned)
    run_train(build_config({**setup.raw, "disable_gradient_checkpointing": True, "nonfinite_loss": "skip"}))
    assert "loss is nan at step 3; the first output that went non-finite is" in caplog.text
    assert "nonfinite_loss=skip: this micro-batch adds no gradient" in caplog.text
    adapter = load_file(str(tmp_path / "out" / "adapter_model.safetensors"))
    assert adapter and all(torch.isfinite(t).all() for t in adapter.values())


def test_a_checkpoint_from_before_manifests_resumes_unverified(tmp_path):
    """A checkpoint moved into place whole by an older tiletune has no manifest: usable (its trainer_state.json is
    there), not called damaged; one without either is cut short."""
    from tiletune.train.safety import checkpoint_problem

    older = tmp_path / "checkpoint-4"
    older.mkdir()
    (older / "adapter_model.safetensors").write_bytes(b"\0" * 16)
    assert "cut short" in checkpoint_problem(older)
    (older / "trainer_state.json").write_text("{}")
    assert checkpoint_problem(older) is None
