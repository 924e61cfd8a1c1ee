"""The training side: model loading and LoRA set-up, the Trainer run and its outputs, checkpointing plans
(recompute, offload), prediction, export, chat, launching, and LLaMA-Factory's own training."""
