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


@pytest.mark.parametrize("stage", ["ppo"])
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
    ("use_galore", True, ["galore_torch"], (r"use_galore needs galore-torch, which is not installed; pip install "
                                            r"galore-torch \(or remove use_galore\)")),
    ("use_apollo", True, ["apollo_torch"], "use_apollo needs apollo-torch, which is not installed; pip install apollo-torch"),
    ("use_muon", True, ["torch.optim._muon"], r"use_muon needs torch >= 2.9 \(torch.optim.Muon\), which is not installed"),
])  # fmt: skip
def test_a_value_whose_package_is_missing_names_key_package_and_install_line(monkeypatch, key, value, missing, message):
    packages(monkeypatch, missing=missing)
    with pytest.raises(UserError, match=message):
        build_config({**BASE, "finetuning_type": "full", key: value})


def test_a_value_whose_package_is_installed_passes(monkeypatch):
    packages(monkeypatch, missing=["tensorboard"], present=["tensorboardX"])  # either provides the tensorboard logger
    assert build_config({**BASE, "report_to": "tensorboard"}).training["report_to"] == "tensorboard"


@pytest.mark.parametrize("raw, expected, note", [
    ({"enable_liger_kernel": True}, {"kernels": "all"}, ("enable_liger_kernel=true read as kernels='all': tiletune's "
                                                         "TileLang kernels in place of Liger-Kernel's")),
    ({"enable_liger_kernel": True, "kernels": "rms_norm"}, {"kernels": "rms_norm"},
     "enable_liger_kernel=true is not applied: kernels='rms_norm' set and wins"),
    ({"use_unsloth_gc": "true"}, {"checkpointing": "auto", "gradient_checkpointing_offload": True},
     ("use_unsloth_gc=true read as gradient_checkpointing='auto', gradient_checkpointing_offload=True: tiletune's "
      "offloaded checkpointing")),
    ({"use_unsloth_gc": True, "gradient_checkpointing": "auto"}, {"checkpointing": "auto", "gradient_checkpointing_offload": True},
     "use_unsloth_gc=true read as"),
    ({"use_unsloth_gc": True, "disable_gradient_checkpointing": True}, {"checkpointing": "off", "gradient_checkpointing_offload": False},
     "use_unsloth_gc=true is not applied: disable_gradient_checkpointing=True set and wins"),
    ({"enable_liger_kernel": False, "use_unsloth_gc": False}, {"kernels": None, "checkpointing": "on"}, None),
])  # fmt: skip
def test_llamafactory_switches_read_as_tiletunes_own_keys_with_a_note(caplog, raw, expected, note):
    with caplog.at_level("WARNING", logger="tiletune"):
        cfg = build_config({**BASE, **raw}, source="c.yaml")
    assert {key: getattr(cfg, key) for key in expected} == expected
    notes = [r.getMessage() for r in caplog.records]
    assert notes == [] if note is None else len(notes) == 1 and notes[0].startswith(f"c.yaml: {note}"), notes


@pytest.mark.parametrize("key, why", [
    ("streaming", "datasets' streaming hands over an iterable dataset"),
    ("use_badam", "BAdam needs its own Trainer wiring"),
])  # fmt: skip
def test_keys_still_refused_say_why_and_what_to_use(key, why):
    with pytest.raises(UserError, match=f"{key}=True is a LLaMA-Factory option tiletune does not support yet \\({why}"):
        build_config({**BASE, key: True})


def test_method_and_optimizer_keys_are_typed_and_kept():
    cfg = build_config({**BASE, "rope_scaling": "yarn", "loraplus_lr_ratio": "16", "pissa_init": True, "pissa_iter": -1})
    assert (cfg.rope_scaling, cfg.loraplus_lr_ratio, cfg.pissa_init, cfg.pissa_iter) == ("yarn", 16.0, True, -1)
    cfg = build_config({**BASE, "finetuning_type": "oft", "oft_rank": 4, "oft_block_size": 0, "module_dropout": 0.1})
    assert (cfg.finetuning_type, cfg.oft_rank, cfg.oft_block_size, cfg.module_dropout) == ("oft", 4, 0, 0.1)
    with pytest.raises(UserError, match="rope_scaling='ntk' is not valid; allowed: one of 'linear', 'dynamic'"):
        build_config({**BASE, "rope_scaling": "ntk"})


@pytest.mark.parametrize("raw, message", [
    ({"galore_rank": 4}, "galore_rank is read only with use_galore=true; set that too, or remove galore_rank"),
    ({"apollo_proj": "svd"}, "apollo_proj is read only with use_apollo=true"),
    ({"pissa_convert": True}, "pissa_convert is read only with pissa_init=true"),
    ({"loraplus_lr_embedding": 1e-5}, "loraplus_lr_embedding is read only with loraplus_lr_ratio"),
    ({"oft_rank": 4}, "oft_rank is read only with finetuning_type=oft"),
    ({"finetuning_type": "full", "loraplus_lr_ratio": 16}, "loraplus_lr_ratio is read only with finetuning_type=lora"),
    ({"finetuning_type": "freeze", "pissa_init": True}, "pissa_init is read only with finetuning_type=lora"),
    ({"use_muon": True, "loraplus_lr_ratio": 16}, "use_muon and loraplus_lr_ratio each choose the optimizer; keep one"),
    ({"use_galore": True}, "use_galore projects the gradients of whole weight matrices, not of adapters"),
    ({"use_apollo": True, "finetuning_type": "full", "optim": "sgd"},
     "use_apollo has no variant of optim=sgd; set optim to one of adamw_torch, adamw_torch_fused"),
    ({"use_galore": True, "finetuning_type": "full", "galore_layerwise": True, "gradient_accumulation_steps": 4},
     "galore_layerwise steps each weight as its gradient arrives; set gradient_accumulation_steps=1"),
    ({"finetuning_type": "oft", "oft_rank": 4}, "OFT takes either oft_rank .* or oft_block_size, the other 0"),
    ({"pissa_init": True, "quantization_bit": 4}, "pissa_init moves each weight's principal part into the adapter"),
])  # fmt: skip
def test_method_keys_that_would_change_nothing_or_cannot_go_together_are_refused(raw, message):
    with pytest.raises(UserError, match=message):
        build_config({**BASE, **raw})
