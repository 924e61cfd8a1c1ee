"""bench/preference.py: LLaMA-Factory's full-logits log-probs against TRL's fused head."""

import copy

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
