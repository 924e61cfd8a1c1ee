"""The README's demo: the untouched base model fails the task, the LoRA fine-tune learns it."""

import json
from pathlib import Path

from click.testing import CliRunner

from tiletune.cli import main

DEMO = Path(__file__).resolve().parents[1] / "examples" / "demo.yaml"


def predict(tmp_path, monkeypatch, *overrides) -> dict:
    monkeypatch.chdir(DEMO.parent.parent)  # the demo names its files relative to the repository root
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["train", str(DEMO), f"output_dir={out}", *overrides])
    assert result.exit_code == 0, result.output
    return json.loads((out / "predict_results.json").read_text())


def test_base_model_cannot_do_the_task(tmp_path, monkeypatch):
    assert predict(tmp_path, monkeypatch, "do_train=false")["predict_exact_match"] <= 0.2


def test_lora_fine_tune_learns_it(demo_run):
    """The README's main job (run once per test run: the chat and export tests read its adapter)."""
    results = json.loads((demo_run / "predict_results.json").read_text())
    assert results["predict_exact_match"] >= 0.8 and results["predict_samples"] == 150
    log = [json.loads(line) for line in (demo_run / "trainer_log.jsonl").read_text().splitlines()]
    assert log[-1]["loss"] < 0.05 * log[0]["loss"]
    assert (demo_run / "adapter_model.safetensors").is_file() and (demo_run / "training_loss.png").is_file()
