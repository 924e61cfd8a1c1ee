"""pref_shared_prompt: one row per pair (prompt, chosen, rejected) gives the per-token log-probs and gradients of the
two unshared rows; a layout whose rejected answer sees the chosen one does not; batches and models it cannot take
say why; the DPO trainer's loss and LoRA gradients are TRL's."""

import pytest
import torch
from transformers import Gemma3TextConfig, LlamaConfig, LlamaForCausalLM, MistralConfig, Qwen3Config

from tiletune.kernels.linear_logprobs import linear_logprobs
from tiletune.train import shared_prompt
from tiletune.train.shared_prompt import SHARED_SDPA, pair_layout, shared_log_probs, unshareable, use_pair_attention

VOCAB, WIDTH = 64, 32


def tiny_llama(implementation: str):
    """A float64 Llama; SHARED_SDPA: SDPA with `use_pair_attention` (two SDPA calls a pair), else the 4-D mask."""
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2,
                         attn_implementation="sdpa" if implementation == SHARED_SDPA else implementation)  # fmt: skip
    model = LlamaForCausalLM(config).double()
    if implementation == SHARED_SDPA:
        use_pair_attention(model)
    return model


def pair_batch(prompts, chosen, rejected, seq: int, seed: int = 0):
    """TRL's DPO batch layout: [prompt + chosen rows; prompt + rejected rows], right-padded, labels on the answers."""
    generator = torch.Generator().manual_seed(seed)
    pairs = len(prompts)
    ids = torch.zeros(2 * pairs, seq, dtype=torch.long)
    mask, labels = torch.zeros_like(ids), torch.full_like(ids, -100)
    for i, (p, c, r) in enumerate(zip(prompts, chosen, rejected, strict=True)):
        prompt = torch.randint(1, VOCAB, (p,), generator=generator)
        for row, n in ((i, c), (pairs + i, r)):
            answer = torch.randint(1, VOCAB, (n,), generator=generator)
            ids[row, : p + n], mask[row, : p + n], labels[row, p : p + n] = torch.cat([prompt, answer]), 1, answer
    return ids, mask, labels


def unshared_log_probs(model, ids, mask, labels):
    hidden = model.model(input_ids=ids, attention_mask=mask).last_hidden_state[:, :-1]
    logp, _ = linear_logprobs(hidden.reshape(-1, WIDTH), model.lm_head.weight, labels[:, 1:].reshape(-1))
    return logp.view(ids.shape[0], -1)


def both_ways(model, batch):
    """(shared log-probs, unshared log-probs, their gradients on every parameter) for one random weighting."""
    ids, mask, labels = batch
    layout = pair_layout(ids, mask, labels)
    shared = shared_log_probs(model, layout, ids.shape[1],
                              lambda hidden, targets: linear_logprobs(hidden, model.lm_head.weight, targets))[0]
    unshared = unshared_log_probs(model, ids, mask, labels)
    weights = torch.randn(unshared.shape, dtype=unshared.dtype, generator=torch.Generator().manual_seed(1))
    params = list(model.parameters())
    return shared, unshared, [torch.autograd.grad((logp * weights).sum(), params) for logp in (shared, unshared)]


@pytest.mark.parametrize("implementation", [SHARED_SDPA, "sdpa", "eager"])
@pytest.mark.parametrize("lengths", [([4, 2, 5], [3, 6, 2], [5, 1, 4]), ([1], [1], [7]), ([6, 6], [4, 4], [4, 4])])
def test_shared_rows_give_the_unshared_log_probs_and_gradients(implementation, lengths):
    torch.manual_seed(0)
    model = tiny_llama(implementation)
    batch = pair_batch(*lengths, seq=max(p + max(c, r) for p, c, r in zip(*lengths)) + 2)
    layout = pair_layout(*batch)
    assert layout.input_ids.shape[1] == max(p + c + r for p, c, r in zip(*lengths))  # each prompt once
    shared, unshared, (shared_grads, unshared_grads) = both_ways(model, batch)
    assert (unshared != 0).sum() == sum(c + r for _, c, r in zip(*lengths))
    # float64 weights, but the norms (and eager's softmax) compute in float32: float32 rounding in other orders
    torch.testing.assert_close(shared, unshared, rtol=1e-6, atol=1e-7)
    for mine, theirs in zip(shared_grads, unshared_grads, strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("implementation", [SHARED_SDPA, "sdpa"])
def test_a_rejected_answer_that_sees_the_chosen_one_fails(monkeypatch, implementation):
    """The check has teeth: a layout whose rejected answer attends to the chosen one (SDPA's mask: causal over the
    whole row; the pair attention: the chosen answer's keys taken as prompt) changes the rejected log-probs."""
    torch.manual_seed(0)
    model = tiny_llama(implementation)
    batch = pair_batch([4, 3], [5, 2], [3, 4], seq=10)
    real_layout = shared_prompt._layout

    def wrong(*args):  # only what the implementation reads is wrong: each must read it
        layout = real_layout(*args)
        spans, sees = layout.spans, layout.sees
        if implementation == SHARED_SDPA:
            spans = tuple((chosen_end, chosen_end, end) for _, chosen_end, end in spans)
        else:
            sees = torch.ones(sees.shape[-2:], dtype=torch.bool).tril().expand_as(sees)
        return shared_prompt.PairLayout(spans, layout.input_ids, layout.position_ids, sees, layout.hidden_rows,
                                        layout.labels, layout.targets)  # fmt: skip

    monkeypatch.setattr(shared_prompt, "_layout", wrong)
    shared, unshared, _ = both_ways(model, batch)
    torch.testing.assert_close(shared[:2], unshared[:2])  # the chosen answers see nothing else
    assert (shared[2:] - unshared[2:]).abs().max() > 1e-3


def test_the_pair_attention_leaves_other_calls_to_sdpa():
    """Under SHARED_SDPA a model's ordinary forward (a padded batch, transformers' own mask) is SDPA's."""
    torch.manual_seed(0)
    model = tiny_llama("sdpa")
    ids, mask, _ = pair_batch([3, 2], [2, 3], [4, 1], seq=8)
    expected = model(input_ids=ids, attention_mask=mask).logits
    use_pair_attention(model)
    assert model.config._attn_implementation == SHARED_SDPA
    torch.testing.assert_close(model(input_ids=ids, attention_mask=mask).logits, expected, rtol=0, atol=0)


@pytest.mark.parametrize("change, reason", [
    ("odd", "3 rows: not pairs"),
    ("prompt", "the rows of a pair have different prompts"),
    ("left_pad", "rows not right-padded"),
    ("no_answer", "a pair without a prompt or without an answer"),
])  # fmt: skip
def test_batches_that_are_not_pairs_say_why(change, reason):
    ids, mask, labels = pair_batch([3, 2], [2, 3], [4, 1], seq=8)
    if change == "odd":
        ids, mask, labels = ids[:3], mask[:3], labels[:3]
    elif change == "prompt":
        ids[3, 0] = ids[1, 0] % (VOCAB - 1) + 1
    elif change == "left_pad":
        ids, mask, labels = ids.roll(1, 1), mask.roll(1, 1), labels.roll(1, 1)
    else:
        labels[2] = -100
    assert pair_layout(ids, mask, labels) == reason


def test_models_whose_attention_ignores_the_mask_say_why():
    sdpa = {"attn_implementation": "sdpa"}
    assert unshareable(LlamaConfig(**sdpa)) is None
    assert unshareable(Qwen3Config(**sdpa)) is None  # use_sliding_window false
    assert "sliding-window" in unshareable(MistralConfig(sliding_window=4096, **sdpa))
    assert "sliding-window" in unshareable(Gemma3TextConfig(**sdpa))
    flash = LlamaConfig(**sdpa)
    flash._attn_implementation = "flash_attention_2"
    assert unshareable(flash) == "attn_implementation flash_attention_2 takes no 4-D attention mask (sdpa and eager do)"
