"""The training step of a preference stage (`stage: dpo`, `stage: kto`) for `tiletune bench`.

The stage's trainer is built as `tiletune train` builds it (TRL's DPOTrainer / KTOTrainer with LLaMA-Factory's
losses, the reference being the base model with the LoRA adapter disabled) on a fixed batch of random examples:
each prompt half the sequence, each answer the other half (DPO: `batch` pairs, chosen and rejected; KTO: `batch`
answers, desirable and undesirable in turn, each with its KL answer). A step is the trainer's own training_step
(policy forward on every sequence, reference forward without gradient, loss, backward).

Where each sequence's log-probs come from is the variant's business: TRL's fused LM head (`baseline`, `liger`), a
kernel set with tiletune's `linear_logprobs` (`all` selects it), or `llamafactory`: LLaMA-Factory's own
`get_batch_logps`, which takes the whole [sequences, tokens, vocab] logits in float32 and their log-softmax
(CustomDPOTrainer.concatenated_forward; LLaMA-Factory pins TRL <= 0.24, which has no fused head).
"""

from __future__ import annotations

import functools
import shutil
import tempfile
import types
import weakref
from collections.abc import Callable

import torch

from tiletune.config import TuneConfig

STAGES = ("dpo", "kto")  # the stages bench times this way (rm has no reference and no log-prob head)


def bench_tokenizer():
    """A two-token tokenizer: the trainers read only its pad and eos ids (the rows are tokenised already)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(WordLevel({"<pad>": 0, "<eos>": 1}, unk_token="<pad>"))
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>")


def sequences(cfg: TuneConfig) -> tuple[int, int]:
    """(sequences trained, sequences run forward only) per example of a step: DPO trains chosen and rejected and
    runs both through the reference (none for orpo and simpo); KTO trains the answer and runs its KL answer
    through the policy without gradient and both through the reference."""
    from tiletune.train.preference import PREF_LOSSES

    if cfg.stage == "kto":
        return 1, 3
    return 2, 2 if PREF_LOSSES[cfg.pref_loss].reference else 0


def preference_step(cfg: TuneConfig, model, variant: str, batch: int, seq: int, seed: int,
                    autocast: Callable) -> Callable[[], torch.Tensor]:  # fmt: skip
    """forward + backward of one preference step on a fixed batch, the forward under `autocast()` (the caller
    steps the optimizer); the returned function gives the loss."""
    from datasets import Dataset

    from tiletune.data.processing import random_rows
    from tiletune.train.model import load_model
    from tiletune.train.preference import preference_stage
    from tiletune.train.trainer import training_arguments

    tokenizer = bench_tokenizer()
    trainer_class, arguments, stage_kwargs = preference_stage(cfg, model, tokenizer, load_model)
    scratch = tempfile.mkdtemp(prefix="tiletune-bench-")  # the Trainer wants an output folder; nothing is saved
    args = arguments(training_arguments(cfg, scratch, model))
    args.per_device_train_batch_size = batch
    rows = random_rows(cfg.stage, batch, seq, model.config.vocab_size, seed)
    trainer = trainer_class(model=model, args=args, train_dataset=Dataset.from_dict(rows), processing_class=tokenizer,
                            **stage_kwargs)  # fmt: skip
    weakref.finalize(trainer, shutil.rmtree, scratch, True)
    if variant == "llamafactory":
        for target in trainer.head_targets():
            add_full_logits_head(target)
    trainer.autocast_smart_context_manager = lambda cache_enabled=True: autocast()  # the Trainer's autocast hook
    trainer.current_gradient_accumulation_steps = 1  # what train() sets: one micro-batch per step
    inputs = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
    return lambda: trainer.training_step(trainer.model, inputs)


def add_full_logits_head(model) -> None:
    """`model(..., labels=labels, fused_lm_head=True)` as LLaMA-Factory computes log-probs: the model's whole logits
    in float32, their log-softmax over the vocabulary, the labels' entries gathered. TRL's metrics (entropy, mean
    logit, top-1) are read off the same tensors without gradient, a row at a time."""
    from trl.trainer.utils import FusedCausalLMOutput

    from tiletune.train.preference import label_log_probs

    current = model.forward

    @functools.wraps(type(model).forward)
    def forward(self, *args, fused_lm_head=False, labels=None, **kwargs):
        if not fused_lm_head:
            return current(*args, labels=labels, **kwargs)
        kwargs.pop("num_items_in_batch", None)
        logits = current(*args, **kwargs).logits
        log_probs, mask, log_softmax = label_log_probs(logits, labels)
        with torch.no_grad():
            entropy = torch.stack([-(row.exp() * row).sum(-1) for row in log_softmax]) * mask
            is_top1 = (log_softmax.argmax(-1) == labels[:, 1:]) & mask
            mean_logits = logits[:, :-1].float().mean(-1) * mask
        return FusedCausalLMOutput(loss=-log_probs.sum() / mask.sum().clamp(min=1), log_probs=log_probs,
                                   entropy=entropy, mean_logits=mean_logits, is_top1=is_top1, label_mask=mask)  # fmt: skip

    model.forward = types.MethodType(forward, model)
