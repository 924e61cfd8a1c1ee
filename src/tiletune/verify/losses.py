"""The loss each of verify's runs differentiates: the causal LM loss, or the preference stage's.

`stage: dpo` (every `pref_loss`) and `stage: kto` train on per-answer log-probabilities, so their runs do too: each
batch holds whole sequences (DPO: the pairs' chosen sequences, then their rejected ones; KTO: answers with a
`desirable` flag), labels -100 on the prompt and the padding. The reference's log-probs come first, from the same
model with its LoRA adapters disabled and no gradient (none for orpo and simpo), then the policy's, which the
captured activations and gradients are of. The log-probs come from the whole logits (the stock and the
high-precision runs) or, in the patched run when `kernels:` selects `linear_logprobs`, from that op, so its
gradients are checked layer by layer like any kernel's. DPO's losses are LLaMA-Factory's (`pair_losses`, as
training computes them, `pref_ftx` included); KTO's is TRL's with its KL estimate taken as 0 (training detaches it:
no gradient flows through it).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from tiletune.config import TuneConfig

PREFERENCE_STAGES = ("dpo", "kto")
StepLoss = Callable[[torch.nn.Module, dict, torch.device], torch.Tensor]


def lm_loss(model, batch: dict, device: torch.device) -> torch.Tensor:
    """The model's own causal LM loss on the batch's labels."""
    return model(input_ids=batch["input_ids"].to(device), labels=batch["labels"].to(device)).loss


def high_precision_lm_loss(model, batch: dict, device: torch.device) -> torch.Tensor:
    """The causal LM loss as transformers defines it (next-token labels, -100 ignored, the mean over the rest), in the
    logits' own precision (float32 at least). transformers' loss casts the logits to float32, a float64 run's down to
    float32 too: the high-precision run's loss, and every gradient flowing back from it, would be a float32 one, on
    the stock run's arithmetic, so that the stock loss looked exact and any other float32 summation order failed."""
    labels = batch["labels"].to(device)
    logits = model(input_ids=batch["input_ids"].to(device)).logits
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    shifted = F.pad(labels, (0, 1), value=-100)[..., 1:].to(logits.device)
    return F.cross_entropy(logits.flatten(0, -2), shifted.flatten(), ignore_index=-100)


def reference_step_loss(cfg: TuneConfig) -> StepLoss:
    """The loss of cfg's stage for verify's high-precision run: the LM loss in the run's precision (a preference
    stage's log-probs are already taken in it)."""
    return step_loss(cfg) if cfg.stage in PREFERENCE_STAGES else high_precision_lm_loss


def step_loss(cfg: TuneConfig, spec=None) -> StepLoss:
    """The loss of cfg's stage; in a run under the kernel `spec` that selects `linear_logprobs`, a preference stage
    takes its log-probs from that op."""
    if cfg.stage not in PREFERENCE_STAGES:
        return lm_loss
    from tiletune.train.preference import LogprobHead

    head = next((LogprobHead(s.impl, spec.strict) for s in spec.ops if s.op == "linear_logprobs"), None) if spec else None
    return functools.partial(_preference_loss, cfg, head)


def _preference_loss(cfg: TuneConfig, head, model, batch: dict, device: torch.device) -> torch.Tensor:
    from tiletune.train.preference import PREF_LOSSES, pair_losses

    ids, labels = batch["input_ids"].to(device), batch["labels"].to(device)
    pref = PREF_LOSSES[cfg.pref_loss] if cfg.stage == "dpo" else None
    ref_sums = None
    if pref is None or pref.reference:
        base = model.disable_adapter() if hasattr(model, "disable_adapter") else contextlib.nullcontext()  # LoRA's reference
        with torch.no_grad(), base:
            ref_sums, _ = _answer_sums(model, ids, labels, head)
    sums, lengths = _answer_sums(model, ids, labels, head)
    if pref is None:  # KTO, KL estimate 0
        ratio = cfg.pref_beta * (sums - ref_sums)
        desirable = batch["desirable"].to(device)
        losses = torch.where(desirable, cfg.kto_chosen_weight * (1 - F.sigmoid(ratio)),
                             cfg.kto_rejected_weight * (1 - F.sigmoid(-ratio)))  # fmt: skip
        return losses.mean()
    settings = SimpleNamespace(beta=cfg.pref_beta, label_smoothing=cfg.dpo_label_smoothing, simpo_gamma=cfg.simpo_gamma)
    return pair_losses(pref, settings, cfg.pref_ftx, sums, lengths, ref_sums)[0].mean()


def _answer_sums(model, ids: torch.Tensor, labels: torch.Tensor, head) -> tuple[torch.Tensor, torch.Tensor]:
    """(each sequence's summed log-probs of its labels, its number of labels, at least 1)."""
    from tiletune.train.preference import fused_label_log_probs, label_log_probs

    if head is None:
        log_probs, mask, _ = label_log_probs(model(input_ids=ids, use_cache=False).logits, labels)
    else:
        causal_lm = model.get_base_model() if hasattr(model, "get_base_model") else model
        log_probs, _, mask = fused_label_log_probs(causal_lm, labels, head, False, input_ids=ids)  # pairs unshared
    return log_probs.sum(1), mask.sum(1).clamp(min=1)


def preference_rows(cfg: TuneConfig, rows: list[dict], seq: int, pad_id: int) -> dict[str, torch.Tensor]:
    """One batch from tokenised preference rows (data/processing.py's columns): prompt + answer cut to `seq`, right-
    padded with `pad_id`, labels on the answer only; DPO's chosen sequences first, then the rejected ones."""
    answers = ["chosen_ids", "rejected_ids"] if cfg.stage == "dpo" else ["completion_ids"]
    sequences = [(row["prompt_ids"], row[key]) for key in answers for row in rows]
    width = min(seq, max(len(p) + len(a) for p, a in sequences))
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    labels = torch.full_like(ids, -100)
    for index, (prompt, answer) in enumerate(sequences):
        tokens = (list(prompt) + list(answer))[:width]
        ids[index, : len(tokens)] = torch.tensor(tokens)
        labels[index, len(prompt) : len(tokens)] = ids[index, len(prompt) : len(tokens)]
    batch = {"input_ids": ids, "labels": labels}
    if cfg.stage == "kto":
        batch["desirable"] = torch.tensor([bool(row["label"]) for row in rows])
    return batch
