"""Loss masks and truncation of supervised examples, and packing for pre-training."""

import json

import pytest

from tiletune.config import build_config
from tiletune.data.processing import IGNORE_INDEX, build_splits, encode_supervised, split_budget
from tiletune.data.templates import TEMPLATES

P = IGNORE_INDEX


@pytest.mark.parametrize(
    "prompt, response, budget, expected",
    [
        (10, 5, 100, (10, 5)),  # fits
        (10, 60, 50, (10, 40)),  # short prompt kept whole, long answer cut
        (80, 10, 50, (40, 10)),  # short answer kept whole, prompt cut
        (60, 40, 50, (30, 20)),  # both long: shared in proportion 60:40
    ],
)
def test_split_budget(prompt, response, budget, expected):
    keep = split_budget(prompt, response, budget)
    assert keep == expected and sum(keep) <= budget


def test_prompts_are_masked_and_answers_kept():
    pairs = [([1, 2, 3], [4, 5]), ([6], [7, 8])]
    out = encode_supervised(pairs, cutoff_len=100, train_on_prompt=False, mask_history=False)
    assert out["input_ids"] == [1, 2, 3, 4, 5, 6, 7, 8]
    assert out["labels"] == [P, P, P, 4, 5, P, 7, 8]
    assert out["attention_mask"] == [1] * 8


def test_train_on_prompt_and_mask_history():
    pairs = [([1, 2, 3], [4, 5]), ([6], [7, 8])]
    assert encode_supervised(pairs, 100, train_on_prompt=True, mask_history=False)["labels"] == [1, 2, 3, 4, 5, 6, 7, 8]
    out = encode_supervised(pairs, 100, train_on_prompt=False, mask_history=True)
    assert out["input_ids"] == [1, 2, 3, 4, 5, 6, 7, 8]
    assert out["labels"] == [P, P, P, P, P, P, 7, 8]


def test_cutoff_drops_later_turns_first():
    pairs = [([1, 2, 3], [4, 5]), ([6, 6, 6], [7, 8])]
    out = encode_supervised(pairs, cutoff_len=7, train_on_prompt=False, mask_history=False)
    assert len(out["input_ids"]) == 7 and out["input_ids"][:5] == [1, 2, 3, 4, 5]
    # mask_history keeps the last turn whole instead
    out = encode_supervised(pairs, cutoff_len=5, train_on_prompt=False, mask_history=True)
    assert out["input_ids"] == [6, 6, 6, 7, 8] and out["labels"] == [P, P, P, 7, 8]


def test_pretraining_packs_texts_into_cutoff_blocks(tmp_path, demo_tokenizer):
    texts = [{"text": "lorem ipsum dolor sit amet " * (i + 1)} for i in range(6)]
    (tmp_path / "c.jsonl").write_text("".join(json.dumps(t) + "\n" for t in texts))
    (tmp_path / "dataset_info.json").write_text(json.dumps({"c": {"file_name": "c.jsonl", "columns": {"prompt": "text"}}}))
    raw = {"model_name_or_path": "m", "dataset": "c", "dataset_dir": str(tmp_path), "stage": "pt",
           "cutoff_len": 16, "do_train": True}  # fmt: skip
    train = build_splits(build_config(raw), demo_tokenizer, TEMPLATES["empty"]).train
    total = sum(len(demo_tokenizer(t["text"] + demo_tokenizer.eos_token, add_special_tokens=False)["input_ids"]) for t in texts)
    lengths = [len(ids) for ids in train["input_ids"]]
    assert sum(lengths) == total and all(n == 16 for n in lengths[:-1]) and 0 < lengths[-1] <= 16
    assert train["labels"] == train["input_ids"]
    assert demo_tokenizer.decode(sum(train["input_ids"], [])).count(demo_tokenizer.eos_token) == 6


def test_random_rows_have_the_stages_columns_and_lengths():
    from tiletune.data.processing import random_rows

    dpo = random_rows("dpo", 3, 33, 50, seed=1)
    assert sorted(dpo) == ["chosen_ids", "prompt_ids", "rejected_ids"]
    assert [len(dpo["prompt_ids"][0]), len(dpo["chosen_ids"][0])] == [16, 17] and dpo["chosen_ids"] != dpo["rejected_ids"]
    kto = random_rows("kto", 4, 32, 50, seed=1)
    assert kto["label"] == [True, False, True, False] and len(kto["KL_completion_ids"]) == 4
    assert random_rows("dpo", 3, 33, 50, seed=1) == dpo  # seeded: every variant sees the same rows


@pytest.mark.parametrize("template, dated", [("llama3", True), ("qwen3", False)])
def test_a_tool_prompt_with_todays_date_is_part_of_the_cache_key(monkeypatch, demo_tokenizer, template, dated):
    """Llama 3's tool prompt writes today's date: tomorrow's run must not reuse today's tokenization."""
    import datetime as real

    from datasets import Dataset

    from tiletune.data import processing, tools
    from tiletune.data.loader import cache_fingerprint

    cfg = build_config({"model_name_or_path": "m", "dataset": "d", "stage": "sft", "do_train": True})
    dataset = Dataset.from_dict({"x": [1]})

    def key_on(day: int) -> str:
        monkeypatch.setattr(tools, "datetime", type("Clock", (), {"now": staticmethod(lambda: real.datetime(2026, 12, day))}))
        return cache_fingerprint(dataset, processing._SupervisedEncoder(cfg, demo_tokenizer, TEMPLATES[template]))

    assert (key_on(4) != key_on(5)) == dated and key_on(5) == key_on(5)
