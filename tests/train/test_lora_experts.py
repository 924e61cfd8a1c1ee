"""`lora_target_experts`: LoRA on the MoE experts' fused 3-D weights (peft's target_parameters) of tiny random-init
Qwen3-MoE and Mixtral models: where the adapters go (the experts, never the router), gradients, the moe_experts op's
LoRA form against peft's own path, `tiletune train` + `tiletune export` (the expert adapters merged), and the
refusals: one line, exit code 2."""

import dataclasses
import json

import pytest
import torch
import transformers
from click.testing import CliRunner

from tiletune.cli import main
from tiletune.config import build_config
from tiletune.errors import UserError
from tiletune.patch import apply_kernels
from tiletune.train.export import run_export
from tiletune.train.model import load_model, load_tokenizer
from tiletune.train.trainer import run_train

MOE = {
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {"num_experts": 4, "moe_intermediate_size": 32}),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {"num_local_experts": 4}),
}
RECORDS = [{"instruction": f"say {w}", "input": "", "output": f"{w} {w}"} for w in "abcdefgh"]


def saved_moe(model_type: str, folder, tokenizer_dir, dtype=torch.float32):
    """A 2-layer random-init MoE model (4 experts, top-2) with the demo tokenizer, saved in `dtype`."""
    from transformers import AutoTokenizer

    config_class, model_class, extra = MOE[model_type]
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    tokenizer.save_pretrained(folder)
    config = getattr(transformers, config_class)(
        vocab_size=-(-len(tokenizer) // 64) * 64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256, num_experts_per_tok=2,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        **extra)  # fmt: skip
    torch.manual_seed(0)
    getattr(transformers, model_class)(config).to(dtype).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module", params=list(MOE))
def moe_dir(request, tmp_path_factory, tokenizer_dir):
    return saved_moe(request.param, tmp_path_factory.mktemp(request.param), tokenizer_dir)


def loaded(model_dir, **keys):
    cfg = build_config({"model_name_or_path": str(model_dir), "finetuning_type": "lora", "lora_target": "all",
                        "lora_rank": 4, "lora_target_experts": True, **keys})
    return load_model(cfg, load_tokenizer(cfg), trainable=True)


def perturb_adapters(model, seed=0):
    """Non-zero lora_B everywhere (peft initialises B to zero: A would get no gradient)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.05)


def test_lora_goes_on_the_expert_weights_and_never_on_the_router(moe_dir):
    model = loaded(moe_dir)
    trainable = [name for name, param in model.named_parameters() if param.requires_grad]
    for layer in range(2):
        expert_adapters = [n for n in trainable if f"layers.{layer}.mlp.experts." in n]
        # one ParamWrapper per expert weight (gate_up_proj, down_proj), nested: lora_A and lora_B each
        assert len(expert_adapters) == 4 and all(".lora_A." in n or ".lora_B." in n for n in expert_adapters)
    assert not [n for n in trainable if ".mlp.gate." in n]  # the router
    assert not [n for n, p in model.named_parameters() if p.requires_grad and "lora" not in n]
    assert sorted(model.peft_config["default"].target_parameters) == ["mlp.experts.down_proj", "mlp.experts.gate_up_proj"]
    experts = model.get_base_model().model.layers[0].mlp.experts
    assert experts.lora_A["default"].weight.dtype == torch.float32  # trainable weights in float32


def test_expert_adapters_take_gradients_and_the_op_matches_peft(moe_dir):
    """Kernels off (peft folds W + s·B·A into the weights each forward) and on (moe_experts' LoRA form, no merged
    weight): the same loss and the same gradients of every adapter, the experts' included; the report says the experts
    took the op, no call fell back."""
    model = loaded(moe_dir)
    perturb_adapters(model)
    ids = torch.randint(0, 100, (2, 13), generator=torch.Generator().manual_seed(1))
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    params = [p for p in model.parameters() if p.requires_grad]
    stock = model(input_ids=ids, labels=ids).loss
    stock_grads = dict(zip(names, torch.autograd.grad(stock, params)))
    assert all(stock_grads[n].abs().sum() > 0 for n in names if ".mlp.experts." in n)  # A and B of both weights
    report = apply_kernels(model, {"moe_experts": "reference"})
    try:
        entries = [e for e in report.entries if e.op == "moe_experts"]
        assert [(e.layer, e.module, e.installed, e.fallback) for e in entries] == [
            (0, "mlp.experts", True, None), (1, "mlp.experts", True, None)]
        loss = model(input_ids=ids, labels=ids).loss
        grads = dict(zip(names, torch.autograd.grad(loss, params)))
        assert report.runtime_fallbacks() == []
    finally:
        report.revert()
    assert float(loss) == pytest.approx(float(stock), rel=1e-5)
    for name in names:
        torch.testing.assert_close(grads[name], stock_grads[name], rtol=1e-4, atol=1e-6, msg=name)


def test_the_key_is_refused_where_it_would_change_nothing(tiny_model_dir, moe_dir, monkeypatch):
    with pytest.raises(UserError, match="lora_target_experts=true: llama has no MoE experts"):
        loaded(tiny_model_dir)
    with pytest.raises(UserError, match="lora_target_experts is read only with finetuning_type=lora"):
        build_config({"model_name_or_path": "m", "finetuning_type": "full", "lora_target_experts": True})
    for key, value in (("lora_dropout", 0.05), ("use_dora", True), ("pissa_init", True)):
        with pytest.raises(UserError, match=f"lora_target_experts with {key}={value}: .* takes no {key}"):
            build_config({"model_name_or_path": "m", "lora_target_experts": True, key: value})
    import peft

    old = dataclasses.make_dataclass("LoraConfig", [("target_modules", list, dataclasses.field(default=None))])
    monkeypatch.setattr(peft, "LoraConfig", old)
    with pytest.raises(UserError, match=r"lora_target_experts needs peft >= 0.17"):
        build_config({"model_name_or_path": "m", "lora_target_experts": True})


def test_refusal_is_one_line_and_exit_2(tmp_path, tiny_model_dir):
    data = tmp_path / "data"
    data.mkdir()
    (data / "t.json").write_text(json.dumps(RECORDS))
    (data / "dataset_info.json").write_text(json.dumps({"t": {"file_name": "t.json"}}))
    config = tmp_path / "c.json"
    config.write_text(json.dumps({"model_name_or_path": str(tiny_model_dir), "do_train": True, "dataset": "t",
                                  "dataset_dir": str(data), "template": "llama3", "output_dir": str(tmp_path / "out"),
                                  "max_steps": 1, "lora_target_experts": True}))  # fmt: skip
    result = CliRunner().invoke(main, ["train", str(config)])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines[-1].startswith("tiletune: error: ") and "llama has no MoE experts" in lines[-1]
    assert "Traceback" not in result.output


def test_continuing_an_adapter_without_expert_lora_is_refused(tmp_path, moe_dir):
    plain = loaded(moe_dir, lora_target_experts=False)
    plain.save_pretrained(tmp_path / "adapter")
    with pytest.raises(UserError, match="has no LoRA on the expert weights; set create_new_adapter=true"):
        loaded(moe_dir, adapter_name_or_path=str(tmp_path / "adapter"))
    model = loaded(moe_dir, adapter_name_or_path=str(tmp_path / "adapter"), create_new_adapter=True)
    assert model.peft_config["default"].target_parameters


def test_train_then_export_merges_the_expert_adapters(tmp_path, tokenizer_dir):
    """`tiletune train` with the key and the op, then `tiletune export` of a bf16 base: the exported experts are the
    merged W + s·B·A in bf16, and (exported in float32) the merged model computes what the adapted model does."""
    model_dir = saved_moe("qwen3_moe", tmp_path / "model", tokenizer_dir, dtype=torch.bfloat16)
    data = tmp_path / "data"
    data.mkdir()
    (data / "t.json").write_text(json.dumps(RECORDS))
    (data / "dataset_info.json").write_text(json.dumps({"t": {"file_name": "t.json"}}))
    keys = {"model_name_or_path": str(model_dir), "stage": "sft", "do_train": True, "finetuning_type": "lora",
            "lora_target": "all", "lora_target_experts": True, "lora_rank": 4, "dataset": "t", "dataset_dir": str(data),
            "template": "qwen3", "cutoff_len": 32, "per_device_train_batch_size": 4, "learning_rate": 5e-2,
            "max_steps": 2, "logging_steps": 1, "report_to": "none", "output_dir": str(tmp_path / "out"),
            "kernels": {"moe_experts": "reference"}}  # fmt: skip
    run_train(build_config(keys))
    patched = json.loads((tmp_path / "out" / "kernels.json").read_text())
    assert patched["ops"]["moe_experts"]["patched"] == 2 and patched["ops"]["moe_experts"]["fallback"] is None
    assert patched["runtime_fallbacks"] == []
    adapter = json.loads((tmp_path / "out" / "adapter_config.json").read_text())
    assert sorted(adapter["target_parameters"]) == ["mlp.experts.down_proj", "mlp.experts.gate_up_proj"]

    inference = {key: value for key, value in keys.items() if key not in ("kernels", "do_train")}
    inference["adapter_name_or_path"] = str(tmp_path / "out")
    exported = run_export(build_config({**inference, "export_dir": str(tmp_path / "merged")}))
    merged = transformers.AutoModelForCausalLM.from_pretrained(exported)
    assert merged.dtype == torch.bfloat16
    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    from peft import PeftModel

    adapted = PeftModel.from_pretrained(base, str(tmp_path / "out"))
    wrapper = adapted.get_base_model().model.layers[0].mlp.experts  # down_proj's ParamWrapper around gate_up_proj's
    want = {w.parameter_name: (getattr(w.get_base_layer(), w.parameter_name) + w.get_delta_weight("default")).detach()
            for w in (wrapper, wrapper.base_layer)}
    for name, weight in want.items():
        got = getattr(merged.model.layers[0].mlp.experts, name)
        torch.testing.assert_close(got, weight.to(torch.bfloat16))
        assert not torch.equal(got, getattr(wrapper.get_base_layer(), name).to(torch.bfloat16))  # trained: not the base

    exported32 = run_export(build_config({**inference, "export_dir": str(tmp_path / "merged32"), "infer_dtype": "float32"}))
    merged32 = transformers.AutoModelForCausalLM.from_pretrained(exported32)
    ids = torch.randint(0, 100, (2, 11), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(merged32(ids).logits, adapted(input_ids=ids).logits, rtol=1e-5, atol=1e-5)
        with adapted.disable_adapter():
            assert not torch.allclose(merged32(ids).logits, adapted(input_ids=ids).logits, rtol=1e-4, atol=1e-4)
