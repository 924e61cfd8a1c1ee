"""`stage: dpo` and `stage: kto` (TRL's DPOTrainer and KTOTrainer with LLaMA-Factory's keys and losses) and
`stage: rm` (a pairwise reward model).

`pref_loss` picks a row of `PREF_LOSSES`. Where TRL's loss is LLaMA-Factory's (sigmoid, hinge, ipo, with no
`pref_ftx` and no `dpo_label_smoothing`), TRL computes it; otherwise (orpo, simpo, the SFT term, conservative
DPO) the subclass computes LLaMA-Factory's formula from the same fused log-probs (CustomDPOTrainer's
`compute_preference_loss` and `get_batch_loss_metrics`). ipo, orpo and simpo compare per-token averages of the
answers' log-probs, the others their sums; `pref_ftx` adds `pref_ftx` x the chosen answer's average negative
log-likelihood. The reference: `ref_model` (+ `ref_model_adapters`) when set; with LoRA the base model with the
adapter disabled; in full fine-tuning a copy of the model (or its log-probs computed before training with
`precompute_ref_log_probs`). orpo and simpo need none.

`stage: kto` is TRL's KTO loss: `pref_beta`, `kto_chosen_weight` / `kto_rejected_weight` (TRL's desirable /
undesirable weights), the same reference; the KL term's mismatched answers come with the data (data/processing.py).

`stage: rm` is LLaMA-Factory's PairwiseTrainer: a value head (a Linear from the last hidden state to a score) on
the causal LM, each answer scored at its last token, loss -log σ(score chosen - score rejected); evaluation
reports the pairwise accuracy. The head is saved beside the model as value_head.safetensors
(`v_head.summary.weight`, `v_head.summary.bias`, as LLaMA-Factory writes it).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tiletune.config import TuneConfig

STAGES = ("dpo", "kto", "rm")
VALUE_HEAD_FILE = "value_head.safetensors"


def _sigmoid(t, c, r, rc, rr):
    """DPO, conservative with `dpo_label_smoothing`."""
    delta = t.beta * ((c - rc) - (r - rr))
    return -(1 - t.label_smoothing) * F.logsigmoid(delta) - t.label_smoothing * F.logsigmoid(-delta)


def _hinge(t, c, r, rc, rr):
    return torch.relu(1 - t.beta * ((c - rc) - (r - rr)))


def _ipo(t, c, r, rc, rr):
    return ((c - rc) - (r - rr) - 1 / (2 * t.beta)) ** 2


def _orpo(t, c, r, rc, rr):
    """The chosen answer's negative log-likelihood + beta x the odds-ratio loss (c, r: average log-probs)."""
    log_odds = (c - r) - (torch.log1p(-torch.exp(c)) - torch.log1p(-torch.exp(r)))
    return -c - t.beta * F.logsigmoid(log_odds)


def _simpo(t, c, r, rc, rr):
    return -F.logsigmoid(t.beta * ((c - r) - t.simpo_gamma / t.beta))


@dataclass(frozen=True)
class PrefLoss:
    """One `pref_loss`: per-sequence loss from policy (c, r) and reference (rc, rr) log-probs."""

    per_sequence: Callable
    trl: str | None  # TRL's loss_type that computes the same, or None
    reference: bool  # compared against a reference model
    average: bool  # per-token averages of the answers' log-probs rather than sums


PREF_LOSSES = {
    "sigmoid": PrefLoss(_sigmoid, "sigmoid", reference=True, average=False),
    "hinge": PrefLoss(_hinge, "hinge", reference=True, average=False),
    "ipo": PrefLoss(_ipo, "ipo", reference=True, average=True),
    "orpo": PrefLoss(_orpo, None, reference=False, average=True),
    "simpo": PrefLoss(_simpo, None, reference=False, average=True),
}


def preference_stage(cfg: TuneConfig, model, tokenizer, model_loader):
    """(Trainer class, arguments converter, extra Trainer keywords) for the config's stage."""
    return {"dpo": _dpo_stage, "kto": _kto_stage, "rm": _reward_stage}[cfg.stage](cfg, model, tokenizer, model_loader)


def _reference(cfg: TuneConfig, tokenizer, model_loader):
    """The `ref_model` (with `ref_model_adapters`) loaded frozen, or None (TRL's default reference)."""
    if not cfg.ref_model:
        return None
    ref_cfg = dataclasses.replace(cfg, model_name_or_path=cfg.ref_model, adapter_name_or_path=cfg.ref_model_adapters)
    return model_loader(ref_cfg, tokenizer, trainable=False)


def _trl_arguments(config_class, args, **keys):
    """A TRL config holding the run's Seq2SeqTrainingArguments (LLaMA-Factory's defaults) and the stage's keys."""
    from transformers import TrainingArguments

    common = {f.name: getattr(args, f.name) for f in dataclasses.fields(TrainingArguments) if f.init}
    # max_length: the data is already cut to cutoff_len
    return config_class(**common, max_length=None, **keys)


def _dpo_stage(cfg: TuneConfig, model, tokenizer, model_loader):
    from trl import DPOConfig

    keys = {"beta": cfg.pref_beta, "loss_type": [PREF_LOSSES[cfg.pref_loss].trl or "sigmoid"],
            "label_smoothing": cfg.dpo_label_smoothing,  # TRL's sigmoid ignores it: then tiletune computes the loss
            "precompute_ref_log_probs": cfg.precompute_ref_log_probs}
    settings = {"loss": PREF_LOSSES[cfg.pref_loss], "ftx": cfg.pref_ftx, "simpo_gamma": cfg.simpo_gamma}
    return (preference_trainer_class(), lambda args: _trl_arguments(DPOConfig, args, **keys),
            {"ref_model": _reference(cfg, tokenizer, model_loader), **settings})


def _kto_stage(cfg: TuneConfig, model, tokenizer, model_loader):
    from trl import KTOConfig, KTOTrainer

    keys = {"beta": cfg.pref_beta, "desirable_weight": cfg.kto_chosen_weight,
            "undesirable_weight": cfg.kto_rejected_weight, "precompute_ref_log_probs": cfg.precompute_ref_log_probs}

    class FeedbackTrainer(_TokenisedData, KTOTrainer):
        def __init__(self, *args, **kwargs):
            strategy, kwargs["args"].train_sampling_strategy = kwargs["args"].train_sampling_strategy, "sequential"
            super().__init__(*args, **kwargs)  # TRL insists on it: its KL answers are the batch neighbours'
            self.args.train_sampling_strategy = strategy  # tiletune's are stored with each example: shuffling keeps them

    return (FeedbackTrainer, lambda args: _trl_arguments(KTOConfig, args, **keys),
            {"ref_model": _reference(cfg, tokenizer, model_loader)})


class _TokenisedData:
    """For a TRL trainer: data tiletune has tokenised with the template; with LoRA, the reference is the base."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        model = self.accelerator.unwrap_model(self.model)
        if "ref" in getattr(model, "peft_config", {}):  # TRL's copy of the adapter: the reference is the adapter disabled
            model.delete_adapter("ref")

    def _prepare_dataset(self, dataset, processing_class, args, dataset_name):
        return dataset


def preference_trainer_class():
    """TRL's DPOTrainer with LLaMA-Factory's losses."""
    from trl import DPOTrainer

    class PreferenceTrainer(_TokenisedData, DPOTrainer):
        def __init__(self, *args, loss: PrefLoss, ftx: float, simpo_gamma: float, **kwargs):
            super().__init__(*args, **kwargs)
            self.pref, self.ftx, self.simpo_gamma = loss, ftx, simpo_gamma
            if not loss.reference:
                self.ref_model = None
            self.native = loss.trl is not None and ftx == 0 and self.label_smoothing == 0

        def _compute_loss(self, model, inputs, return_outputs):
            if self.native:
                return super()._compute_loss(model, inputs, return_outputs)
            return self._llamafactory_loss(model, inputs)

        def _llamafactory_loss(self, model, inputs):
            mode = "train" if self.model.training else "eval"
            mask = inputs["completion_mask"][:, 1:]
            labels = inputs["input_ids"].masked_fill(inputs["completion_mask"] == 0, -100)
            outputs = model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"], labels=labels,
                            use_cache=False, fused_lm_head=True)
            sums = (outputs.log_probs[:, -mask.size(1) :] * mask).sum(1)
            lengths = mask.sum(1).clamp(min=1)
            scale = lengths if self.pref.average else torch.ones_like(lengths)
            chosen, rejected = (sums / scale).chunk(2)
            if self.pref.reference:
                if self.precompute_ref_logps:
                    ref = (inputs["ref_chosen_logps"], inputs["ref_rejected_logps"])
                else:
                    ref = self.compute_ref_log_probs(self.ref_model if self.ref_model is not None else model, inputs)
                ref_chosen, ref_rejected = (logps / s for logps, s in zip(ref, scale.chunk(2)))
            else:
                ref_chosen = ref_rejected = torch.zeros_like(chosen)
            losses = self.pref.per_sequence(self, chosen, rejected, ref_chosen, ref_rejected)
            sft_loss = -(sums / lengths).chunk(2)[0]
            losses = losses + self.ftx * sft_loss
            chosen_rewards = self.beta * (chosen - ref_chosen).detach()
            rejected_rewards = self.beta * (rejected - ref_rejected).detach()
            metrics = {
                "rewards/chosen": chosen_rewards.mean(),
                "rewards/rejected": rejected_rewards.mean(),
                "rewards/accuracies": (chosen_rewards > rejected_rewards).float().mean(),
                "rewards/margins": (chosen_rewards - rejected_rewards).mean(),
                "logps/chosen": chosen.detach().mean(),
                "logps/rejected": rejected.detach().mean(),
                "sft_loss": sft_loss.detach().mean(),
            }
            for key, value in metrics.items():
                self._metrics[mode][key].append(self.accelerator.gather_for_metrics(value).mean().item())
            return losses.mean()

    return PreferenceTrainer


def _reward_stage(cfg: TuneConfig, model, tokenizer, model_loader):
    from trl.trainer.dpo_trainer import DataCollatorForPreference

    hidden = model.get_output_embeddings().in_features
    model.v_head = torch.nn.Linear(hidden, 1, device=model.get_output_embeddings().weight.device)
    collator = DataCollatorForPreference(pad_token_id=tokenizer.pad_token_id)
    return pairwise_trainer_class(), lambda args: args, {"data_collator": collator, "compute_metrics": pairwise_accuracy}


def pairwise_accuracy(eval_prediction) -> dict[str, float]:
    """The share of pairs whose chosen answer scores above the rejected one."""
    chosen, rejected = eval_prediction.predictions
    return {"accuracy": float((chosen > rejected).mean())}


def pairwise_trainer_class():
    """LLaMA-Factory's PairwiseTrainer on transformers' Trainer: batches are [chosen; rejected], right-padded."""
    from transformers import Trainer

    class PairwiseTrainer(Trainer):
        def scores(self, model, inputs):
            """Chosen and rejected scores: the value head on each sequence's last token."""
            outputs = model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"],
                            output_hidden_states=True, use_cache=False)
            head = self.accelerator.unwrap_model(model).v_head
            values = head(outputs.hidden_states[-1].to(head.weight.dtype)).squeeze(-1)
            last = inputs["attention_mask"].sum(-1, keepdim=True) - 1
            return values.gather(-1, last).squeeze(-1).float().chunk(2)

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            chosen, rejected = self.scores(model, inputs)
            loss = -F.logsigmoid(chosen - rejected).mean()
            return (loss, (chosen, rejected)) if return_outputs else loss

        def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
            inputs = self._prepare_inputs(inputs)
            with torch.no_grad():
                loss, scores = self.compute_loss(model, inputs, return_outputs=True)
            if prediction_loss_only:
                return loss.detach(), None, None
            return loss.detach(), scores, torch.ones_like(scores[0])  # the label: the chosen answer wins

        def _save(self, output_dir=None, state_dict=None):
            from safetensors.torch import save_file

            output_dir = output_dir or self.args.output_dir
            state_dict = state_dict if state_dict is not None else self.accelerator.unwrap_model(self.model).state_dict()
            head = {key: state_dict.pop(key) for key in ("v_head.weight", "v_head.bias")}
            super()._save(output_dir, state_dict)
            save_file({f"v_head.summary.{key[len('v_head.'):]}": value.detach().contiguous().cpu()
                       for key, value in head.items()}, os.path.join(output_dir, VALUE_HEAD_FILE))

    return PairwiseTrainer
