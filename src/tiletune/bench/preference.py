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

`liger_fused` is what a user who picks Liger-Kernel for preference training runs: Liger's layer kernels (as
`liger`) and, in place of the trainer's loss, Liger's fused linear preference loss (`liger_kernel.chunked_loss`,
checked with 0.8.5): the policy and the reference (the base with the adapter disabled, or `ref_model`) run forward
to their last hidden states, and Liger's loss module takes those with the LM head's weight, a chunk of pairs at a
time, so the logits never exist whole. The config's loss maps onto Liger's: pref_loss sigmoid / hinge ->
LigerFusedLinearDPOLoss(loss_type=...), simpo -> LigerFusedLinearSimPOLoss(gamma=simpo_gamma), orpo ->
LigerFusedLinearORPOLoss (its NLL term is LLaMA-Factory's `-chosen` part of orpo), kto ->
LigerFusedLinearKTOLoss (the KL term's log-probs from TRL's fused head without gradient, as TRL computes them);
beta = pref_beta, pref_ftx -> compute_nll_loss with alpha = pref_ftx. Liger averages the NLL over the chosen answers'
tokens, LLaMA-Factory over each answer and then the pairs: the same where the answers have one length, as bench's
rows do. What Liger has no equivalent for is refused with the missing piece named (`liger_fused_refusal`): ipo,
dpo_label_smoothing (Liger's sigmoid ignores it), pref_ftx with orpo or kto, KTO's desirable/undesirable weights,
precomputed reference log-probs, an adapted or soft-capped LM head, MoE router aux losses. tests/bench checks that
the loss and the gradients are the stage's own on the same batch for each loss it takes.
"""

from __future__ import annotations

import contextlib
import functools
import shutil
import tempfile
import types
import weakref
from collections.abc import Callable

import torch

from tiletune.config import TuneConfig

STAGES = ("dpo", "kto")  # the stages bench times this way (rm has no reference and no log-prob head)
LIGER_FUSED = "liger_fused"  # Liger-Kernel's layer kernels and its fused linear preference loss


def bench_tokenizer():
    """A two-token tokenizer: the trainers read only its pad and eos ids (the rows are tokenised already)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(WordLevel({"<pad>": 0, "<eos>": 1}, unk_token="<pad>"))
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>")


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
    if variant == LIGER_FUSED:
        add_liger_fused_loss(trainer, cfg, compiled=next(model.parameters()).device.type == "cuda")
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


def liger_fused_refusal(cfg: TuneConfig) -> str | None:
    """Why Liger-Kernel's fused linear preference losses (0.8.5) cannot compute this config's stage loss, in one
    line naming what Liger lacks; None when they compute the same loss (bench must not time a different one)."""
    from tiletune.train.preference import PREF_LOSSES

    if cfg.stage not in STAGES:
        return f"Liger's fused preference losses need stage {' or '.join(STAGES)} (this config's stage is {cfg.stage})"
    if cfg.stage == "kto":
        if cfg.pref_ftx:
            return f"Liger's KTO loss has no SFT term: pref_ftx={cfg.pref_ftx} has no equivalent (set pref_ftx: 0)"
        if (cfg.kto_chosen_weight, cfg.kto_rejected_weight) != (1.0, 1.0):
            return ("Liger's KTO loss has no desirable/undesirable weights: kto_chosen_weight="
                    f"{cfg.kto_chosen_weight}, kto_rejected_weight={cfg.kto_rejected_weight} have no equivalent (set both 1)")  # fmt: skip
    elif cfg.pref_loss == "ipo":
        return ("Liger's DPO loss has no ipo: liger-kernel 0.8.5's loss_type='ipo' raises NotImplementedError (no "
                "per-answer token counts to average the margin over)")  # fmt: skip
    elif cfg.pref_loss == "sigmoid" and cfg.dpo_label_smoothing:
        return (f"Liger's DPO sigmoid loss has no label smoothing: dpo_label_smoothing={cfg.dpo_label_smoothing} "
                "(conservative DPO) has no equivalent (its 'robust' loss_type is another formula)")  # fmt: skip
    elif cfg.pref_loss == "orpo" and cfg.pref_ftx:
        return (f"Liger's ORPO loss weights its NLL term 1: pref_ftx={cfg.pref_ftx} (an extra SFT term) has no "
                "equivalent (set pref_ftx: 0)")  # fmt: skip
    uses_reference = cfg.stage == "kto" or PREF_LOSSES[cfg.pref_loss].reference
    if uses_reference and cfg.precompute_ref_log_probs:
        return ("Liger's fused losses take the reference's last hidden states: precompute_ref_log_probs=true (the "
                "reference's log-probs computed before training) has no equivalent")  # fmt: skip
    return None


def liger_fused_loss(cfg: TuneConfig, compiled: bool):
    """Liger-Kernel's fused linear loss module computing the config's stage loss (see the module's docstring)."""
    import liger_kernel.chunked_loss as liger

    if cfg.stage == "kto":
        return liger.LigerFusedLinearKTOLoss(beta=cfg.pref_beta, compiled=compiled, use_ref_model=True)
    nll = {"compute_nll_loss": bool(cfg.pref_ftx), "alpha": cfg.pref_ftx}
    if cfg.pref_loss in ("sigmoid", "hinge"):
        return liger.LigerFusedLinearDPOLoss(beta=cfg.pref_beta, compiled=compiled, use_ref_model=True,
                                             loss_type=cfg.pref_loss, **nll)  # fmt: skip
    if cfg.pref_loss == "simpo":
        return liger.LigerFusedLinearSimPOLoss(beta=cfg.pref_beta, gamma=cfg.simpo_gamma, compiled=compiled, **nll)
    return liger.LigerFusedLinearORPOLoss(beta=cfg.pref_beta, compiled=compiled)  # its NLL term: orpo's -chosen


def add_liger_fused_loss(trainer, cfg: TuneConfig, compiled: bool) -> None:
    """Make `trainer`'s loss Liger-Kernel's fused linear preference loss for the config's stage: the policy's and
    the reference's last hidden states and LM head weights into `liger_fused_loss(cfg)`; KTO's KL term from TRL's
    fused head without gradient (`_compute_kl_logps`, as the stage). UserError where the loss would not be the
    stage's (`liger_fused_refusal`, and the model-side limits checked here)."""
    from trl.models.utils import disable_gradient_checkpointing
    from trl.trainer.utils import use_adapter

    from tiletune.errors import UserError

    def refuse(why: str):
        raise UserError(f"bench variant {LIGER_FUSED!r}: {why}")

    why = liger_fused_refusal(cfg)
    if why:
        refuse(why)
    policy = trainer.head_targets()[0]
    reference = trainer.ref_model  # None: the policy with its adapter disabled (or no reference: orpo, simpo)
    for model in (policy, reference):
        if model is None:
            continue
        head = model.get_output_embeddings()
        if type(head) is not torch.nn.Linear:
            refuse(f"Liger's fused losses take the LM head's weight: this head is a {type(head).__name__} "
                   "(adapted or quantized), whose output its weight alone does not give")  # fmt: skip
        if getattr(model.config.get_text_config(), "final_logit_softcapping", None):
            refuse("Liger's fused preference losses have no logit soft-capping (final_logit_softcapping)")
    if trainer.aux_loss_enabled:
        refuse("Liger's fused losses take the last hidden states only: the MoE router's aux loss, which the stage adds, "
               "has no place in them")  # fmt: skip
    loss_fn = liger_fused_loss(cfg, compiled)
    use_reference = cfg.stage == "kto" or trainer.pref.reference  # orpo and simpo have none

    @contextlib.contextmanager
    def reference_forward():
        """Yields the reference causal LM (the policy with its adapter disabled when there is no ref_model),
        without gradient, as TRL runs the reference."""
        unwrapped = trainer.accelerator.unwrap_model(trainer.model)
        adapter = use_adapter(unwrapped, None) if reference is None else contextlib.nullcontext()
        with torch.no_grad(), disable_gradient_checkpointing(trainer.model, trainer.args.gradient_checkpointing_kwargs), \
                adapter:  # fmt: skip
            yield policy if reference is None else reference

    def hidden(causal_lm, inputs):
        """The last hidden states before each next-token label (all but the last position)."""
        out = causal_lm.base_model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"], use_cache=False)
        return out.last_hidden_state[:, :-1]

    def compute_loss(self, model, inputs, return_outputs):
        head = policy.get_output_embeddings()
        target = inputs["input_ids"].masked_fill(inputs["completion_mask"] == 0, -100)[:, 1:]
        kl = ref_hidden = ref_head = None
        if cfg.stage == "kto" and self.calculate_KL:
            kl_logps = self._compute_kl_logps(model, inputs)
        if use_reference:
            with reference_forward() as ref_lm:
                ref_hidden, ref_head = hidden(ref_lm, inputs), ref_lm.get_output_embeddings()
                if cfg.stage == "kto" and self.calculate_KL:
                    ref_kl_logps = self._compute_kl_logps(model if reference is None else reference, inputs)
                    kl = (kl_logps - ref_kl_logps).mean().detach().clamp(min=0)
        ref = {} if ref_head is None else {"ref_input": ref_hidden, "ref_weight": ref_head.weight, "ref_bias": ref_head.bias}
        if cfg.stage == "kto":
            labels = torch.as_tensor(inputs["label"], dtype=torch.bool, device=target.device)
            out = loss_fn(hidden(policy, inputs), head.weight, target, head.bias, preference_labels=labels, kl=kl, **ref)
        else:
            out = loss_fn(head.weight, hidden(policy, inputs), target, head.bias, **ref)
        return (out[0], None) if return_outputs else out[0]

    trainer._compute_loss = types.MethodType(compute_loss, trainer)
