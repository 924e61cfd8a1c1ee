"""The config: every LLaMA-Factory example key accepted, clear errors for everything else."""

import dataclasses
import importlib.util

import pytest
import yaml

from tiletune.config import TuneConfig, build_config, load_config
from tiletune.errors import UserError

OWN_KEYS = {f.name for f in dataclasses.fields(TuneConfig)} - {"training"}
BASE = {"model_name_or_path": "m", "dataset": "d", "do_train": True}


def example_configs(compat_root):
    return sorted((compat_root / "examples").glob("train_*/*.yaml"))


def test_every_key_of_every_example_is_accepted(compat_dir):
    configs = example_configs(compat_dir)
    assert len(configs) >= 7
    for path in configs:
        raw = yaml.safe_load(path.read_text())
        cfg = load_config(path)
        for key, value in raw.items():
            honoured = getattr(cfg, key) if key in OWN_KEYS else cfg.training[key]
            assert honoured == value or (value is None and honoured is None), (path.name, key)


def test_trainer_keys_are_typed_and_kept():
    cfg = build_config({**BASE, "learning_rate": "1e-4", "num_train_epochs": 3, "bf16": "true", "report_to": "none"})
    assert cfg.training["learning_rate"] == pytest.approx(1e-4)
    assert cfg.training["num_train_epochs"] == 3.0 and cfg.training["bf16"] is True


def test_overrides_parse_values_as_yaml(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(BASE))
    cfg = load_config(path, ["lora_rank=16", "learning_rate=1.0e-5", "template=qwen3", "val_size=0.1"])
    assert cfg.lora_rank == 16 and cfg.template == "qwen3" and cfg.val_size == 0.1
    assert cfg.training["learning_rate"] == pytest.approx(1e-5)


def test_unknown_key_names_the_closest_valid_key():
    with pytest.raises(UserError, match=r"unknown key 'learnig_rate'.*did you mean 'learning_rate'"):
        build_config({**BASE, "learnig_rate": 1e-4})


@pytest.mark.parametrize(
    "key, value, allowed",
    [
        ("lora_rank", "eight", "int"),
        ("finetuning_type", "qlora", "'lora', 'full', 'freeze'"),
        ("lr_scheduler_type", "cosinus", "'cosine'"),
        ("bf16", "maybe", "bool"),
    ],
)
def test_wrong_value_names_key_value_and_what_is_allowed(key, value, allowed):
    with pytest.raises(UserError) as err:
        build_config({**BASE, key: value})
    assert key in str(err.value) and repr(value) in str(err.value) and allowed in str(err.value)


@pytest.mark.parametrize("stage", ["rm", "ppo", "dpo", "kto"])
def test_other_stages_are_not_supported_yet(stage):
    with pytest.raises(UserError, match="not supported yet"):
        build_config({**BASE, "stage": stage})


def test_llamafactory_options_not_implemented_pass_at_default_and_fail_otherwise():
    build_config({**BASE, "quantization_device_map": None, "use_unsloth": False})
    with pytest.raises(UserError, match="quantization_device_map='auto' is a LLaMA-Factory option tiletune does not support yet"):
        build_config({**BASE, "quantization_device_map": "auto"})


def test_quantization_keys():
    cfg = build_config({**BASE, "quantization_bit": 4, "quantization_type": "fp4", "double_quantization": False})
    assert (cfg.quantization_bit, cfg.quantization_type, cfg.double_quantization) == (4, "fp4", False)
    assert build_config({**BASE, "quantization_bit": 8}).quantization_bit == 8


@pytest.mark.parametrize("values, message", [
    ({"quantization_bit": 3}, "quantization_bit=3 is not supported; use 4 .nf4 or fp4. or 8"),
    ({"quantization_bit": 4, "quantization_method": "hqq"}, "quantization_method='hqq' is not supported"),
    ({"quantization_bit": 4, "finetuning_type": "full"}, "quantized base weights are frozen and train through LoRA"),
    ({"quantization_bit": 4, "quantization_type": "int4"}, "quantization_type"),
])  # fmt: skip
def test_quantization_mistakes_get_one_line(values, message):
    with pytest.raises(UserError, match=message):
        build_config({**BASE, **values})


@pytest.mark.parametrize("key, value", [("cutoff_len", 0), ("cutoff_len", -5), ("lora_dropout", 1.5), ("val_size", -0.1)])
def test_out_of_range_values(key, value):
    with pytest.raises(UserError, match=key):
        build_config({**BASE, key: value})


def test_malformed_yaml_reports_file_and_line(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("model_name_or_path: m\ndataset: [a, b\nstage: sft\n")
    with pytest.raises(UserError, match=r"bad\.yaml:\d+: malformed YAML"):
        load_config(path)


def test_malformed_json_config_reports_line(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('{\n  "model_name_or_path": "m",\n  "dataset": \n}\n')
    with pytest.raises(UserError, match=r"bad\.json:4: malformed JSON"):
        load_config(path)


def test_missing_config_file(tmp_path):
    with pytest.raises(UserError, match="not found"):
        load_config(tmp_path / "nope.yaml")



def packages(monkeypatch, missing=(), present=()):
    """importlib.util.find_spec as if the modules `missing` were not installed and `present` were."""
    found = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *args: (
        None if name in missing else found("pytest") if name in present else found(name, *args)))


@pytest.mark.parametrize("key, value, missing, message", [
    ("flash_attn", "fa2", ["flash_attn"], "flash_attn=fa2 needs flash-attn, which is not installed; pip install flash-attn"),
    ("report_to", "tensorboard", ["tensorboard", "tensorboardX"],
     "report_to=tensorboard needs tensorboard, which is not installed; pip install tensorboard"),
    ("report_to", ["none", "wandb"], ["wandb"], "report_to=wandb needs wandb, which is not installed; pip install wandb"),
    ("optim", "adamw_8bit", ["bitsandbytes"], "optim=adamw_8bit needs bitsandbytes, which is not installed; pip install bitsandbytes"),
    ("optim", "paged_lion_32bit", ["bitsandbytes"], "optim=paged_lion_32bit needs bitsandbytes"),
])  # fmt: skip
def test_a_value_whose_package_is_missing_names_key_package_and_install_line(monkeypatch, key, value, missing, message):
    packages(monkeypatch, missing=missing)
    with pytest.raises(UserError, match=message):
        build_config({**BASE, key: value})


def test_a_value_whose_package_is_installed_passes(monkeypatch):
    packages(monkeypatch, missing=["tensorboard"], present=["tensorboardX"])  # either provides the tensorboard logger
    assert build_config({**BASE, "report_to": "tensorboard"}).training["report_to"] == "tensorboard"
