"""`tiletune verify` on the CPU with the demo model: the gate passes a correct kernel and fails a wrong one,
every kernel passes on tiny random-init Llama and Qwen3 models, golden files round-trip and refuse another
model, and the convergence check runs."""

import json
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from tiletune.cli import main

REPO = Path(__file__).resolve().parents[2]
PLUGIN = '''
from tiletune.kernels import register
from tiletune.kernels.rms_norm import reference_forward


@register("rms_norm", "{name}")
def rms_norm(x, weight, eps, offset):
    return reference_forward(x, weight, {eps}, offset) * {scale}
'''


@pytest.fixture(autouse=True)
def registry_restored():
    """Plugins register implementations process-wide: drop them after each test."""
    from tiletune.kernels import registry

    registry.load_ops()
    before = {op: dict(impls) for op, impls in registry._impls.items()}
    yield
    registry._impls.update(before)


# every op's PyTorch reference: what can be verified on a CPU (the TileLang kernels cannot run there)
REFERENCES = "kernels=all=reference"


def verify(tmp_path, *args, kernels=REFERENCES, model=REPO / "examples" / "tiny-llama"):
    base = [str(REPO / "examples" / "demo.yaml"), kernels, f"model_name_or_path={model}",
            f"dataset_dir={REPO / 'examples' / 'data'}", f"output_dir={tmp_path / 'run'}"]  # fmt: skip
    return CliRunner().invoke(main, ["verify", *base, *args])


def plugin(tmp_path, monkeypatch, name: str, scale: float, eps: str = "eps"):
    (tmp_path / f"{name}.py").write_text(PLUGIN.format(name=name, scale=scale, eps=eps))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, name, raising=False)
    return f"kernels={{rms_norm: {name}, plugins: [{name}]}}"


def test_correct_plugin_kernel_passes(tmp_path, monkeypatch):
    result = verify(tmp_path, "--out", str(tmp_path / "v"), kernels=plugin(tmp_path, monkeypatch, "exact_norm", 1.0))
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "v" / "verify.json").read_text())
    assert report["passed"] and len(report["tensors"]) > 100
    assert report["accumulation"] == ["rms_norm: exact_norm computes in unknown, the stock implementation in float32"]
    assert (tmp_path / "v" / "verify.png").stat().st_size > 1000


@pytest.mark.parametrize("model_dir", ["tiny_model_dir", "tiny_qwen3_dir"])
def test_every_kernel_passes_on_tiny_random_init_models(tmp_path, request, model_dir):
    """float32 on the CPU: the losses are judged against the float64 one, where stock and patched are each a rounding
    step or two off; the ulp floor keeps a scalar that stock happens to hit closely from failing on luck."""
    result = verify(tmp_path, "--out", str(tmp_path / "v"), model=request.getfixturevalue(model_dir))
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "v" / "verify.json").read_text())
    assert report["passed"] and report["floor_ulps"] == 2 and report["patch"]["ops"]["rms_norm"]["patched"] > 0


@pytest.mark.parametrize("scale, eps", [(1.01, "eps"), (1.0, "1e-2")])
def test_wrong_plugin_kernel_fails_and_names_the_layers(tmp_path, monkeypatch, scale, eps):
    kernels = plugin(tmp_path, monkeypatch, f"bad_norm_{str(scale).replace('.', '')}_{eps.replace('-', '')}", scale, eps)
    result = verify(tmp_path, "--out", str(tmp_path / "v"), kernels=kernels)
    assert result.exit_code == 1, result.output
    assert "FAIL" in result.output and "layers.0.input_layernorm.output" in result.output
    report = json.loads((tmp_path / "v" / "verify.json").read_text())
    failed = [t["name"] for t in report["tensors"] if not t["passed"]]
    assert any("layers.3." in name for name in failed)


def test_golden_file_round_trip_and_refusal(tmp_path):
    golden = tmp_path / "golden.safetensors"
    made = verify(tmp_path, "--out", str(tmp_path / "a"), "--save-golden", str(golden), "--steps", "3")
    assert made.exit_code == 0, made.output
    assert golden.is_file()
    assert "convergence over 3 steps" in made.output
    again = verify(tmp_path, "--out", str(tmp_path / "b"), "--against", str(golden))
    assert again.exit_code == 0, again.output
    assert "tensors match the golden file" in again.output
    other = verify(tmp_path, "lora_rank=4", "--out", str(tmp_path / "c"), "--against", str(golden))
    assert other.exit_code == 2 and "made from a different model or config" in other.output


def test_a_wrong_kernel_fails_against_a_golden_file(tmp_path, monkeypatch):
    golden = tmp_path / "golden.safetensors"
    assert verify(tmp_path, "--out", str(tmp_path / "a"), "--save-golden", str(golden)).exit_code == 0
    wrong = plugin(tmp_path, monkeypatch, "golden_bad_norm", 1.01)
    result = verify(tmp_path, "--out", str(tmp_path / "b"), "--against", str(golden), kernels=wrong)
    assert result.exit_code == 1, result.output
    rows = json.loads((tmp_path / "b" / "verify.json").read_text())["golden"]["tensors"]
    assert not rows[0]["passed"] and rows[0]["rel_l2"] > rows[0]["tolerance"]


def test_golden_tolerance_follows_the_stock_runs_own_error():
    import torch

    from tiletune.verify.run import golden_tolerances

    meta = {"stock_error": {"noisy": 0.03, "exact": 0.0}}
    allowed = golden_tolerances(["noisy", "exact", "older file"], meta, torch.bfloat16, k=2, fixed=None)
    assert allowed == {"noisy": pytest.approx(0.09), "exact": 2e-2, "older file": 2e-2}
    assert golden_tolerances(["noisy"], meta, torch.bfloat16, k=2, fixed=0.5) == {"noisy": 0.5}


def test_verify_without_kernels_is_refused(tmp_path):
    result = verify(tmp_path, "--out", str(tmp_path / "v"), kernels="kernels=none")
    assert result.exit_code == 2 and "set a kernels: block" in result.output


def test_random_init_preset_with_fewer_layers(tmp_path):
    config = REPO / "examples" / "bench" / "llama3_8b_lora.yaml"
    args = ["verify", str(config), REFERENCES, "bf16=false", f"output_dir={tmp_path}", "--model-preset", "tiny",
            "--layers", "1", "--seq", "32", "--out", str(tmp_path / "v")]  # fmt: skip
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    names = [t["name"] for t in json.loads((tmp_path / "v" / "verify.json").read_text())["tensors"]]
    assert any("layers.0.mlp.output" in n for n in names) and not any("layers.1." in n for n in names)


@pytest.mark.parametrize("bits, kind", [(4, "nf4"), (8, "int8")])
def test_quantized_preset_is_gated_and_reports_each_layers_quantization_error(tmp_path, bits, kind):
    """quantization_bit on a preset builds it quantized: the quantized ops are bound and gated, and each quantized
    Linear's error against the weight it was quantized from is reported apart from the gate."""
    config = REPO / "examples" / "bench" / "llama3_8b_lora.yaml"
    args = ["verify", str(config), REFERENCES, "bf16=false", f"quantization_bit={bits}", f"output_dir={tmp_path}",
            "--model-preset", "tiny", "--layers", "1", "--seq", "32", "--out", str(tmp_path / "v")]  # fmt: skip
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    saved = json.loads((tmp_path / "v" / "verify.json").read_text())
    ops = saved["patch"]["ops"]
    assert ops["quant_lora_linear"]["patched"] == 2 and ops["quant_linear"]["patched"] == 5  # LoRA on q, v
    errs = {row["layer"]: row["rel_l2"] for row in saved["quantization"] if row["kind"] == kind}
    assert len(errs) == 7 and all(0 < e < (0.02 if bits == 8 else 0.2) for e in errs.values()), errs
    assert "quantization error of the 7 quantized layers" in result.output and "verify: PASS" in result.output


def test_verify_with_attention_selected(tmp_path):
    """attention (opt-in) under verify: its modules are captured and gated (its reference, which runs on a CPU)."""
    config = REPO / "examples" / "bench" / "llama3_8b_lora.yaml"
    args = ["verify", str(config), "kernels={attention: reference}", "bf16=false", f"output_dir={tmp_path}",
            "--model-preset", "tiny", "--layers", "1", "--seq", "32", "--out", str(tmp_path / "v")]  # fmt: skip
    from tiletune.kernels import registry

    stock_calls = {key: n for key, n in registry.runtime_fallbacks.items() if key[2].endswith("stock attention")}
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert "verify: PASS" in result.output
    assert stock_calls == {key: n for key, n in registry.runtime_fallbacks.items() if key[2].endswith("stock attention")}
    saved = json.loads((tmp_path / "v" / "verify.json").read_text())
    assert saved["patch"]["ops"]["attention"]["patched"] == 1
    names = [t["name"] for t in saved["tensors"]]
    assert "b0.layers.0.self_attn.output" in names and "b0.layers.0.self_attn.input_grad" in names


def test_nothing_verified_where_no_selected_kernel_can_run(tmp_path, no_kernel_runs):
    """Not a PASS of the reference against the stock model: exit 3, which kernels and why, and no run at all."""
    result = verify(tmp_path, "--out", str(tmp_path / "v"), kernels="kernels=rms_norm,swiglu")
    assert result.exit_code == 3, result.output
    assert "not verified: rms_norm, swiglu (tilelang: no GPU here) cannot run on this machine" in result.output
    assert result.output.strip().splitlines()[-1].startswith("verify: NOT VERIFIED")
    assert "PASS" not in result.output and "accumulation" not in result.output
    report = json.loads((tmp_path / "v" / "verify.json").read_text())
    assert report["outcome"] == "not verified" and not report["passed"] and "tensors" not in report


def test_a_selected_kernel_that_cannot_run_leaves_the_others_compared_and_the_run_not_verified(tmp_path, monkeypatch,
                                                                                              no_kernel_runs):
    plugin(tmp_path, monkeypatch, "exact_norm_beside", 1.0)
    kernels = "kernels={rms_norm: exact_norm_beside, swiglu: tilelang, plugins: [exact_norm_beside]}"
    result = verify(tmp_path, "--out", str(tmp_path / "v"), kernels=kernels)
    assert result.exit_code == 3, result.output
    assert "not verified: swiglu (tilelang: no GPU here)" in result.output and "verify: NOT VERIFIED" in result.output
    report = json.loads((tmp_path / "v" / "verify.json").read_text())
    assert all(t["passed"] for t in report["tensors"]) and report["patch"]["ops"]["rms_norm"]["patched"] > 0
    assert [note.split(":")[0] for note in report["accumulation"]] == ["rms_norm"]  # none for swiglu, which did not run


def test_accumulation_dtype_differences_are_reported():
    from tiletune.patch import parse_kernel_spec
    from tiletune.verify.run import accumulation_differences

    notes = accumulation_differences(parse_kernel_spec("all"))
    assert sorted(n.split(":")[0] for n in notes) == ["geglu", "rope", "swiglu"]
    bound = accumulation_differences(parse_kernel_spec("all"), bound={"rms_norm", "swiglu", "rope", "linear"})
    assert sorted(n.split(":")[0] for n in bound) == ["rope", "swiglu"]  # a Llama has no GeGLU MLP to note
    assert "swiglu: tilelang computes in float32, the stock implementation in input dtype" in notes


def test_the_loss_is_judged_against_a_float64_loss_on_an_unpadded_vocabulary(tmp_path, tokenizer_dir):
    """A Gemma 3 with 633 words (the demo tokenizer and Gemma's stop word, not padded to 64): transformers' loss casts
    the logits to float32, a float64 run's too, so the high-precision run's loss used to be the stock run's float32
    arithmetic: stock "exact", and the fused loss, summing in another order, 3 ulps off, failed. The high-precision
    run now takes its loss in float64: stock and the fused loss are both a rounding step or so from it, and pass."""
    import torch
    import transformers

    from tiletune.config import build_config
    from tiletune.verify.run import VerifyOptions, run_verify

    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<end_of_turn>"]}, replace_extra_special_tokens=False)
    tokenizer.save_pretrained(tmp_path / "model")
    config = transformers.Gemma3TextConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    assert config.vocab_size == 633
    torch.manual_seed(0)
    transformers.Gemma3ForCausalLM(config).save_pretrained(tmp_path / "model")
    data = tmp_path / "data"
    data.mkdir()
    (data / "t.json").write_text(json.dumps([{"instruction": f"say {w}", "input": "", "output": f"{w} {w}"}
                                             for w in "abcdefgh"]))
    (data / "dataset_info.json").write_text(json.dumps({"t": {"file_name": "t.json"}}))
    keys = {"model_name_or_path": str(tmp_path / "model"), "stage": "sft", "finetuning_type": "lora", "lora_target": "all",
            "dataset": "t", "dataset_dir": str(data), "template": "gemma3", "cutoff_len": 32,
            "per_device_train_batch_size": 4, "report_to": "none", "output_dir": str(tmp_path / "out"),
            "kernels": "all=reference,geglu=reference"}
    result = run_verify(build_config(keys), VerifyOptions(out_dir=tmp_path / "verify", seq=16, random_tokens=True))
    losses = [row for row in result["tensors"] if row["name"].endswith(".loss")]
    assert result["outcome"] == "pass" and len(losses) == 2
    assert all(row["stock"]["max_ulps"] > 0 for row in losses)  # a float32 loss is not the float64 one
