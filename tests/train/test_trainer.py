"""End-to-end `tiletune train` runs on a tiny random Llama: outputs, resuming, protection of old runs,
atomic checkpoints, and a dry run of every LLaMA-Factory example config."""

import json
import re

import pytest
import torch
import yaml
from click.testing import CliRunner

from tiletune.cli import main
from tiletune.config import build_config
from tiletune.errors import UserError
from tiletune.train.trainer import STAGING_DIR, complete_checkpoints, run_train

RECORDS = [{"instruction": f"say {w}", "input": "", "output": f"{w} {w}"} for w in "abcdefghijklmnopqrstuvwx"]


@pytest.fixture
def run_config(tmp_path, tiny_model_dir):
    data = tmp_path / "data"
    data.mkdir()
    (data / "t.json").write_text(json.dumps(RECORDS))
    (data / "dataset_info.json").write_text(json.dumps({"t": {"file_name": "t.json"}}))

    def make(**keys):
        raw = {
            "model_name_or_path": str(tiny_model_dir),
            "stage": "sft",
            "do_train": True,
            "finetuning_type": "lora",
            "lora_target": "all",
            "dataset": "t",
            "dataset_dir": str(data),
            "template": "llama3",
            "cutoff_len": 64,
            "output_dir": str(tmp_path / "out"),
            "per_device_train_batch_size": 4,
            "learning_rate": 1e-3,
            "max_steps": 4,
            "logging_steps": 1,
            "save_steps": 2,
            "plot_loss": True,
            "report_to": "none",
            **keys,
        }
        return build_config(raw)

    return make


def test_lora_run_writes_every_output(run_config, tmp_path, tiny_model_dir):
    metrics = run_train(run_config(do_predict=True, eval_dataset="t", max_new_tokens=4, do_sample=False))
    out = tmp_path / "out"
    for name in ["adapter_config.json", "adapter_model.safetensors", "tokenizer.json", "all_results.json",
                 "training_loss.png", "generated_predictions.jsonl", "predict_results.json"]:  # fmt: skip
        assert (out / name).is_file(), name
    log = [json.loads(line) for line in (out / "trainer_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [1, 2, 3, 4]
    assert {"loss", "learning_rate", "epoch", "elapsed", "tokens_per_sec", "peak_memory_gib"} <= set(log[0])
    assert [p.name for p in complete_checkpoints(out)] == ["checkpoint-2", "checkpoint-4"]
    assert not (out / STAGING_DIR).exists() or not any((out / STAGING_DIR).iterdir())
    results = json.loads((out / "all_results.json").read_text())
    assert "train_loss" in results and "predict_exact_match" in results and metrics["predict_samples"] == len(RECORDS)
    predictions = [json.loads(line) for line in (out / "generated_predictions.jsonl").read_text().splitlines()]
    assert predictions[0].keys() == {"prompt", "predict", "label"} and predictions[0]["label"] == "a a"

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), out)
    assert any("lora_A" in name for name, _ in adapted.named_parameters())


def test_resume_continues_from_the_last_checkpoint(run_config, tmp_path):
    run_train(run_config(max_steps=4))
    run_train(run_config(max_steps=6, resume_from_checkpoint=True))
    log = [json.loads(line) for line in (tmp_path / "out" / "trainer_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [1, 2, 3, 4, 5, 6]
    state = json.loads((tmp_path / "out" / "trainer_state.json").read_text())
    assert state["global_step"] == 6


def test_another_run_in_output_dir_is_refused_and_kept(run_config, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "adapter_model.safetensors").write_bytes(b"precious")
    with pytest.raises(UserError, match="already holds a run.*overwrite_output_dir=true"):
        run_train(run_config())
    assert (out / "adapter_model.safetensors").read_bytes() == b"precious"


def test_crash_while_saving_leaves_no_checkpoint_that_looks_complete(run_config, tmp_path, monkeypatch):
    from transformers import Trainer

    def crash(self, output_dir):
        raise RuntimeError("disk full")

    monkeypatch.setattr(Trainer, "_save_optimizer_and_scheduler", crash)
    with pytest.raises(RuntimeError, match="disk full"):
        run_train(run_config())
    out = tmp_path / "out"
    assert complete_checkpoints(out) == []
    assert [p.name for p in (out / STAGING_DIR).iterdir()] == ["checkpoint-2"]


@pytest.mark.parametrize("finetuning_type, changed_layers", [("full", {0, 1}), ("freeze", {1})])
def test_full_and_freeze_train_the_expected_layers(run_config, tmp_path, tiny_model_dir, finetuning_type, changed_layers):
    from safetensors.torch import load_file

    run_train(run_config(finetuning_type=finetuning_type, freeze_trainable_layers=1, max_steps=2, save_steps=10))
    before = load_file(tiny_model_dir / "model.safetensors")
    after = load_file(tmp_path / "out" / "model.safetensors")
    changed = {
        int(name.split(".layers.")[1].split(".")[0])
        for name in before
        if ".layers." in name and not torch.equal(before[name], after[name].to(before[name].dtype))
    }
    assert changed == changed_layers


def test_every_llamafactory_example_config_dry_runs(compat_dir, tiny_model_dir, monkeypatch):
    monkeypatch.chdir(compat_dir)  # the examples name their data and DeepSpeed files relative to it
    runner = CliRunner()
    for path in sorted((compat_dir / "examples").glob("train_*/*.yaml")):
        result = runner.invoke(main, ["train", str(path), f"model_name_or_path={tiny_model_dir}", "max_samples=20", "--dry-run"])
        assert result.exit_code == 0, (path.name, result.output)
        assert "dry run: config, model and data are valid" in result.output
        stage = yaml.safe_load(path.read_text())["stage"]
        assert f"stage: {stage}" in result.output


def test_kernels_block_is_applied_reported_and_saved(run_config, tmp_path, capsys):
    run_train(run_config(kernels={"rms_norm": "tilelang", "linear": {"impl": "reference", "layers": "1"}}, max_steps=1))
    saved = json.loads((tmp_path / "out" / "kernels.json").read_text())
    assert saved["ops"]["rms_norm"]["patched"] == 4 and saved["ops"]["rms_norm"]["layers"] == "0-1"
    assert saved["ops"]["linear"]["impl"] == "reference" and saved["ops"]["linear"]["layers"] == "1"
    assert "rms_norm" in capsys.readouterr().out


def test_bad_kernels_block_fails_before_loading_anything(run_config):
    with pytest.raises(UserError, match="rms_nrom"):
        run_train(run_config(kernels={"rms_nrom": "tilelang"}))


@pytest.mark.parametrize("packing", ["neat_packing", "packing"])
def test_packed_sft_run_trains_and_reports_the_packing(run_config, tmp_path, caplog, packing):
    with caplog.at_level("INFO", logger="tiletune"):
        metrics = run_train(run_config(max_steps=2, save_steps=10, do_eval=True, eval_dataset="t", **{packing: True}))
    found = re.search(rf"train: packed {len(RECORDS)} examples into (\d+) sequences of at most 64 tokens", caplog.text)
    assert found and 1 < int(found.group(1)) < len(RECORDS) / 2, caplog.text
    log = [json.loads(line) for line in (tmp_path / "out" / "trainer_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log if "loss" in r] == [1, 2] and all(r["loss"] > 0 for r in log if "loss" in r)
    assert metrics["eval_loss"] > 0


def test_oft_trains_an_orthogonal_adapter(run_config, tmp_path):
    run_train(run_config(finetuning_type="oft", oft_block_size=16, learning_rate=1e-2, max_steps=8, save_steps=10))
    out = tmp_path / "out"
    assert json.loads((out / "adapter_config.json").read_text())["peft_type"] == "OFT"
    losses = [r["loss"] for r in map(json.loads, (out / "trainer_log.jsonl").read_text().splitlines()) if "loss" in r]
    assert len(losses) == 8 and max(losses[-2:]) < min(losses[:2]), losses


def test_pissa_convert_writes_a_lora_adapter_for_the_unmodified_base(run_config, tmp_path, tiny_model_dir):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    run_train(run_config(lora_rank=4, pissa_init=True, pissa_iter=-1, pissa_convert=True, max_steps=2, save_steps=10))
    out = tmp_path / "out"
    converted = json.loads((out / "pissa_converted" / "adapter_config.json").read_text())
    assert converted["r"] == 8 and converted["init_lora_weights"] is True
    tokens = torch.tensor([[1, 5, 9, 14, 3]])

    def logits(adapter):
        base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
        return PeftModel.from_pretrained(base, adapter).eval()(tokens).logits

    trained = logits(out)  # the PiSSA adapter: loading it takes the principal part out of the base again
    torch.testing.assert_close(logits(out / "pissa_converted"), trained, atol=1e-4, rtol=1e-4)
    assert not torch.allclose(logits(out / "pissa_init"), trained, atol=1e-4)  # training changed it
