"""The `unsloth` bench variant: what it refuses, that its worker imports Unsloth before transformers and peft, and
the whole variant on the CPU with a stand-in for Unsloth (its FastLanguageModel on transformers + peft) that
records the arguments it was given. Unsloth itself needs a GPU: benchmarks/h200_verify_bench.sh's `peers` part
runs it there."""

import importlib.util
import json
import subprocess
import sys

import pytest
from click.testing import CliRunner

from tiletune.bench.unsloth import unsupported
from tiletune.cli import main
from tiletune.config import build_config

LORA = {"model_name_or_path": "x", "finetuning_type": "lora", "lora_target": "q_proj,v_proj"}


@pytest.mark.parametrize(("extra", "key"), [
    ({"gradient_checkpointing": "auto"}, "gradient_checkpointing"),
    ({"quantization_bit": 8}, "quantization_bit"),
    ({"use_dora": True}, "use_dora"),
    ({"finetuning_type": "full"}, "finetuning_type"),
    ({"stage": "dpo"}, "stage"),
])
def test_settings_unsloth_cannot_honour_are_refused_by_name(extra, key):
    why = unsupported(build_config({**LORA, **extra}))
    assert why is not None and why.startswith(f"bench variant 'unsloth': {key}=")


def test_plain_and_4bit_lora_are_accepted():
    assert unsupported(build_config(LORA)) is None
    assert unsupported(build_config({**LORA, "quantization_bit": 4, "gradient_checkpointing": False})) is None


def test_the_worker_module_imports_neither_transformers_nor_peft():
    """So its main can import Unsloth first, as Unsloth requires."""
    code = "import sys, tiletune.bench.worker; print(sorted({'transformers', 'peft'} & set(sys.modules)))"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "[]"


@pytest.mark.skipif(importlib.util.find_spec("unsloth") is not None, reason="Unsloth is installed: the refusal is moot")
def test_a_missing_unsloth_is_one_clear_line(tmp_path):
    config = tmp_path / "b.yaml"
    config.write_text("model_name_or_path: unused\n")
    result = CliRunner().invoke(main, ["bench", str(config), "--variants", "baseline,unsloth", "--out", str(tmp_path / "o")])
    assert result.exit_code == 2 and "bench variant 'unsloth' needs Unsloth; pip install unsloth" in result.output


STAND_IN = '''
import json, os, sys
if {"transformers", "peft"} & set(sys.modules):
    raise RuntimeError("Unsloth must be imported before transformers and peft")
LOG = os.environ["STAND_IN_LOG"]


class FastLanguageModel:
    @staticmethod
    def from_pretrained(model_name, **kwargs):
        from transformers import AutoModelForCausalLM
        with open(LOG, "a") as log:
            log.write(json.dumps({"from_pretrained": {k: str(v) for k, v in kwargs.items()},
                                  "files": sorted(os.listdir(model_name))}) + "\\n")
        return AutoModelForCausalLM.from_pretrained(model_name, dtype=kwargs["dtype"]), None

    @staticmethod
    def get_peft_model(model, r, lora_alpha, lora_dropout, target_modules, bias, use_rslora,
                       use_gradient_checkpointing, random_state):
        from peft import LoraConfig, get_peft_model
        with open(LOG, "a") as log:
            log.write(json.dumps({"get_peft_model": {"r": r, "lora_alpha": lora_alpha, "target_modules": target_modules,
                                                     "use_gradient_checkpointing": use_gradient_checkpointing}}) + "\\n")
        return get_peft_model(model, LoraConfig(r=r, lora_alpha=lora_alpha, lora_dropout=lora_dropout,
                                                target_modules=target_modules, task_type="CAUSAL_LM"))
'''


def test_the_variant_trains_the_presets_seeded_model_through_unsloths_api(tmp_path, monkeypatch):
    """A stand-in `unsloth` package on the worker's path: the variant saves the tiny preset (the baseline's weights:
    the same first loss), loads it through FastLanguageModel with the config's LoRA and Unsloth's own checkpointing,
    and times it like any other variant."""
    package = tmp_path / "site" / "unsloth"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(STAND_IN)
    log = tmp_path / "calls.jsonl"
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path / 'site'}")
    monkeypatch.setenv("STAND_IN_LOG", str(log))
    monkeypatch.syspath_prepend(str(tmp_path / "site"))  # find_spec in the runner's check sees it too
    config = tmp_path / "b.yaml"
    config.write_text("model_name_or_path: unused\nfinetuning_type: lora\nlora_target: q_proj,v_proj\nlora_rank: 4\n")
    out = tmp_path / "bench"
    result = CliRunner().invoke(main, ["bench", str(config), "--model-preset", "tiny", "--variants", "baseline,unsloth",
                                       "--batch", "2", "--seq", "32", "--steps", "2", "--warmup", "1", "--repeats", "1",
                                       "--out", str(out)])
    assert result.exit_code == 0, result.output
    loaded, adapted = [json.loads(line) for line in log.read_text().splitlines()]
    assert loaded["from_pretrained"]["load_in_16bit"] == "True" and loaded["from_pretrained"]["load_in_4bit"] == "False"
    assert loaded["from_pretrained"]["use_gradient_checkpointing"] == "unsloth"
    assert loaded["from_pretrained"]["max_seq_length"] == "32"
    assert "config.json" in loaded["files"] and "tokenizer.json" in loaded["files"]
    assert adapted["get_peft_model"] == {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"],
                                         "use_gradient_checkpointing": "unsloth"}
    runs = {run["variant"]: run for run in map(json.loads, (out / "runs.jsonl").read_text().splitlines())}
    assert runs["unsloth"]["losses"][0] == pytest.approx(runs["baseline"]["losses"][0], rel=1e-5)
