"""Bad input gets one clear line on stderr and exit code 2, never a traceback (unless --debug)."""

import importlib.util
import json
import subprocess
import sys

import pytest
import torch
import yaml
from click.testing import CliRunner

from tiletune.cli import main


def write_config(tmp_path, tiny_model_dir, **keys):
    data = tmp_path / "data"
    data.mkdir(exist_ok=True)
    (data / "t.json").write_text(json.dumps([{"instruction": "q", "input": "", "output": "a"}] * 4))
    (data / "dataset_info.json").write_text(json.dumps({"t": {"file_name": "t.json"}}))
    raw = {"model_name_or_path": str(tiny_model_dir), "do_train": True, "dataset": "t", "dataset_dir": str(data),
           "template": "llama3", "output_dir": str(tmp_path / "out"), "max_steps": 1, **keys}  # fmt: skip
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def one_line_error(result) -> str:
    assert result.exit_code == 2, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]  # progress bars may come first
    errors = [line for line in lines if "error" in line.lower()]
    assert errors == [lines[-1]] and lines[-1].startswith("tiletune: error: "), result.stderr
    assert "Traceback" not in result.output
    return lines[-1]


@pytest.mark.parametrize(
    "keys, expected",
    [
        ({"model_name_or_path": "./no/such/model"}, "model_name_or_path './no/such/model' is not a directory"),
        ({"dataset": "nope"}, "dataset 'nope' is not in"),
        ({"cutoff_len": 0}, "cutoff_len=0 must be a positive integer"),
        ({"stage": "ppo"}, "stage='ppo' is not supported yet"),
        ({"lora_rnk": 8}, "unknown key 'lora_rnk'; did you mean 'lora_rank'"),
        ({"template": "llama9"}, "template 'llama9' is unknown"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path, tiny_model_dir, keys, expected):
    path = write_config(tmp_path, tiny_model_dir, **keys)
    message = one_line_error(CliRunner().invoke(main, ["train", str(path)]))
    assert expected in message



@pytest.mark.parametrize("keys, missing", [({"optim": "adamw_8bit"}, "bitsandbytes"), ({"report_to": "wandb"}, "wandb")])
def test_a_value_whose_package_is_missing_fails_the_dry_run(tmp_path, tiny_model_dir, monkeypatch, keys, missing):
    """Caught by the config check, before anything loads: not a traceback once training starts."""
    found = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *args: None if name == missing else found(name, *args))
    path = write_config(tmp_path, tiny_model_dir, **keys)
    message = one_line_error(CliRunner().invoke(main, ["train", str(path), "--dry-run"]))
    assert f"needs {missing}, which is not installed; pip install {missing}" in message

def test_malformed_dataset_json_names_file_and_line(tmp_path, tiny_model_dir):
    path = write_config(tmp_path, tiny_model_dir)
    (tmp_path / "data" / "t.json").write_text('[\n  {"instruction": "q", "output": "a"},\n  {"instruction": }\n]\n')
    message = one_line_error(CliRunner().invoke(main, ["train", str(path)]))
    assert "t.json:3: malformed JSON" in message


def test_output_dir_of_another_run_is_left_alone(tmp_path, tiny_model_dir):
    path = write_config(tmp_path, tiny_model_dir)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "trainer_log.jsonl").write_text("old\n")
    message = one_line_error(CliRunner().invoke(main, ["train", str(path)]))
    assert "already holds a run" in message and (tmp_path / "out" / "trainer_log.jsonl").read_text() == "old\n"


def test_bf16_on_a_gpu_without_it(tmp_path, tiny_model_dir, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, **k: "Tesla T4")
    path = write_config(tmp_path, tiny_model_dir, bf16=True)
    message = one_line_error(CliRunner().invoke(main, ["train", str(path)]))
    assert "Tesla T4 has no bfloat16 support; set bf16=false fp16=true" in message


def test_debug_shows_the_traceback_in_a_real_process(tmp_path, tiny_model_dir):
    path = write_config(tmp_path, tiny_model_dir, cutoff_len=-1)
    plain = subprocess.run([sys.executable, "-m", "tiletune", "train", str(path)], capture_output=True, text=True)
    assert plain.returncode == 2 and plain.stderr.strip().startswith("tiletune: error:") and "cutoff_len=-1" in plain.stderr
    assert plain.stderr.strip().count("\n") == 0
    debug = subprocess.run([sys.executable, "-m", "tiletune", "--debug", "train", str(path)], capture_output=True, text=True)
    assert debug.returncode != 0 and "Traceback" in debug.stderr
