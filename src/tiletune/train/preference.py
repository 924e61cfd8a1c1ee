"""`stage: dpo` and `stage: kto` (TRL's DPOTrainer and KTOTrainer with LLaMA-Factory's keys and losses) and
`stage: rm` (a pairwise reward model).

`pref_loss` picks a row of `PREF_LOSSES`. Where TRL's loss is LLaMA-Factory's (sigmoid, hinge, ipo, with no
`pref_ftx` and no `dpo_label_smoothing`), TRL computes it; otherwise (orpo, simpo, the SFT term, conservative
DPO) the subclass computes LLaMA-Factory's formula from the same fused log-probs (CustomDPOTrainer's
`compute_preference_loss` and `get_batch_loss_metrics`). ipo, orpo and simpo compare per-token averages of the
answers' log-probs, the others their sums; `pref_ftx` adds `pref_ftx` x the chosen answer's average negative
log-likelihood. The reference: `ref_model` (+ `ref_model_adapters`) when set; with LoRA the base model with the
adapter disabled; in full fine-tuning a copy of the model (or its log-probs computed before training with
`precompute_ref_log_probs`). orpo and simpo need none. After training with eval data and a reference, the run prints
the held-out preference accuracy before training (the reference's: log p(chosen) > log p(rejected)) and after (the
policy's implicit reward: its log-ratio to the reference, chosen > rejected).

`stage: kto` is TRL's KTO loss: `pref_beta`, `kto_chosen_weight` / `kto_rejected_weight` (TRL's desirable /
undesirable weights), the same reference; the KL term's mismatched answers come with the data (data/processing.py).
`pref_ftx` adds LLaMA-Factory's SFT term: `pref_ftx` x the desirable answers' average negative log-likelihood, scaled
by batch size / desirable answers as LLaMA-Factory's CustomKTOTrainer does.

Every log-prob (policy, reference, KTO's KL answers) comes from `model(..., fused_lm_head=True)`: TRL's fused LM
head, or with `kernels:` selecting `linear_logprobs` (`all` does) tiletune's op in its place (`add_logprob_head`);
with `pref_shared_prompt` that head runs each DPO pair's prompt once (train/shared_prompt.py).

`stage: rm` is LLaMA-Factory's PairwiseTrainer: a value head (a Linear from the last hidden state to a score) on
the causal LM, each answer scored at its last token, loss -log σ(score chosen - score rejected); evaluation
reports the pairwise accuracy. The head is saved beside the model as value_head.safetensors
(`v_head.summary.weight`, `v_head.summary.bias`, as LLaMA-Factory writes it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import types
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


def sequences(cfg: TuneConfig) -> tuple[int, int]:
    """(sequences trained, sequences run forward only) per example of a step: DPO trains chosen and rejected and
    runs both through the reference (none for orpo and simpo); KTO trains the answer and runs its KL answer
    through the policy without gradient and both through the reference."""
    if cfg.stage == "kto":
        return 1, 3
    return 2, 2 if PREF_LOSSES[cfg.pref_loss].reference else 0


def recompute_probe(cfg: TuneConfig, batch: int) -> tuple[int, Callable | None]:
    """(rows, loss) of `gradient_checkpointing: auto`'s probe step (train/recompute.py) for cfg's stage: a dpo / kto
    step trains `sequences(cfg)[0]` rows per example through a log-prob head that never holds the [tokens, vocab]
    logits (TRL's fused head or `linear_logprobs`), so the probe runs that many rows and takes `linear_logprobs` of
    their own tokens as its loss, where the LM loss on `batch` rows would count the logits and half the rows (a
    shared-prompt row holds no more tokens than its two rows). rm: its chosen and rejected rows, the LM loss (its
    forward computes the logits too). Other stages: (batch, None), the LM loss."""
    if cfg.stage not in ("dpo", "kto"):
        return (2 * batch if cfg.stage == "rm" else batch), None
    from tiletune.kernels.registry import default_impl

    head = LogprobHead(default_impl("linear_logprobs"))

    def loss(model, tokens):
        causal_lm = model.get_base_model() if hasattr(model, "get_base_model") else model
        return -fused_label_log_probs(causal_lm, tokens, head, False, input_ids=tokens)[0].mean()

    return sequences(cfg)[0] * batch, loss


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
            {"ref_model": _reference(cfg, tokenizer, model_loader), "logprob_head": logprob_head(cfg), **settings})  # fmt: skip


def _kto_stage(cfg: TuneConfig, model, tokenizer, model_loader):
    from trl import KTOConfig, KTOTrainer

    keys = {"beta": cfg.pref_beta, "desirable_weight": cfg.kto_chosen_weight,
            "undesirable_weight": cfg.kto_rejected_weight, "precompute_ref_log_probs": cfg.precompute_ref_log_probs}

    class FeedbackTrainer(_TokenisedData, KTOTrainer):
        def __init__(self, *args, ftx: float, **kwargs):
            strategy, kwargs["args"].train_sampling_strategy = kwargs["args"].train_sampling_strategy, "sequential"
            super().__init__(*args, **kwargs)  # TRL insists on it: its KL answers are the batch neighbours'
            self.args.train_sampling_strategy = strategy  # tiletune's are stored with each example: shuffling keeps them
            self.ftx = ftx

        def _compute_loss(self, model, inputs, return_outputs):
            """TRL's KTO loss, plus with `pref_ftx` LLaMA-Factory's SFT term (see the module's docstring)."""
            if not self.ftx:
                return super()._compute_loss(model, inputs, return_outputs)
            with _policy_log_probs(model, inputs["input_ids"]) as policy:
                result = super()._compute_loss(model, inputs, return_outputs)
            desirable = torch.as_tensor(inputs["label"], dtype=torch.bool, device=policy[0].device)
            if not desirable.any():
                return result
            sums, lengths = answer_log_probs(policy[0], inputs["completion_mask"])
            sft_loss = -(sums / lengths)[desirable].mean()
            self._metrics["train" if self.model.training else "eval"]["sft_loss"].append(sft_loss.item())
            extra = self.ftx * sft_loss * len(desirable) / desirable.sum()
            return (result[0] + extra, *result[1:]) if isinstance(result, tuple) else result + extra

    return (FeedbackTrainer, lambda args: _trl_arguments(KTOConfig, args, **keys),
            {"ref_model": _reference(cfg, tokenizer, model_loader), "logprob_head": logprob_head(cfg),
             "ftx": cfg.pref_ftx})  # fmt: skip


@contextlib.contextmanager
def _policy_log_probs(model, input_ids):
    """Yields a list that gets the per-token log-probs of the first fused-head call of `model` on `input_ids` (the
    policy's forward, made before the reference's): a forward hook, as TRL keeps them inside its loss."""
    found = []

    def keep(module, args, kwargs, output):
        if kwargs.get("fused_lm_head") and kwargs.get("input_ids") is input_ids and not found:
            found.append(output.log_probs)

    handle = model.register_forward_hook(keep, with_kwargs=True)
    try:
        yield found
    finally:
        handle.remove()


def answer_log_probs(log_probs, completion_mask):
    """(sum of each answer's per-token log-probs, its number of tokens, at least 1) from a fused head's
    `log_probs` [batch, seq - 1] and the batch's `completion_mask` [batch, seq]."""
    mask = completion_mask[:, 1:]
    return (log_probs[:, -mask.size(1) :] * mask).sum(1), mask.sum(1).clamp(min=1)


@dataclass(frozen=True)
class LogprobHead:
    """How tiletune's head computes the log-probs: `linear_logprobs`' implementation and strictness, and whether
    each DPO pair's prompt runs once (`pref_shared_prompt`, train/shared_prompt.py)."""

    impl: str
    strict: bool = False
    shared_prompt: bool = False


def logprob_head(cfg: TuneConfig) -> LogprobHead | None:
    """tiletune's log-prob head when `kernels:` selects `linear_logprobs` (`all` does) or `pref_shared_prompt` is on
    (then with the op's default implementation unless `kernels:` names one), else None: TRL's fused head."""
    from tiletune.kernels.registry import default_impl
    from tiletune.patch import parse_kernel_spec

    spec = parse_kernel_spec(cfg.kernels) if cfg.kernels is not None else None
    selected = next((sel for sel in spec.ops if sel.op == "linear_logprobs"), None) if spec else None
    shared = cfg.stage == "dpo" and cfg.pref_shared_prompt
    if selected is None and not shared:
        return None
    impl = selected.impl if selected else default_impl("linear_logprobs")
    return LogprobHead(impl, bool(spec and spec.strict), shared)


def add_logprob_head(model, head: LogprobHead) -> None:
    """Make `model(..., labels=labels, fused_lm_head=True)`, how TRL's DPO and KTO trainers get every log-prob
    (policy, reference, KL answers, precomputed reference), run tiletune's `linear_logprobs` on the backbone's last
    hidden states instead of TRL's fused LM head, each pair's prompt once with `head.shared_prompt`; other calls
    (and MoE router losses, pre-shifted labels) go to the forward it replaces. Idempotent."""
    from trl.trainer.utils import FusedCausalLMOutput

    if getattr(model, "_tiletune_logprob_head", False):
        return
    current = model.forward
    shareable = head.shared_prompt and _prepare_shared_prompt(model)

    @functools.wraps(type(model).forward)  # generate validates its keywords against the signature
    def forward(self, *args, fused_lm_head=False, labels=None, **kwargs):
        if not fused_lm_head or "shift_labels" in kwargs or kwargs.get("output_router_logits"):
            return current(*args, fused_lm_head=fused_lm_head, labels=labels, **kwargs)
        kwargs.pop("num_items_in_batch", None)
        logp, stats, mask = fused_label_log_probs(self, labels, head, shareable, *args, **kwargs)
        entropy, mean_logits, is_top1 = stats.unbind(-1)
        return FusedCausalLMOutput(loss=-logp.sum() / mask.sum().clamp(min=1), log_probs=logp, entropy=entropy,
                                   mean_logits=mean_logits, is_top1=is_top1.bool(), label_mask=mask)  # fmt: skip

    model.forward = types.MethodType(forward, model)
    model._tiletune_logprob_head = True


def _prepare_shared_prompt(model) -> bool:
    """Set the model up to run pairs with one prompt (SDPA through `use_pair_attention`) and say whether it can; if
    not, the reason noted once."""
    from tiletune.kernels.registry import note_fallback
    from tiletune.train.shared_prompt import unshareable, use_pair_attention

    reason = unshareable(model.config)
    if reason:
        note_fallback("pref_shared_prompt", "shared", reason)
    else:
        use_pair_attention(model)
    return reason is None


def fused_label_log_probs(causal_lm, labels, head: LogprobHead, shareable: bool, *args, **kwargs):
    """(log-probs [batch, seq - 1] of the next-token labels, their [batch, seq - 1, 3] statistics, the label mask)
    from `linear_logprobs` on the backbone's last hidden states (`args`, `kwargs`: the backbone's inputs); 0 where
    the label is -100. The logits never exist. With `shareable`, a [chosen; rejected] batch runs each pair's prompt
    once (train/shared_prompt.py)."""
    from tiletune.kernels.binding import head_weight
    from tiletune.kernels.linear_logprobs import linear_logprobs
    from tiletune.kernels.registry import note_fallback
    from tiletune.train.shared_prompt import pair_layout, shared_log_probs

    softcap = float(getattr(causal_lm.config.get_text_config(), "final_logit_softcapping", None) or 0.0)
    output = causal_lm.get_output_embeddings()
    fetched: list[torch.Tensor] = []  # the weight, fetched once when the backbone has run (it may wait on the host)

    def lm_head(hidden, targets):
        if not fetched:
            fetched.append(head_weight(output))
        weight = fetched[0]
        return linear_logprobs(hidden.to(weight.device), weight, targets.to(weight.device), head.impl, head.strict, softcap)

    if shareable:
        extra = sorted(key for key, value in kwargs.items()  # peft passes the ones it does not use as None
                       if value is not None and key not in ("input_ids", "attention_mask", "use_cache", "return_dict"))
        layout = (f"arguments {', '.join(extra) or 'by position'}" if extra or args
                  else pair_layout(kwargs["input_ids"], kwargs.get("attention_mask"), labels))  # fmt: skip
        if not isinstance(layout, str):
            logp, stats = shared_log_probs(causal_lm, layout, labels.shape[1], lm_head)
            return logp, stats, labels[:, 1:].to(logp.device) != -100
        note_fallback("pref_shared_prompt", "shared", layout)
    hidden = causal_lm.base_model(*args, **{**kwargs, "use_cache": False}).last_hidden_state[:, :-1]
    labels = labels[:, 1:].to(hidden.device)
    logp, stats = lm_head(hidden.reshape(-1, hidden.size(-1)), labels.reshape(-1))
    return logp.view(labels.shape), stats.view(*labels.shape, -1), labels != -100


def label_log_probs(logits, labels):
    """(log-probs [batch, seq - 1] of the next-token labels, the label mask) from the whole logits, in float32 at
    least: their log-softmax over the vocabulary, gathered (LLaMA-Factory's get_batch_logps); 0 where the label is
    -100. Also returns the log-softmax (for statistics)."""
    labels = labels[:, 1:]
    mask = labels != -100
    log_softmax = logits[:, :-1].to(torch.promote_types(logits.dtype, torch.float32)).log_softmax(-1)
    log_probs = log_softmax.gather(2, labels.clamp(min=0).unsqueeze(2)).squeeze(2) * mask
    return log_probs, mask, log_softmax


class _TokenisedData:
    """For a TRL trainer: data tiletune has tokenised with the template; with LoRA, the reference is the base;
    with `logprob_head` (a LogprobHead) the log-probs come from `linear_logprobs`."""

    def __init__(self, *args, logprob_head: LogprobHead | None, **kwargs):
        self.logprob_head = logprob_head
        super().__init__(*args, **kwargs)
        model = self.accelerator.unwrap_model(self.model)
        if "ref" in getattr(model, "peft_config", {}):  # TRL's copy of the adapter: the reference is the adapter disabled
            model.delete_adapter("ref")
        self._add_logprob_heads()

    def head_targets(self) -> list:
        """The models whose LM head gives the log-probs: the policy (the base model under PEFT, where TRL puts its
        own head) and the reference model, when there is one."""
        model = self.accelerator.unwrap_model(self.model)
        policy = model.get_base_model() if hasattr(model, "get_base_model") else model
        return [target for target in (policy, self.ref_model) if target is not None]

    def _add_logprob_heads(self):
        """tiletune's head over TRL's on `head_targets()`."""
        if self.logprob_head is None:
            return
        for target in self.head_targets():
            add_logprob_head(target, self.logprob_head)

    def _precompute_ref_logps(self, *args, **kwargs):
        self._add_logprob_heads()  # TRL precomputes in its __init__, after adding its heads
        return super()._precompute_ref_logps(*args, **kwargs)

    def _prepare_dataset(self, dataset, processing_class, args, dataset_name):
        return dataset


def pair_losses(pref: PrefLoss, settings, ftx: float, sums, lengths, ref_sums=None):
    """LLaMA-Factory's per-pair losses from the answers' summed log-probs `sums` and token counts `lengths` (chosen
    answers first, then rejected), and the reference's sums (None: a loss without reference). `settings` carries
    beta, label_smoothing and simpo_gamma. Returns (losses, the chosen answers' average NLL, (chosen, rejected,
    ref chosen, ref rejected) as the loss compares them: per-token averages where `pref.average`)."""
    scale = lengths if pref.average else torch.ones_like(lengths)
    chosen, rejected = (sums / scale).chunk(2)
    if ref_sums is None:
        ref_chosen = ref_rejected = torch.zeros_like(chosen)
    else:
        ref_chosen, ref_rejected = (ref_sums / scale).chunk(2)
    sft_loss = -(sums / lengths).chunk(2)[0]
    losses = pref.per_sequence(settings, chosen, rejected, ref_chosen, ref_rejected) + ftx * sft_loss
    return losses, sft_loss, (chosen, rejected, ref_chosen, ref_rejected)


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
            sums, lengths = self._answers_forward(model, inputs)
            ref_sums = None
            if self.pref.reference:
                if self.precompute_ref_logps:
                    ref = (inputs["ref_chosen_logps"], inputs["ref_rejected_logps"])
                else:
                    ref = self.compute_ref_log_probs(self.ref_model if self.ref_model is not None else model, inputs)
                ref_sums = torch.cat(ref)
            losses, sft_loss, (chosen, rejected, ref_chosen, ref_rejected) = pair_losses(
                self.pref, self, self.ftx, sums, lengths, ref_sums)
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

        def _answers_forward(self, model, inputs):
            """The answers' summed log-probs and lengths (chosen answers first) from one fused-head forward."""
            labels = inputs["input_ids"].masked_fill(inputs["completion_mask"] == 0, -100)
            outputs = model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"], labels=labels,
                            use_cache=False, fused_lm_head=True)  # fmt: skip
            return answer_log_probs(outputs.log_probs, inputs["completion_mask"])

        def train(self, *args, **kwargs):
            result = super().train(*args, **kwargs)
            if self.eval_dataset is not None and self.pref.reference and self.is_world_process_zero():
                before, after, pairs = self.held_out_accuracy()
                print(f"held-out preference accuracy on {pairs} eval pairs: before training {before:.2f} (the "
                      f"reference prefers the chosen answer: log p(chosen) > log p(rejected)), after training "
                      f"{after:.2f} (the policy's implicit reward: log-ratio to the reference of chosen > of rejected)")  # fmt: skip
            return result

        @torch.no_grad()
        def held_out_accuracy(self) -> tuple[float, float, int]:
            """(share of eval pairs the reference prefers the chosen answer of, share the trained policy's implicit
            DPO reward does, number of pairs). With LoRA the reference is the base model."""
            model = self.model.eval()
            before = after = pairs = 0
            for batch in self.get_eval_dataloader():
                batch = self._prepare_inputs(batch)
                chosen, rejected = self._answers_forward(model, batch)[0].chunk(2)
                if self.precompute_ref_logps:
                    ref_chosen, ref_rejected = batch["ref_chosen_logps"], batch["ref_rejected_logps"]
                else:
                    reference = self.ref_model if self.ref_model is not None else model
                    ref_chosen, ref_rejected = self.compute_ref_log_probs(reference, batch)
                before += int((ref_chosen > ref_rejected).sum())
                after += int((chosen - ref_chosen > rejected - ref_rejected).sum())
                pairs += len(chosen)
            return before / max(pairs, 1), after / max(pairs, 1), pairs

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
