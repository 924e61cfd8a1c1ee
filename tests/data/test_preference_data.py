"""Ranking datasets (`ranking: true`): alpaca and sharegpt forms, and the pairwise tokenisation."""

import json

import pytest

from tiletune.config import build_config
from tiletune.data.loader import load_raw, normalise, resolve_datasets
from tiletune.data.processing import build_splits, encode_pairwise
from tiletune.data.templates import TEMPLATES
from tiletune.errors import UserError

ALPACA = {"instruction": "Name a colour", "input": "one word", "chosen": "red", "rejected": "banana", "system": "be brief"}
SHAREGPT = {
    "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}, {"from": "human", "value": "colour?"}],
    "chosen": {"from": "gpt", "value": "red"},
    "rejected": {"from": "gpt", "value": "banana"},
}


def write(tmp_path, records, **entry):
    (tmp_path / "r.json").write_text(json.dumps(records))
    (tmp_path / "dataset_info.json").write_text(json.dumps({"r": {"file_name": "r.json", "ranking": True, **entry}}))


def normalised(tmp_path):
    [attr] = resolve_datasets("r", str(tmp_path))
    return normalise(load_raw(attr), attr, None, overwrite_cache=True)


def test_alpaca_ranking_record_is_a_prompt_and_two_answers(tmp_path):
    write(tmp_path, [ALPACA], columns={"system": "system"})
    [record] = normalised(tmp_path)
    assert record["messages"] == [{"role": "user", "content": "Name a colour\none word"}]
    assert (record["chosen"], record["rejected"], record["system"]) == ("red", "banana", "be brief")


def test_sharegpt_ranking_record_keeps_the_history(tmp_path):
    write(tmp_path, [SHAREGPT], formatting="sharegpt",
          columns={"messages": "conversations", "chosen": "chosen", "rejected": "rejected"})
    [record] = normalised(tmp_path)
    assert [m["role"] for m in record["messages"]] == ["user", "assistant", "user"]
    assert (record["chosen"], record["rejected"]) == ("red", "banana")


def test_sharegpt_ranking_conversation_must_end_with_a_question(tmp_path):
    record = {**SHAREGPT, "conversations": SHAREGPT["conversations"][:2]}
    write(tmp_path, [record], formatting="sharegpt", columns={"messages": "conversations"})
    with pytest.raises(UserError, match="record 0: the conversation ends with a 'gpt' message; it must end with a question"):
        normalised(tmp_path)


def test_pairwise_cut_keeps_the_answers_first():
    """LLaMA-Factory's infer_seqlen on the longer answer: both answers cut alike, the prompt takes what is left."""
    cut = encode_pairwise(list(range(30)), [1] * 8, [2] * 3, cutoff_len=20)
    assert (len(cut["prompt_ids"]), cut["chosen_ids"], cut["rejected_ids"]) == (12, [1] * 8, [2] * 3)
    cut = encode_pairwise(list(range(30)), [1] * 30, [2] * 3, cutoff_len=20)
    assert (len(cut["prompt_ids"]), len(cut["chosen_ids"]), len(cut["rejected_ids"])) == (10, 10, 3)


def test_pairs_are_tokenised_with_the_template(tmp_path, demo_tokenizer):
    write(tmp_path, [ALPACA])
    raw = {"model_name_or_path": "m", "stage": "dpo", "dataset": "r", "dataset_dir": str(tmp_path), "template": "llama3",
           "do_train": True}  # fmt: skip
    template = TEMPLATES["llama3"]
    splits = build_splits(build_config(raw), demo_tokenizer, template)
    [row] = splits.train
    [(prompt, chosen)] = template.encode_pairs(demo_tokenizer, [{"role": "user", "content": "Name a colour\none word"},
                                                                {"role": "assistant", "content": "red"}])
    assert (row["prompt_ids"], row["chosen_ids"]) == (prompt, chosen)
    assert demo_tokenizer.decode(row["rejected_ids"]).startswith("banana")


def test_feedback_records_carry_the_kto_tag_and_mismatched_answers(tmp_path, demo_tokenizer):
    """kto_en_demo's form: sharegpt with a bool label; the KL answers are the batch's answers in reverse order."""
    records = [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}], "label": tag}
               for q, a, tag in (("hi", "hello", True), ("colour?", "banana", False))]  # fmt: skip
    (tmp_path / "f.json").write_text(json.dumps(records))
    (tmp_path / "dataset_info.json").write_text(json.dumps({"f": {
        "file_name": "f.json", "formatting": "sharegpt", "columns": {"messages": "messages", "kto_tag": "label"},
        "tags": {"role_tag": "role", "content_tag": "content", "user_tag": "user", "assistant_tag": "assistant"}}}))
    raw = {"model_name_or_path": "m", "stage": "kto", "dataset": "f", "dataset_dir": str(tmp_path), "template": "llama3",
           "do_train": True}  # fmt: skip
    rows = list(build_splits(build_config(raw), demo_tokenizer, TEMPLATES["llama3"]).train)
    assert [row["label"] for row in rows] == [True, False]
    assert [row["KL_completion_ids"] for row in rows] == [rows[1]["completion_ids"], rows[0]["completion_ids"]]
    assert demo_tokenizer.decode(rows[0]["completion_ids"]).startswith("hello")
