"""Rows -> batches for the Trainer: padded examples, or packed sequences (`packing`, `neat_packing`).

Packed sequences come from data/processing.py with per-example `position_ids`. How their examples see
each other:

- `neat_packing`: padding-free. A batch's sequences are flattened into one row of all their tokens with
  no attention mask. transformers reads the examples off the position ids (each starts again at 0) and
  masks each off from the others: a block-diagonal causal mask for sdpa and eager
  (`masking_utils.find_packed_sequence_indices`, only when the attention mask is None and no cache is
  used), flash-attention's varlen kernel on the `cu_seq_lens_q/k` given with the batch. Every token's loss
  is the unpacked one.
- `packing` alone: LLaMA-Factory's plain packing. One row per packed sequence, right-padded, with a 0/1
  attention mask: an example attends to the examples before it in its sequence (causal over the whole
  sequence) while its rotary positions start again at 0, as LLaMA-Factory feeds them.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from tiletune.config import TuneConfig
from tiletune.data.processing import IGNORE_INDEX, packing_enabled


def data_collator(cfg: TuneConfig, tokenizer):
    """The collator for cfg's training and evaluation rows."""
    pad_to_multiple_of = 8 if torch.cuda.is_available() else None
    if cfg.stage == "sft" and packing_enabled(cfg):
        return PackedCollator(cfg.neat_packing, tokenizer.pad_token_id, pad_to_multiple_of)
    from transformers import DataCollatorForSeq2Seq

    return DataCollatorForSeq2Seq(
        tokenizer,
        pad_to_multiple_of=pad_to_multiple_of,
        label_pad_token_id=IGNORE_INDEX if cfg.ignore_pad_token_for_loss else tokenizer.pad_token_id,
    )


@dataclass
class PackedCollator:
    """Batches of packed sequences: flattened (`neat`) or padded rows (see the module's docstring)."""

    neat: bool
    pad_token_id: int
    pad_to_multiple_of: int | None = None

    def __call__(self, features: list[dict]) -> dict:
        return self.flatten(features) if self.neat else self.pad(features)

    def flatten(self, features: list[dict]) -> dict:
        """One row [1, tokens], no attention mask, the examples' boundaries for flash-attention varlen."""
        batch = {key: torch.tensor([list(itertools.chain.from_iterable(f[key] for f in features))])
                 for key in ("input_ids", "labels", "position_ids")}  # fmt: skip
        starts = torch.nonzero(batch["position_ids"][0] == 0).flatten()
        lengths = torch.diff(starts, append=torch.tensor([batch["input_ids"].shape[1]]))
        cu_seq_lens = torch.nn.functional.pad(torch.cumsum(lengths, 0), (1, 0)).to(torch.int32)
        longest = int(lengths.max())
        # use_cache=False: with a cache, transformers would not look for packed sequences in the position ids
        return {**batch, "cu_seq_lens_q": cu_seq_lens, "cu_seq_lens_k": cu_seq_lens, "max_length_q": longest,
                "max_length_k": longest, "use_cache": False}  # fmt: skip

    def pad(self, features: list[dict]) -> dict:
        """One right-padded row per sequence with its attention mask (which also keeps transformers from
        splitting the sequence at its position ids)."""
        longest = max(len(f["input_ids"]) for f in features)
        if self.pad_to_multiple_of:
            longest = -(-longest // self.pad_to_multiple_of) * self.pad_to_multiple_of

        def padded(key: str, value: int) -> torch.Tensor:
            return torch.tensor([f[key] + [value] * (longest - len(f[key])) for f in features])

        return {
            "input_ids": padded("input_ids", self.pad_token_id),
            "attention_mask": padded("attention_mask", 0),
            "labels": padded("labels", IGNORE_INDEX),
            "position_ids": padded("position_ids", 0),
        }
