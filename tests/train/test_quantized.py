"""QLoRA on the CPU: a tiny model loads with its Linears quantized (4-bit NF4 / FP4, 8-bit), trains LoRA on the
reference path with the loss falling, never writes the base, and the kernel engine binds to the quantized layers."""

import json
from pathlib import Path

import pytest
import torch
from _grads import loss_and_grads
from test_trainer import run_config  # noqa: F401, F811 (the fixture, by name in each test)
from transformers import AutoModelForCausalLM

from tiletune.kernels.quant_linear import QuantLinear
from tiletune.numerics import errors
from tiletune.patch import apply_kernels
from tiletune.train.model import load_model, load_tokenizer
from tiletune.train.trainer import run_train


@pytest.mark.parametrize("keys, kind", [({"quantization_bit": 4}, "nf4"), ({"quantization_bit": 4, "quantization_type": "fp4",
                                                                             "double_quantization": False}, "fp4"),
                                        ({"quantization_bit": 8}, "int8")])
def test_load_quantizes_every_linear_but_the_head(run_config, tiny_model_dir, keys, kind):
    cfg = run_config(**keys)
    model = load_model(cfg, load_tokenizer(cfg), trainable=False)
    quantized = [name for name, module in model.named_modules() if isinstance(module, QuantLinear)]
    assert len(quantized) == 2 * 7 and all(model.get_submodule(n).kind == kind for n in quantized)
    assert not isinstance(model.lm_head, QuantLinear) and model.lm_head.weight.dtype == torch.float32
    stock = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    ids = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        error = errors(model(ids).logits, stock(ids).logits).rel_l2
    assert 0 < error < (0.05 if kind == "int8" else 0.3)  # quantization error, not a broken layer


@pytest.mark.parametrize("bits", [4, 8])
def test_qlora_trains_and_never_writes_the_base(run_config, tmp_path, bits):
    run_train(run_config(quantization_bit=bits, max_steps=8, learning_rate=5e-3))
    out = tmp_path / "out"
    log = [json.loads(line) for line in (out / "trainer_log.jsonl").read_text().splitlines()]
    assert log[-1]["loss"] < log[0]["loss"]
    assert (out / "adapter_model.safetensors").is_file() and not list(out.glob("model*.safetensors"))
    from safetensors import safe_open

    with safe_open(str(out / "adapter_model.safetensors"), "pt") as adapter:
        assert all("lora_" in key for key in adapter.keys())


def test_kernels_bind_the_quantized_layers_and_train_as_the_stock_path(run_config):
    """`kernels: all` on a QLoRA model: quant_lora_linear takes every LoRA Linear over a quantized base (14, LoRA
    on all linears), quant_linear none left; loss and adapter gradients equal the unpatched model's."""
    cfg = run_config(quantization_bit=4)
    model = load_model(cfg, load_tokenizer(cfg), trainable=True)  # peft LoRA on all linears, over QuantLinear
    ids = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(0))
    runs = []
    for spec in ("", "all"):
        report = apply_kernels(model, spec)
        runs.append(loss_and_grads(model, ids))
    ops = report.to_dict()["ops"]
    assert ops["quant_lora_linear"]["patched"] == 14 and ops["quant_linear"]["patched"] == 0
    assert ops["linear"]["patched"] == 0 and ops["lora_linear"]["patched"] == 0
    (stock_loss, stock_grads), (loss, grads) = runs
    assert set(grads) == set(stock_grads) and all("lora_" in n for n in grads)
    torch.testing.assert_close(loss, stock_loss, rtol=1e-6, atol=0)
    for name in grads:
        torch.testing.assert_close(grads[name], stock_grads[name], rtol=1e-5, atol=1e-7, msg=name)


def test_a_prequantized_checkpoint_is_refused_in_one_line(run_config, tiny_model_dir, tmp_path):
    from tiletune.errors import UserError

    folder = tmp_path / "gptq"
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    model.config.quantization_config = {"quant_method": "gptq", "bits": 4}
    model.save_pretrained(folder)
    load_tokenizer(run_config()).save_pretrained(folder)
    cfg = run_config(model_name_or_path=str(folder), quantization_bit=4)
    with pytest.raises(UserError, match="already quantized .gptq."):
        load_model(cfg, load_tokenizer(cfg), trainable=True)


def test_export_of_a_qlora_run_merges_into_the_dequantized_base(run_config, tmp_path):
    from tiletune.train.export import run_export

    run_train(run_config(quantization_bit=4, max_steps=2))
    target = run_export(run_config(quantization_bit=4, do_train=False, adapter_name_or_path=str(tmp_path / "out"),
                                   export_dir=str(tmp_path / "merged")))
    merged = AutoModelForCausalLM.from_pretrained(target)
    assert not any(isinstance(m, QuantLinear) for m in merged.modules())
    assert merged.model.layers[0].self_attn.q_proj.weight.dtype == merged.lm_head.weight.dtype


def test_chat_keeps_the_base_quantized_with_the_adapter_unmerged(run_config, tmp_path):
    from tiletune.train.chat import load_session, run_chat

    run_train(run_config(quantization_bit=4, max_steps=2))
    session, _ = load_session(run_config(quantization_bit=4, do_train=False, adapter_name_or_path=str(tmp_path / "out"),
                                         max_new_tokens=4))
    q_proj = session.model.get_base_model().model.layers[0].self_attn.q_proj
    assert isinstance(q_proj.base_layer, QuantLinear) and "default" in q_proj.lora_A and not q_proj.merged
    said = []
    run_chat(session, ["hello"], said.append)
    assert "Assistant: " in said and len("".join(said[said.index("Assistant: ") + 1 :])) > 0


VENDORED = Path(__file__).parent / "compat" / "examples"


@pytest.mark.parametrize("example", ["train_qlora/qwen3_lora_sft_otfq.yaml", "extras/fsdp_qlora/llama3_lora_sft.yaml"])
def test_llamafactory_qlora_examples_dry_run(example, compat_dir, tiny_model_dir, monkeypatch):
    from click.testing import CliRunner

    from tiletune.cli import main

    monkeypatch.chdir(compat_dir)  # their datasets (identity, alpaca_en_demo) are LLaMA-Factory's demo data
    result = CliRunner().invoke(main, ["train", str(VENDORED / example), f"model_name_or_path={tiny_model_dir}",
                                       "max_samples=20", "--dry-run"])
    assert result.exit_code == 0, result.output
    assert "dry run: config, model and data are valid" in result.output


def test_a_bitsandbytes_4bit_checkpoint_loads_as_saved(run_config, tiny_model_dir, tmp_path):
    """A "-bnb-4bit" folder (packed weights + quant states, as transformers saves them): its codes are used as
    they are, so the loaded layers dequantize to exactly what was saved; trains with LoRA."""
    from safetensors.torch import load_file, save_file

    from tiletune.quant import dequantize, quantize, to_bnb

    folder = tmp_path / "bnb-4bit"
    stock = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    stock.config.quantization_config = {"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "fp4"}
    stock.save_pretrained(folder)
    load_tokenizer(run_config()).save_pretrained(folder)
    tensors, saved = load_file(folder / "model.safetensors"), {}
    for name, module in stock.named_modules():
        if isinstance(module, torch.nn.Linear) and module is not stock.lm_head:
            saved[name] = quantize(tensors.pop(f"{name}.weight"), "fp4", double=True, dtype=torch.float32)
            tensors.update(to_bnb(saved[name], f"{name}.weight"))
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    cfg = run_config(model_name_or_path=str(folder))  # quantization_bit unset: the checkpoint says it
    model = load_model(cfg, load_tokenizer(cfg), trainable=True)
    for name, q in saved.items():
        layer = model.base_model.model.get_submodule(name).base_layer
        assert isinstance(layer, QuantLinear) and layer.kind == "fp4"
        assert torch.equal(dequantize(layer.quantized), dequantize(q))
    ids = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids).loss.backward()


def test_linear_biases_load_frozen_into_the_quantized_layers(tmp_path):
    """Qwen2's q/k/v projections carry biases: each lands in its QuantLinear, frozen, with the saved values."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from tiletune.train.quantized import load_quantized

    torch.manual_seed(0)
    stock = Qwen2ForCausalLM(Qwen2Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2))
    stock.save_pretrained(tmp_path / "qwen2")
    model = load_quantized(str(tmp_path / "qwen2"), stock.config, torch.float32, "nf4", True, torch.device("cpu"), {}, {})
    for name in ("q_proj", "k_proj", "v_proj"):
        layer = getattr(model.model.layers[0].self_attn, name)
        assert isinstance(layer, QuantLinear) and not layer.bias.requires_grad
        assert torch.equal(layer.bias, getattr(stock.model.layers[0].self_attn, name).bias)
