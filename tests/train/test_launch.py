"""Several processes: FORCE_TORCHRUN re-launches tiletune under torchrun; on CPUs the 2-process (gloo DDP)
run of the demo gives the same losses as one process with the same global batch."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tiletune.train.launch import torchrun_command

REPO = Path(__file__).resolve().parents[2]


def test_torchrun_command_follows_the_llamafactory_variables(monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.delenv("FORCE_TORCHRUN", raising=False)
    assert torchrun_command(["train", "c.yaml"]) is None
    monkeypatch.setenv("FORCE_TORCHRUN", "1")
    monkeypatch.setenv("NPROC_PER_NODE", "4")
    monkeypatch.setenv("NNODES", "2")
    monkeypatch.setenv("MASTER_PORT", "29511")
    command = torchrun_command(["train", "c.yaml", "lr=1"])
    assert command[1:3] == ["-m", "torch.distributed.run"] and command[-5:] == ["-m", "tiletune", "train", "c.yaml", "lr=1"]
    assert command[command.index("--nproc_per_node") + 1] == "4" and command[command.index("--nnodes") + 1] == "2"
    monkeypatch.setenv("LOCAL_RANK", "0")  # already under torchrun
    assert torchrun_command(["train", "c.yaml"]) is None


def losses(out: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (out / "trainer_log.jsonl").read_text().splitlines()]


def test_two_gloo_processes_match_one_process(tmp_path):
    common = ["train", "examples/demo.yaml", "do_predict=false", "max_samples=64", "max_steps=5", "logging_steps=1",
              "save_steps=1000", "plot_loss=false"]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE")}
    one = subprocess.run([sys.executable, "-m", "tiletune", *common, "per_device_train_batch_size=8",
                          f"output_dir={tmp_path / 'one'}"], cwd=REPO, env=env, capture_output=True, text=True)  # fmt: skip
    assert one.returncode == 0, one.stderr[-2000:]
    two = subprocess.run([sys.executable, "-m", "tiletune", *common, "per_device_train_batch_size=4",
                          f"output_dir={tmp_path / 'two'}"], cwd=REPO, capture_output=True, text=True,
                         env={**env, "FORCE_TORCHRUN": "1", "NPROC_PER_NODE": "2"})  # fmt: skip
    assert two.returncode == 0, two.stderr[-2000:]
    assert len(losses(tmp_path / "two")) == 5  # one process writes the log
    assert losses(tmp_path / "two") == pytest.approx(losses(tmp_path / "one"), rel=1e-5)
    assert (tmp_path / "two" / "adapter_model.safetensors").is_file()
