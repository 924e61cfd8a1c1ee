"""`pref_shared_prompt: true` (stage dpo): each preference pair's prompt runs through the model once.

TRL's DPO batches hold 2B rows: B prompts each followed by its chosen answer, then the same B prompts followed by
their rejected answers, right-padded. Under causal attention a prompt's hidden states do not depend on the answer
after it, so the two rows of a pair compute their prompt twice (a third of the tokens when prompt and answers are as
long). `pair_layout` makes each pair one row `prompt, chosen, rejected`: the rejected answer's position ids restart
after the prompt, and a 4-D attention mask lets it see the prompt and itself (causally), never the chosen answer.
Only the labelled positions reach the LM head (`linear_logprobs`), and their log-probs and statistics go back to
TRL's [2B, seq - 1] layout, so TRL's and LLaMA-Factory's losses, the reference pass and the metrics take them as
they are: the same function of the parameters, on P + C + R tokens per pair instead of 2 x (P + max(C, R)).

With SDPA the model's attention runs as `SHARED_SDPA` (`use_pair_attention`): where the mask carries the pairs'
spans, each pair's attention is two flash-capable SDPA calls, prompt + chosen answer causal, and the rejected answer
against the prompt's and its own keys, causal from the lower right; SDPA given the dense 4-D mask instead would run
its memory-efficient kernel over every query-key block, masked or not. Any other call is SDPA's own.

A call that is not such a batch (KTO's, a pair whose prompts differ, other keyword arguments) and a model whose
attention would not follow the mask (`unshareable`: flash-attention's varlen path, sliding windows) run unshared,
the reason logged once and counted with the run's kernel fallbacks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

IGNORE = -100
SHARED_SDPA = "sdpa_shared_prompt"  # the attention implementation of `use_pair_attention`
SPANS = "_tiletune_pair_spans"  # the mask's attribute: each pair's (prompt end, chosen answer end, row end)
# attn_implementation -> the 4-D mask it takes from a bool "query sees key" mask: SDPA a bool mask, eager an
# additive one (0 where seen, the dtype's minimum elsewhere), as transformers builds them
MASKS = {
    "sdpa": lambda sees, dtype: sees,
    SHARED_SDPA: lambda sees, dtype: sees,
    "eager": lambda sees, dtype: torch.zeros(sees.shape, dtype=dtype, device=sees.device).masked_fill(
        ~sees, torch.finfo(dtype).min),
}


@dataclass(frozen=True)
class PairLayout:
    """A [chosen; rejected] batch of `pairs` pairs as one row per pair: prompt, chosen answer, rejected answer."""

    spans: tuple[tuple[int, int, int], ...]  # each pair's (prompt end, chosen answer end, row end)
    input_ids: Tensor  # [pairs, length], right-padded
    position_ids: Tensor  # [pairs, length]: the rejected answer's positions restart after the prompt
    sees: Tensor  # [pairs, 1, length, length] bool: True where a query attends to a key
    hidden_rows: Tensor  # [labels]: flat index into [pairs x length] of the hidden state that predicts each label
    labels: Tensor  # [labels]
    targets: Tensor  # [labels]: flat index into TRL's [2 pairs x (seq - 1)] per-token log-probs


def unshareable(config) -> str | None:
    """Why a model of this config cannot run the shared layout (its attention would not follow the mask), or None."""
    text = config.get_text_config()
    implementation = getattr(text, "_attn_implementation", None)
    if implementation not in MASKS:
        return f"attn_implementation {implementation} takes no 4-D attention mask (sdpa and eager do)"
    sliding = "sliding_attention" in (getattr(text, "layer_types", None) or ()) or (
        getattr(text, "sliding_window", None) and getattr(text, "use_sliding_window", True))
    if sliding:
        return "sliding-window attention (a 4-D mask would replace the window)"
    return None


def pair_layout(input_ids: Tensor, attention_mask: Tensor | None, labels: Tensor) -> PairLayout | str:
    """The shared layout of a [chosen; rejected] batch of right-padded prompt + answer rows (labels -100 on the
    prompt and the padding), or why the batch is not one."""
    rows, seq = input_ids.shape
    if rows % 2:
        return f"{rows} rows: not pairs"
    pairs, device = rows // 2, input_ids.device
    index = torch.arange(seq, device=device)
    real = attention_mask.bool() if attention_mask is not None else torch.ones_like(input_ids, dtype=torch.bool)
    lengths = real.sum(1)
    labelled = labels != IGNORE
    prompts = torch.where(labelled.any(1), labelled.int().argmax(1), lengths)  # the first labelled position
    in_prompt = index < prompts[:pairs, None]
    problems = torch.stack([
        (real != (index < lengths[:, None])).any(),  # not right-padded
        (labelled & ~real).any(),  # a label on padding
        (prompts < 1).any() | (prompts == lengths).any(),  # a row without prompt, or without answer
        (prompts[:pairs] != prompts[pairs:]).any() | ((input_ids[:pairs] != input_ids[pairs:]) & in_prompt).any(),
    ]).tolist()  # fmt: skip
    reasons = ("rows not right-padded", "a label on padding", "a pair without a prompt or without an answer",
               "the rows of a pair have different prompts")  # fmt: skip
    if any(problems):
        return next(reason for reason, problem in zip(reasons, problems, strict=True) if problem)
    return _layout(input_ids, labels, prompts[:pairs].tolist(), lengths.tolist())


def _layout(input_ids: Tensor, labels: Tensor, prompts: list[int], lengths: list[int]) -> PairLayout:
    pairs, seq = input_ids.shape[0] // 2, input_ids.shape[1]
    device = input_ids.device
    spans = [(p, lengths[i], lengths[i] + lengths[pairs + i] - p) for i, p in enumerate(prompts)]  # P, P + C, P + C + R
    length = max(end for _, _, end in spans)
    ids = input_ids.new_zeros(pairs, length)
    positions = torch.arange(length, device=device).repeat(pairs, 1)
    hidden_rows, label_ids, targets = [], [], []
    for i, (p, chosen_end, end) in enumerate(spans):
        rejected, rejected_len = pairs + i, lengths[pairs + i]
        ids[i, :chosen_end] = input_ids[i, :chosen_end]
        ids[i, chosen_end:end] = input_ids[rejected, p:rejected_len]
        positions[i, chosen_end:end] = torch.arange(p, rejected_len, device=device)
        # TRL's log-prob t predicts token t + 1: the chosen row's t in [p - 1, chosen_end - 1) sits where it was; the
        # rejected row's first answer token is predicted by the prompt's last state, its t >= p sits c positions on
        chosen_t = torch.arange(p - 1, chosen_end - 1, device=device)
        rejected_t = torch.arange(p - 1, rejected_len - 1, device=device)
        shift = torch.where(rejected_t >= p, chosen_end - p, 0)
        hidden_rows += [i * length + chosen_t, i * length + rejected_t + shift]
        label_ids += [labels[i, chosen_t + 1], labels[rejected, rejected_t + 1]]
        targets += [i * (seq - 1) + chosen_t, rejected * (seq - 1) + rejected_t]
    prompt_end, chosen_end, end = (torch.tensor(column, device=device).view(pairs, 1, 1) for column in zip(*spans))
    query, key = torch.arange(length, device=device).view(length, 1), torch.arange(length, device=device)
    in_row = query < end
    # causal, and a rejected-answer query (at or after chosen_end) skips the chosen answer's keys
    sees = (key <= query) & ((query < chosen_end) | (key < prompt_end) | (key >= chosen_end)) & in_row
    sees |= ~in_row & (key == query)  # padding sees itself only: its softmax stays finite
    labels_flat = torch.cat(label_ids)
    keep = labels_flat != IGNORE
    return PairLayout(tuple(spans), ids, positions, sees.unsqueeze(1), torch.cat(hidden_rows)[keep], labels_flat[keep],
                      torch.cat(targets)[keep])


def shared_log_probs(causal_lm, layout: PairLayout, seq: int, head: Callable) -> tuple[Tensor, Tensor]:
    """(per-token log-probs [2 pairs, seq - 1], their statistics [2 pairs, seq - 1, k]) in TRL's layout from one
    forward of the shared rows; `head(hidden_rows, labels)` is the LM head's (log-probs, statistics) of the
    labelled hidden states. 0 where the label is -100."""
    backbone = causal_lm.base_model
    mask = MASKS[causal_lm.config.get_text_config()._attn_implementation](layout.sees, causal_lm.dtype)
    setattr(mask, SPANS, layout.spans)  # transformers hands a 4-D mask to every layer's attention as it is
    hidden = backbone(input_ids=layout.input_ids, attention_mask=mask, position_ids=layout.position_ids,
                      use_cache=False).last_hidden_state  # fmt: skip
    logp, stats = head(hidden.reshape(-1, hidden.size(-1)).index_select(0, layout.hidden_rows), layout.labels)
    rows = 2 * layout.input_ids.shape[0]
    full_logp = logp.new_zeros(rows * (seq - 1)).index_copy(0, layout.targets, logp)
    full_stats = stats.new_zeros(rows * (seq - 1), stats.shape[-1]).index_copy(0, layout.targets, stats)
    return full_logp.view(rows, seq - 1), full_stats.view(rows, seq - 1, -1)


def use_pair_attention(model) -> None:
    """Run the model's SDPA attention as `SHARED_SDPA` (registered once with transformers): `pair_attention` where
    the mask carries pair spans, SDPA's own everywhere else (its masks too). For the model's life: a checkpointed
    layer's recomputation reads the implementation when the backward runs."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    config = model.config.get_text_config()
    if config._attn_implementation != "sdpa":
        return
    if SHARED_SDPA not in ALL_MASK_ATTENTION_FUNCTIONS:
        AttentionInterface.register(SHARED_SDPA, pair_attention)
        ALL_MASK_ATTENTION_FUNCTIONS.register(SHARED_SDPA, sdpa_mask)
    config._attn_implementation = SHARED_SDPA


def pair_attention(module, query: Tensor, key: Tensor, value: Tensor, attention_mask, dropout: float = 0.0,
                   scaling: float | None = None, **kwargs):  # fmt: skip
    """transformers' attention function for `SHARED_SDPA`: per pair of a shared-layout mask, prompt + chosen answer
    causal, the rejected answer against [prompt; itself] causal from the lower right; SDPA's own otherwise."""
    from torch.nn.attention.bias import causal_lower_right
    from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward

    spans = getattr(attention_mask, SPANS, None)
    if spans is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)  # fmt: skip
    groups = query.shape[1] // key.shape[1]
    key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    dropout = dropout if module.training else 0.0
    rows = []
    for i, (prompt_end, chosen_end, end) in enumerate(spans):
        q, k, v = query[i : i + 1], key[i : i + 1], value[i : i + 1]
        chosen = F.scaled_dot_product_attention(q[:, :, :chosen_end], k[:, :, :chosen_end], v[:, :, :chosen_end],
                                                dropout_p=dropout, is_causal=True, scale=scaling)  # fmt: skip
        seen = torch.cat([k[:, :, :prompt_end], k[:, :, chosen_end:end]], 2), torch.cat(
            [v[:, :, :prompt_end], v[:, :, chosen_end:end]], 2)
        rejected = F.scaled_dot_product_attention(
            q[:, :, chosen_end:end], *seen, attn_mask=causal_lower_right(end - chosen_end, seen[0].shape[2]),
            dropout_p=dropout, scale=scaling)  # fmt: skip
        padding = q.new_zeros(1, q.shape[1], q.shape[2] - end, value.shape[-1])
        rows.append(torch.cat([chosen, rejected, padding], 2))
    return torch.cat(rows).transpose(1, 2).contiguous(), None
