"""Token ids and loss masks for training and prediction, and the train/eval/predict splits.

Supervised (`sft`): each turn is (prompt, response); prompts are masked from the loss with -100 unless
`train_on_prompt`; `mask_history` keeps only the last turn's response in the loss. A conversation
longer than `cutoff_len` is cut turn by turn, each turn sharing its budget between prompt and response
in proportion to their lengths (the response keeps its length when it is short), as LLaMA-Factory does.
Pre-training (`pt`): texts + EOS are concatenated and cut into blocks of `cutoff_len` (`packing`).
Pairwise (`dpo`, `rm`; ranking datasets): prompt_ids, chosen_ids and rejected_ids (TRL's preference columns), the
prompt's turns encoded with the chosen answer; the answers keep their length first, the longer one sharing
`cutoff_len` with the prompt as a supervised turn does (LLaMA-Factory's PairwiseDatasetProcessor).
Feedback (`kto`; a `kto_tag` column): prompt_ids, completion_ids, label (the tag) and KL_completion_ids, the
answers of the preprocessing batch in reverse order (mismatched answers for KTO's KL term; FeedbackDatasetProcessor).

Supervised packing (`packing`, `neat_packing`), as LLaMA-Factory packs: the encoded examples of each
`preprocessing_batch_size` batch go greedily, longest first, into sequences of at most `cutoff_len` tokens.
A packed sequence keeps per-example `position_ids` (0, 1, ... for each example) and the label of each
example's first token is -100, so the tokens in the loss are those of the unpacked examples and none is
predicted from the previous example's last token. Whether the examples of a sequence see each other is
the collator's choice (data/collator.py).
"""

from __future__ import annotations

import bisect
import functools
import itertools
import logging
from dataclasses import dataclass
from typing import Any

import torch
from transformers.utils import logging as transformers_logging

from tiletune.config import TuneConfig
from tiletune.data.loader import (
    cache_fingerprint,
    load_raw,
    normalise,
    resolve_datasets,
)
from tiletune.data.templates import ASSISTANT, Template
from tiletune.data.tools import tool_prompt_date
from tiletune.errors import UserError

IGNORE_INDEX = -100
DATA_KINDS = {  # what a stage's records hold: the column that tells, and how to name it in a message
    "ranking": ("chosen", "a ranking dataset (ranking: true in dataset_info.json, with chosen and rejected columns)"),
    "feedback": ("kto_tag", "a feedback dataset (a kto_tag column in dataset_info.json)"),
    "plain": (None, "a dataset without ranking or kto_tag"),
}
STAGE_DATA = {"dpo": "ranking", "rm": "ranking", "kto": "feedback"}  # other stages: plain
log = logging.getLogger(__name__)


def split_budget(prompt_len: int, response_len: int, budget: int) -> tuple[int, int]:
    """How many prompt and response tokens of one turn fit in `budget` tokens."""
    if response_len * 2 < budget:
        response_cap = budget
    elif prompt_len * 2 < budget:
        response_cap = budget - prompt_len
    else:
        response_cap = int(budget * response_len / (prompt_len + response_len))
    response_keep = min(response_cap, response_len)
    prompt_keep = min(max(budget - response_keep, 0), prompt_len)
    return prompt_keep, response_keep


def encode_supervised(pairs, cutoff_len: int, train_on_prompt: bool, mask_history: bool) -> dict[str, list[int]]:
    """input_ids and labels of one conversation given its (prompt_ids, response_ids) turns."""
    input_ids: list[int] = []
    labels: list[int] = []
    ordered = list(reversed(pairs)) if mask_history else pairs
    for turn, (prompt, response) in enumerate(ordered):
        room = cutoff_len - len(input_ids)
        if room <= 0:
            break
        keep_prompt, keep_response = split_budget(len(prompt), len(response), room)
        prompt, response = prompt[:keep_prompt], response[:keep_response]
        prompt_labels = prompt if train_on_prompt else [IGNORE_INDEX] * len(prompt)
        response_labels = [IGNORE_INDEX] * len(response) if mask_history and turn > 0 else response
        if mask_history:  # turns were reversed: put this (earlier) turn in front
            input_ids = prompt + response + input_ids
            labels = prompt_labels + response_labels + labels
        else:
            input_ids += prompt + response
            labels += prompt_labels + response_labels
    return {"input_ids": input_ids, "attention_mask": [1] * len(input_ids), "labels": labels}


def encode_pairwise(prompt: list[int], chosen: list[int], rejected: list[int], cutoff_len: int) -> dict[str, list[int]]:
    """One preference example: the prompt and both answers cut so that prompt + the longer answer fit `cutoff_len`."""
    keep_prompt, keep_answer = split_budget(len(prompt), max(len(chosen), len(rejected)), cutoff_len)
    return {"prompt_ids": prompt[:keep_prompt], "chosen_ids": chosen[:keep_answer], "rejected_ids": rejected[:keep_answer]}


def example_ids(row: dict) -> list[int]:
    """The token ids of a tokenised row as the model reads it (pairwise: prompt + chosen answer; feedback: + its answer)."""
    if "input_ids" in row:
        return row["input_ids"]
    return row["prompt_ids"] + row["chosen_ids" if "chosen_ids" in row else "completion_ids"]


def packing_enabled(cfg: TuneConfig) -> bool:
    """LLaMA-Factory's rule: `packing` as set, on by default for `pt` only; `neat_packing` implies it."""
    return cfg.neat_packing or (cfg.packing if cfg.packing is not None else cfg.stage == "pt")


def greedy_knapsack(lengths: list[int], capacity: int) -> list[list[int]]:
    """Indices of `lengths` in bins of at most `capacity`, each bin filled with the longest item that still
    fits until none does (LLaMA-Factory's greedy_knapsack; equal lengths by index, so deterministic)."""
    if max(lengths, default=0) > capacity:
        raise ValueError(f"an item of length {max(lengths)} does not fit in a bin of {capacity}")
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    sizes = [lengths[i] for i in order]
    bins = []
    while order:
        room, members = capacity, []
        while (fits := bisect.bisect_right(sizes, room)) > 0:
            room -= sizes.pop(fits - 1)
            members.append(order.pop(fits - 1))
        bins.append(members)
    return bins


def pack_supervised(batch: dict[str, list], cutoff_len: int) -> dict[str, list]:
    """Encoded examples (input_ids, labels) -> packed sequences with per-example position ids (and an
    attention mask of ones, as every row has)."""
    packed: dict[str, list] = {"input_ids": [], "attention_mask": [], "labels": [], "position_ids": []}
    for members in greedy_knapsack([len(ids) for ids in batch["input_ids"]], cutoff_len):
        input_ids, labels, position_ids = [], [], []
        for i in members:
            input_ids += batch["input_ids"][i]
            labels += [IGNORE_INDEX] + batch["labels"][i][1:]  # the first token has no prediction of its own
            position_ids += range(len(batch["input_ids"][i]))
        packed["input_ids"].append(input_ids)
        packed["attention_mask"].append([1] * len(input_ids))
        packed["labels"].append(labels)
        packed["position_ids"].append(position_ids)
    return packed


@dataclass
class DataSplits:
    """What the trainer and the predictor consume, plus counts for the run summary."""

    train: Any = None
    eval: Any = None
    predict: Any = None  # prompts only, answers in `labels`, for generation
    stats: dict[str, int] | None = None


def build_splits(cfg: TuneConfig, tokenizer, template: Template) -> DataSplits:
    """Load, normalise and tokenise the config's datasets into train / eval / predict splits."""
    seed = cfg.train_arg("seed", 42)
    train_raw = _load_all(cfg, cfg.dataset, seed) if cfg.dataset else None
    eval_raw = _load_all(cfg, cfg.eval_dataset, seed) if cfg.eval_dataset else None
    if eval_raw is not None and cfg.val_size:
        raise UserError("set either eval_dataset or val_size, not both")
    if train_raw is not None and cfg.val_size:
        test_size = int(cfg.val_size) if cfg.val_size >= 1 else cfg.val_size
        if (test_size if isinstance(test_size, int) else int(test_size * len(train_raw))) < 1:
            raise UserError(f"val_size={cfg.val_size} leaves no validation sample out of {len(train_raw)}")
        parts = train_raw.train_test_split(test_size=test_size, seed=seed)
        train_raw, eval_raw = parts["train"], parts["test"]
    if eval_raw is None and cfg.train_arg("do_predict") and not cfg.train_arg("do_train"):
        eval_raw = train_raw  # prediction only, on the training set, as LLaMA-Factory does

    splits = DataSplits(stats={})
    if train_raw is not None:
        splits.train = _tokenise(cfg, tokenizer, template, train_raw, "train", splits.stats)
    if eval_raw is not None:
        splits.eval = _tokenise(cfg, tokenizer, template, eval_raw, "eval", splits.stats)
        if cfg.train_arg("do_predict") and cfg.stage == "sft":
            splits.predict = _prompts(cfg, tokenizer, template, eval_raw)
    return splits


def _load_all(cfg: TuneConfig, names: str, seed: int):
    import datasets

    parts = []
    for attr in resolve_datasets(names, cfg.dataset_dir):
        raw = load_raw(attr, cfg.cache_dir, cfg.overwrite_cache, cfg.hf_hub_token)
        if attr.num_samples:
            raw = _resample(raw, attr.num_samples, seed)
        if cfg.max_samples:
            raw = raw.select(range(min(cfg.max_samples, len(raw))))
        parts.append(normalise(raw, attr, cfg.preprocessing_num_workers, cfg.overwrite_cache))
    return parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)


def _resample(dataset, target: int, seed: int):
    """`target` records: a seeded permutation, repeated as needed (dataset_info's num_samples)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    order = np.concatenate([rng.permutation(len(dataset)) for _ in range(-(-target // len(dataset)))])
    return dataset.select(order[:target].tolist())


def _map(cfg: TuneConfig, dataset, function, desc: str, batched: bool = False):
    # Examples longer than the tokenizer's model_max_length are cut later, to cutoff_len: hush its warning.
    transformers_logging.get_logger("transformers.tokenization_utils_base").setLevel(logging.ERROR)
    workers = cfg.preprocessing_num_workers
    return dataset.map(
        function,
        batched=batched,
        batch_size=cfg.preprocessing_batch_size,
        remove_columns=dataset.column_names,
        num_proc=workers if workers and len(dataset) >= 2 * workers else None,
        load_from_cache_file=not cfg.overwrite_cache,
        new_fingerprint=cache_fingerprint(dataset, function),
        desc=desc,
    )


def _tokenise(cfg: TuneConfig, tokenizer, template: Template, raw, name: str, stats: dict[str, int]):
    """The split's rows; `stats` gets its example count (and with sft packing, its packed sequence count)."""
    kind = next(k for k, (column, _) in DATA_KINDS.items() if column is None or column in raw.column_names)
    needed = STAGE_DATA.get(cfg.stage, "plain")
    if kind != needed:
        raise UserError(f"stage {cfg.stage} needs {DATA_KINDS[needed][1]}; the {name} data is {DATA_KINDS[kind][1]}")
    if kind != "plain":
        encoder = _PairwiseEncoder if kind == "ranking" else _FeedbackEncoder
        encoded = _map(cfg, raw, encoder(cfg, tokenizer, template), f"Tokenising {name} ({kind})", batched=kind == "feedback")
        stats[f"{name}_examples"] = len(encoded)
        return encoded
    if cfg.stage == "pt":
        blocks = _map(cfg, raw, _PretrainEncoder(cfg, tokenizer), f"Tokenising {name} (packing)", batched=True)
        stats[f"{name}_examples"] = len(blocks)
        return blocks
    usable = raw.filter(_is_supervised, desc=f"Checking {name}")
    if len(usable) < len(raw):
        log.warning("%s: dropped %d examples without an answer", name, len(raw) - len(usable))
    if len(usable) == 0:
        raise UserError(f"the {name} data has no example with an answer; check the dataset's columns")
    encoded = _map(cfg, usable, _SupervisedEncoder(cfg, tokenizer, template), f"Tokenising {name}")
    encoded = encoded.filter(lambda ex: any(label != IGNORE_INDEX for label in ex["labels"]), desc="Dropping empty")
    stats[f"{name}_examples"] = len(encoded)
    if not packing_enabled(cfg):
        return encoded
    packed = _map(cfg, encoded, functools.partial(pack_supervised, cutoff_len=cfg.cutoff_len), f"Packing {name}",
                  batched=True)
    stats[f"{name}_sequences"] = len(packed)
    log.info("%s: packed %d examples into %d sequences of at most %d tokens (%.1f%% full)", name, len(encoded),
             len(packed), cfg.cutoff_len, 100 * _token_count(packed) / max(len(packed) * cfg.cutoff_len, 1))
    return packed


def _token_count(dataset) -> int:
    import pyarrow.compute as pc

    return pc.sum(pc.list_value_length(dataset.data.column("input_ids"))).as_py() or 0


def _is_supervised(example) -> bool:
    return len(example["messages"]) >= 2 and len(example["messages"]) % 2 == 0


class _SupervisedEncoder:
    def __init__(self, cfg: TuneConfig, tokenizer, template: Template):
        self.cfg, self.tokenizer, self.template = cfg, tokenizer, template
        # Part of the encoder's state, so of the datasets-cache key: a tool prompt that writes today's date is
        # tokenized again the next day instead of reusing yesterday's date from the cache.
        self.tool_prompt_date = tool_prompt_date(template.tool_format)

    def __call__(self, example):
        pairs = self.template.encode_pairs(
            self.tokenizer, example["messages"], example["system"], example["tools"], self.cfg.enable_thinking
        )
        return encode_supervised(pairs, self.cfg.cutoff_len, self.cfg.train_on_prompt, self.cfg.mask_history)


class _PairwiseEncoder(_SupervisedEncoder):
    def __call__(self, example):
        chosen, rejected = (
            self.template.encode_pairs(self.tokenizer, example["messages"] + [{"role": ASSISTANT, "content": answer}],
                                       example["system"], example["tools"], self.cfg.enable_thinking)
            for answer in (example["chosen"], example["rejected"])
        )
        prompt = [tok for p, r in chosen[:-1] for tok in p + r] + chosen[-1][0]
        return encode_pairwise(prompt, chosen[-1][1], rejected[-1][1], self.cfg.cutoff_len)


class _FeedbackEncoder(_SupervisedEncoder):
    def __call__(self, batch):
        prompts, completions = [], []
        for messages, system, tools in zip(batch["messages"], batch["system"], batch["tools"]):
            pairs = self.template.encode_pairs(self.tokenizer, messages, system, tools, self.cfg.enable_thinking)
            prompt = [tok for p, r in pairs[:-1] for tok in p + r] + pairs[-1][0]
            keep_prompt, keep_answer = split_budget(len(prompt), len(pairs[-1][1]), self.cfg.cutoff_len)
            prompts.append(prompt[:keep_prompt])
            completions.append(pairs[-1][1][:keep_answer])
        kl = [answer[: self.cfg.cutoff_len - len(prompt)] for prompt, answer in zip(prompts, completions[::-1])]
        return {"prompt_ids": prompts, "completion_ids": completions, "KL_completion_ids": kl, "label": batch["kto_tag"]}


class _PretrainEncoder:
    def __init__(self, cfg: TuneConfig, tokenizer):
        self.cutoff_len, self.tokenizer = cfg.cutoff_len, tokenizer
        self.pack = packing_enabled(cfg)

    def __call__(self, batch):
        eos = self.tokenizer.eos_token
        texts = [m[0]["content"] + eos for m in batch["messages"]]
        ids = self.tokenizer(texts, add_special_tokens=False)["input_ids"]
        if self.pack:
            stream = list(itertools.chain.from_iterable(ids))
            ids = [stream[i : i + self.cutoff_len] for i in range(0, len(stream), self.cutoff_len)]
        else:
            ids = [seq[: self.cutoff_len] for seq in ids]
        return {"input_ids": ids, "attention_mask": [[1] * len(s) for s in ids], "labels": [list(s) for s in ids]}


def _prompts(cfg: TuneConfig, tokenizer, template: Template, raw):
    """Prompt ids (all turns but the last answer) and the reference answer's text, for generation."""

    def encode(example):
        pairs = template.encode_pairs(
            tokenizer, example["messages"], example["system"], example["tools"], cfg.enable_thinking
        )
        prompt = [tok for p, r in pairs[:-1] for tok in p + r] + pairs[-1][0]
        return {
            "input_ids": prompt[-cfg.cutoff_len :],
            "prompt_text": example["messages"][-2]["content"],
            "reference": example["messages"][-1]["content"],
        }

    return _map(cfg, raw.filter(_is_supervised, desc="Checking predict"), encode, "Tokenising prompts")


def random_rows(stage: str, examples: int, seq: int, vocab: int, seed: int) -> dict[str, list]:
    """Columns of `examples` tokenised rows of `stage`'s data (dpo: pairwise; kto: feedback) of random token ids from
    `seed`: each prompt half of `seq`, each answer the rest; KTO's answers desirable and undesirable in turn."""
    generator = torch.Generator().manual_seed(seed)
    prompt_len = seq // 2

    def ids(length: int) -> list[list[int]]:
        return torch.randint(0, vocab, (examples, length), generator=generator).tolist()

    rows = {"prompt_ids": ids(prompt_len)}
    if stage == "dpo":
        return {**rows, "chosen_ids": ids(seq - prompt_len), "rejected_ids": ids(seq - prompt_len)}
    return {**rows, "completion_ids": ids(seq - prompt_len), "KL_completion_ids": ids(seq - prompt_len),
            "label": [index % 2 == 0 for index in range(examples)]}  # fmt: skip
