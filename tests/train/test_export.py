"""`tiletune export`: the merged model equals base + adapter, loads with AutoModelForCausalLM, and the
export folder is never overwritten or left half-written."""

from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from tiletune.cli import main

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "examples" / "demo.yaml"
BASE = REPO / "examples" / "tiny-llama"


def export(*overrides: str):
    return CliRunner().invoke(main, ["export", str(DEMO), f"model_name_or_path={BASE}", *overrides])


@torch.no_grad()
def logits_of(model, input_ids: torch.Tensor) -> torch.Tensor:
    return model.eval()(input_ids=input_ids).logits.float()


@pytest.mark.parametrize(("dtype", "size", "atol"), [("float32", "0.001", 1e-4), ("bfloat16", "5", 0.25)])
def test_merged_model_matches_base_plus_adapter(tmp_path, demo_adapter, dtype, size, atol):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "merged"
    result = export(f"adapter_name_or_path={demo_adapter}", f"export_dir={out}", f"export_size={size}",
                    f"infer_dtype={dtype}")  # fmt: skip
    assert result.exit_code == 0, result.output
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(shards) > 1 if size == "0.001" else shards == ["model.safetensors"]
    assert {"config.json", "generation_config.json", "tokenizer.json"} <= {p.name for p in out.iterdir()}
    assert not list(tmp_path.glob(".merged.partial-*"))

    merged = AutoModelForCausalLM.from_pretrained(out)
    assert merged.dtype == getattr(torch, dtype)
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert set(merged.generation_config.eos_token_id) >= {tokenizer.convert_tokens_to_ids("<|eot_id|>")}
    reference = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(BASE), demo_adapter)
    base_only = AutoModelForCausalLM.from_pretrained(BASE)
    input_ids = torch.tensor([tokenizer.encode("Reverse and uppercase: q d x b")])
    expected = logits_of(reference, input_ids)
    assert (logits_of(base_only, input_ids) - expected).abs().max() > 10 * atol  # the adapter matters
    torch.testing.assert_close(logits_of(merged, input_ids), expected, atol=atol, rtol=0.02)


def test_refuses_a_non_empty_export_dir(tmp_path):
    out = tmp_path / "merged"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    result = export(f"export_dir={out}")
    assert result.exit_code == 2
    assert "is not empty; remove it or choose another export_dir" in result.output
    assert [p.name for p in out.iterdir()] == ["keep.txt"]


def test_refuses_a_missing_export_dir():
    result = export()
    assert result.exit_code == 2 and "export_dir is missing" in result.output


def test_an_interrupted_export_leaves_nothing_that_looks_complete(tmp_path, monkeypatch):
    from transformers import PreTrainedTokenizerBase

    def fail(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(PreTrainedTokenizerBase, "save_pretrained", fail)
    result = export(f"export_dir={tmp_path / 'merged'}")
    assert isinstance(result.exception, OSError)
    assert list(tmp_path.iterdir()) == []


def test_auto_dtype_is_the_one_the_base_checkpoint_was_saved_in(tmp_path):
    """infer_dtype auto: a bfloat16 checkpoint, loaded in float32 (the compute dtype here), is written in bfloat16."""
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    base = tmp_path / "bf16-base"
    AutoModelForCausalLM.from_pretrained(BASE, dtype=torch.bfloat16).save_pretrained(base)
    AutoTokenizer.from_pretrained(BASE).save_pretrained(base)
    result = export(f"model_name_or_path={base}", f"export_dir={tmp_path / 'merged'}", "infer_dtype=auto")
    assert result.exit_code == 0, result.output
    assert AutoConfig.from_pretrained(tmp_path / "merged").dtype == torch.bfloat16
    with safe_open(str(tmp_path / "merged" / "model.safetensors"), "pt") as saved:
        assert {saved.get_tensor(name).dtype for name in saved.keys()} == {torch.bfloat16}
