"""LLaMA-Factory's optimizer keys on the Trainer tiletune builds: LoRA+ (peft), Muon (torch), GaLore and APOLLO
(transformers' Trainer; fake galore_torch / apollo_torch modules where the packages are absent), and the one
line a missing package gets."""

import importlib.machinery
import json
import sys
import types

import pytest
import torch
from click.testing import CliRunner

from tiletune.cli import main
from tiletune.config import build_config
from tiletune.data.processing import build_splits
from tiletune.data.templates import get_template
from tiletune.errors import UserError
from tiletune.train.model import load_model, load_tokenizer
from tiletune.train.optimizers import MuonWithAdamW
from tiletune.train.trainer import _make_trainer


@pytest.fixture
def trainer_for(tmp_path, tiny_model_dir):
    """The TuneTrainer `tiletune train` builds for the tiny Llama and these keys, before it trains."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "t.json").write_text(json.dumps([{"instruction": f"say {w}", "output": f"{w} {w}"} for w in "abcdefgh"]))
    (data / "dataset_info.json").write_text(json.dumps({"t": {"file_name": "t.json"}}))

    def make(**keys):
        cfg = build_config({"model_name_or_path": str(tiny_model_dir), "do_train": True, "dataset": "t",
                            "dataset_dir": str(data), "template": "llama3", "cutoff_len": 32, "learning_rate": 1e-3,
                            "output_dir": str(tmp_path / "out"), "report_to": "none", **keys})  # fmt: skip
        tokenizer = load_tokenizer(cfg)
        template = get_template(cfg.template, tokenizer, cfg.stage, cfg.default_system)
        template.fix_tokenizer(tokenizer)
        model = load_model(cfg, tokenizer, trainable=True)
        return _make_trainer(cfg, model, tokenizer, build_splits(cfg, tokenizer, template), cfg.output_dir)

    return make


def lrs_by_kind(optimizer, model) -> dict[str, set[float]]:
    """The learning rates of the groups holding LoRA's A and B matrices."""
    names = {id(p): n for n, p in model.named_parameters()}
    found: dict[str, set[float]] = {"lora_A": set(), "lora_B": set()}
    for group in optimizer.param_groups:
        for p in group["params"]:
            for kind, lrs in found.items():
                if kind in names[id(p)]:
                    lrs.add(group["lr"])
    return found


def test_loraplus_gives_the_b_matrices_lr_times_the_ratio(trainer_for):
    trainer = trainer_for(loraplus_lr_ratio=16.0)
    assert lrs_by_kind(trainer.create_optimizer(), trainer.model) == {"lora_A": {1e-3}, "lora_B": {16e-3}}
    plain = trainer_for()
    assert lrs_by_kind(plain.create_optimizer(), plain.model) == {"lora_A": {1e-3}, "lora_B": {1e-3}}


def test_muon_takes_the_hidden_matrices_and_adamw_the_rest(trainer_for):
    trainer = trainer_for(use_muon=True, finetuning_type="full", max_steps=3)
    optimizer = trainer.create_optimizer()
    assert isinstance(optimizer, MuonWithAdamW)
    muon, adamw = optimizer.parts
    names = {id(p): n for n, p in trainer.model.named_parameters()}
    in_muon = {names[id(p)] for group in muon.param_groups for p in group["params"]}
    in_adamw = {names[id(p)] for group in adamw.param_groups for p in group["params"]}
    assert isinstance(muon, torch.optim.Muon) and muon.param_groups[0]["adjust_lr_fn"] == "match_rms_adamw"
    assert "model.layers.0.self_attn.q_proj.weight" in in_muon and "model.layers.1.mlp.down_proj.weight" in in_muon
    assert {"model.embed_tokens.weight", "model.norm.weight"} <= in_adamw and not in_muon & in_adamw
    assert len(in_muon | in_adamw) == sum(1 for _ in trainer.model.parameters())

    scheduler = trainer.create_scheduler(3, optimizer)  # the Trainer's linear decay reaches both optimizers
    optimizer.step(), scheduler.step()
    assert muon.param_groups[0]["lr"] == adamw.param_groups[0]["lr"] < 1e-3
    before = trainer.model.model.layers[0].self_attn.q_proj.weight.detach().clone()
    trainer.train()
    assert not torch.equal(before, trainer.model.model.layers[0].self_attn.q_proj.weight)
    state = optimizer.state_dict()
    assert len(state["parts"]) == 2 and state["parts"][0]["state"]  # Muon's momentum buffers are saved
    optimizer.load_state_dict(state)


def fake_package(monkeypatch, module: str, classes: tuple[str, ...], available: str) -> dict[str, type]:
    """A module `module` whose optimizer classes are AdamW recording their param groups (the real package is absent);
    transformers' `available` check answers yes."""
    fake = types.ModuleType(module)
    fake.__spec__ = importlib.machinery.ModuleSpec(module, None)
    made = {name: type(name, (torch.optim.AdamW,), {}) for name in classes}
    for name, cls in made.items():
        setattr(fake, name, cls)
    monkeypatch.setitem(sys.modules, module, fake)
    monkeypatch.setattr(f"transformers.trainer_optimizer.{available}", lambda: True)
    return made


LINEAR_WEIGHTS = {f"model.layers.{i}.{m}.weight" for i in (0, 1) for m in
                  ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
                   "mlp.up_proj", "mlp.down_proj")}  # fmt: skip


@pytest.mark.parametrize("keys, module, classes, available, cls, projection", [
    ({"use_galore": True, "galore_rank": 4, "galore_scale": 0.5}, "galore_torch",
     ("GaLoreAdamW", "GaLoreAdamW8bit", "GaLoreAdafactor"), "is_galore_torch_available", "GaLoreAdamW",
     {"rank": 4, "update_proj_gap": 200, "scale": 0.5, "proj_type": "std"}),
    ({"use_apollo": True, "apollo_rank": 8, "apollo_proj": "svd", "apollo_scale_type": "tensor"}, "apollo_torch",
     ("APOLLOAdamW",), "is_apollo_torch_available", "APOLLOAdamW",
     {"rank": 8, "update_proj_gap": 200, "scale": 32.0, "proj": "svd", "proj_type": "std", "scale_type": "tensor"}),
])  # fmt: skip
def test_galore_and_apollo_run_the_trainers_optimizer_with_llamafactorys_sub_keys(
        trainer_for, monkeypatch, keys, module, classes, available, cls, projection):  # fmt: skip
    made = fake_package(monkeypatch, module, classes, available)
    trainer = trainer_for(finetuning_type="full", **keys)
    optimizer = trainer.create_optimizer()
    assert type(optimizer) is made[cls]
    names = {id(p): n for n, p in trainer.model.named_parameters()}
    projected = [g for g in optimizer.param_groups if "rank" in g]
    assert len(projected) == 1 and {k: projected[0][k] for k in projection} == projection
    assert {names[id(p)] for p in projected[0]["params"]} == LINEAR_WEIGHTS  # target all: every Linear but lm_head


def test_galore_layerwise_and_an_explicit_target(trainer_for, monkeypatch):
    from transformers.trainer_pt_utils import LayerWiseDummyOptimizer

    made = fake_package(monkeypatch, "galore_torch", ("GaLoreAdamW", "GaLoreAdamW8bit", "GaLoreAdafactor"),
                        "is_galore_torch_available")  # fmt: skip
    trainer = trainer_for(finetuning_type="full", use_galore=True, galore_layerwise=True, galore_target="q_proj,v_proj")
    optimizer = trainer.create_optimizer()
    assert isinstance(optimizer, LayerWiseDummyOptimizer)
    names = {id(p): n for n, p in trainer.model.named_parameters()}
    projected = {names[id(p)] for p, step in optimizer.optimizer_dict.items() if "rank" in step.param_groups[0]}
    assert projected == {f"model.layers.{i}.self_attn.{m}.weight" for i in (0, 1) for m in ("q_proj", "v_proj")}
    assert all(type(step) is made["GaLoreAdamW"] for step in optimizer.optimizer_dict.values())
    with pytest.raises(UserError, match="galore_target 'q_prj' is not a linear layer of this model; available: down_proj"):
        trainer_for(finetuning_type="full", use_galore=True, galore_target="q_prj")


def test_a_missing_optimizer_package_is_one_line_and_exit_2_before_anything_loads(tmp_path, tiny_model_dir):
    config = tmp_path / "c.yaml"
    config.write_text(f"model_name_or_path: {tiny_model_dir}\nfinetuning_type: full\nuse_galore: true\n")
    result = CliRunner().invoke(main, ["train", str(config)])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert result.stderr.strip().splitlines() == [(
        f"tiletune: error: {config}: use_galore needs galore-torch, which is not installed; pip install galore-torch "
        "(or remove use_galore)")]
