"""bench/preference.py: LLaMA-Factory's full-logits log-probs against TRL's fused head; Liger-Kernel's fused linear
preference losses (`liger_fused`) against the stage's own loss."""

import contextlib
import copy
import importlib.util

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from trl.trainer.utils import add_fused_lm_head

from tiletune.bench.preference import add_full_logits_head


def test_the_full_logits_head_gives_trls_fused_log_probs_and_metrics():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2)  # fmt: skip
    fused = LlamaForCausalLM(config).float()
    full = copy.deepcopy(fused)
    add_fused_lm_head(fused, outputs=("log_probs", "entropy", "mean_logits", "is_top1"))
    add_full_logits_head(full)
    ids = torch.randint(0, 97, (3, 21))
    labels = ids.masked_fill(torch.arange(21) < 9, -100)  # the prompt's tokens carry no label
    labels[2, 15:] = -100
    got, want = (m(input_ids=ids, labels=labels, fused_lm_head=True) for m in (full, fused))
    for field in ("log_probs", "entropy", "mean_logits"):
        torch.testing.assert_close(getattr(got, field), getattr(want, field), rtol=1e-5, atol=1e-5)
    assert torch.equal(got.is_top1.bool(), want.is_top1.bool()) and torch.equal(got.label_mask, want.label_mask)
    torch.testing.assert_close(got.loss, want.loss)
    got.log_probs.sum().backward()  # the policy trains through it
    assert full.lm_head.weight.grad is not None and full.lm_head.weight.grad.abs().sum() > 0
    plain = full(input_ids=ids)  # without fused_lm_head: the model's own forward
    assert plain.logits.shape == (3, 21, 97)


LIGER = importlib.util.find_spec("liger_kernel") is not None
needs_liger = pytest.mark.skipif(not LIGER, reason="needs Liger-Kernel's fused preference losses (PyTorch, they run on "
                                                   "the CPU): pip install liger-kernel==0.8.5")  # fmt: skip


def _lora_model_and_config(tmp_path, overrides):
    """The tiny preset with LoRA in float32 and a config with `overrides`; the LoRA B matrices random, so the policy
    is not its reference (a margin of 0 would hide the reference's part of the loss)."""
    from tiletune.bench.worker import build_model
    from tiletune.config import load_config

    path = tmp_path / "pref.yaml"
    path.write_text("model_name_or_path: unused\nfinetuning_type: lora\nlora_target: q_proj,v_proj\nbf16: false\n")
    cfg = load_config(path, overrides)
    torch.manual_seed(0)
    model, _ = build_model(cfg, "tiny", "baseline", torch.device("cpu"))
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.05)
    return cfg, model


@needs_liger
@pytest.mark.parametrize("overrides", [
    ["stage=dpo"],
    ["stage=dpo", "pref_beta=0.3", "pref_ftx=0.5"],
    ["stage=dpo", "pref_loss=hinge"],
    ["stage=dpo", "pref_loss=hinge", "pref_ftx=0.3"],
    ["stage=dpo", "pref_loss=simpo", "simpo_gamma=0.7"],
    ["stage=dpo", "pref_loss=simpo", "pref_ftx=0.3"],
    ["stage=dpo", "pref_loss=orpo"],
    ["stage=kto"],
    ["stage=kto", "pref_beta=0.3"],
], ids=lambda o: ",".join(o))  # fmt: skip
def test_liger_fused_computes_the_stages_loss_and_gradients(tmp_path, overrides):
    """`liger_fused` (Liger's fused linear preference loss on the last hidden states) gives the stage's own loss
    (TRL's / LLaMA-Factory's, on TRL's fused head) and the same LoRA gradients on the same batch: its bench row times
    the same loss."""
    from tiletune.bench.preference import preference_step

    cfg, model = _lora_model_and_config(tmp_path, overrides)
    results = {}
    for variant in ("baseline", "liger_fused"):
        copy_ = copy.deepcopy(model)
        loss = preference_step(cfg, copy_, variant, 2, 32, 0, contextlib.nullcontext)()
        grads = {name: param.grad for name, param in copy_.named_parameters() if param.requires_grad}
        assert grads and all(grad is not None and grad.abs().sum() > 0 for grad in grads.values())
        results[variant] = loss, grads
    (want, want_grads), (got, got_grads) = results["baseline"], results["liger_fused"]
    assert not torch.isclose(want, torch.tensor(0.693147), atol=1e-3)  # not the trivial log 2 of policy = reference
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[name], grad, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("overrides, missing", [
    (["stage=dpo", "pref_loss=ipo"], "Liger's DPO loss has no ipo"),
    (["stage=dpo", "dpo_label_smoothing=0.1"], "Liger's DPO sigmoid loss has no label smoothing"),
    (["stage=dpo", "pref_loss=orpo", "pref_ftx=0.5"], "Liger's ORPO loss weights its NLL term 1"),
    (["stage=dpo", "precompute_ref_log_probs=true"], "precompute_ref_log_probs=true"),
    (["stage=kto", "pref_ftx=0.5"], "Liger's KTO loss has no SFT term"),
    (["stage=kto", "kto_rejected_weight=1.33"], "Liger's KTO loss has no desirable/undesirable weights"),
    (["stage=sft"], "need stage dpo or kto"),
])  # fmt: skip
def test_liger_fused_refuses_a_loss_liger_does_not_compute_in_one_line(tmp_path, overrides, missing):
    from tiletune.bench.preference import liger_fused_refusal
    from tiletune.config import load_config

    path = tmp_path / "pref.yaml"
    path.write_text("model_name_or_path: unused\nfinetuning_type: lora\n")
    why = liger_fused_refusal(load_config(path, overrides))
    assert why is not None and missing in why and "\n" not in why


def test_liger_fused_supports_the_rest(tmp_path):
    from tiletune.bench.preference import liger_fused_refusal
    from tiletune.config import load_config

    path = tmp_path / "pref.yaml"
    path.write_text("model_name_or_path: unused\nfinetuning_type: lora\n")
    for overrides in (["stage=dpo"], ["stage=dpo", "pref_loss=hinge", "pref_ftx=0.1"],
                      ["stage=dpo", "pref_loss=simpo", "pref_ftx=0.2"], ["stage=dpo", "pref_loss=orpo"],
                      ["stage=kto", "pref_beta=0.2"]):  # fmt: skip
        assert liger_fused_refusal(load_config(path, overrides)) is None, overrides


def test_bench_refuses_liger_fused_before_timing_anything(tmp_path):
    """The refusal comes before any process runs, one line; without Liger-Kernel installed, how to install it."""
    from click.testing import CliRunner

    from tiletune.cli import main

    config = tmp_path / "dpo.yaml"
    config.write_text("model_name_or_path: unused\nstage: dpo\nfinetuning_type: lora\n")
    out = tmp_path / "o"
    result = CliRunner().invoke(main, ["bench", str(config), "--variants", "baseline,liger_fused:pref_loss=ipo",
                                       "--out", str(out)])  # fmt: skip
    message = "needs Liger-Kernel; pip install liger-kernel" if not LIGER else "Liger's DPO loss has no ipo"
    assert result.exit_code == 2 and message in result.output, result.output
    assert not out.exists()
    config.write_text("model_name_or_path: unused\nstage: sft\n")
    result = CliRunner().invoke(main, ["bench", str(config), "--variants", "baseline,liger_fused", "--out", str(out)])
    assert result.exit_code == 2, result.output
