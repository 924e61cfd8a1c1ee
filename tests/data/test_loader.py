"""Finding and reading datasets: dataset_info.json, local files of every type, and malformed input."""

import json

import pandas as pd
import pytest

from tiletune.config import build_config
from tiletune.data.loader import load_raw, normalise, resolve_datasets
from tiletune.data.processing import build_splits
from tiletune.data.templates import TEMPLATES
from tiletune.errors import UserError

RECORDS = [{"instruction": f"q{i}", "input": "", "output": f"a{i}"} for i in range(10)]


def load(names, dataset_dir):
    return [normalise(load_raw(a), a, None, overwrite_cache=True) for a in resolve_datasets(names, str(dataset_dir))]


def test_dataset_info_entries_resolve_to_files_and_hub_ids(compat_dir):
    attrs = resolve_datasets("identity, glaive_toolcall_en_demo,alpaca_en", str(compat_dir / "data"))
    assert [a.source for a in attrs] == ["file", "file", "hub"]
    assert attrs[1].formatting == "sharegpt" and attrs[1].columns["messages"] == "conversations"
    assert attrs[2].path == "llamafactory/alpaca_en"


@pytest.mark.parametrize("suffix", [".json", ".jsonl", ".csv", ".parquet"])
def test_local_files_of_each_type_load_as_alpaca(tmp_path, suffix):
    path = tmp_path / f"data{suffix}"
    frame = pd.DataFrame(RECORDS)
    {
        ".json": lambda: path.write_text(json.dumps(RECORDS)),
        ".jsonl": lambda: path.write_text("".join(json.dumps(r) + "\n" for r in RECORDS)),
        ".csv": lambda: frame.to_csv(path, index=False),
        ".parquet": lambda: frame.to_parquet(path),
    }[suffix]()
    [dataset] = load(str(path), tmp_path)
    assert len(dataset) == 10
    assert dataset[3]["messages"] == [{"role": "user", "content": "q3"}, {"role": "assistant", "content": "a3"}]


def test_unknown_dataset_name_lists_known_ones(compat_dir):
    with pytest.raises(UserError, match=r"dataset 'idntity' is not in .*dataset_info.json.*did you mean identity"):
        resolve_datasets("idntity", str(compat_dir / "data"))


def test_missing_file_named_in_dataset_info(tmp_path):
    (tmp_path / "dataset_info.json").write_text(json.dumps({"mine": {"file_name": "gone.json"}}))
    with pytest.raises(UserError, match=r"dataset 'mine': file .*gone.json not found"):
        load("mine", tmp_path)


def test_malformed_json_reports_file_and_line(tmp_path):
    text = json.dumps(RECORDS, indent=2).splitlines()
    text[7] = text[7].rstrip(",")  # drop a comma inside the 2nd record
    (tmp_path / "broken.json").write_text("\n".join(text))
    with pytest.raises(UserError, match=r"broken\.json:9: malformed JSON"):
        load(str(tmp_path / "broken.json"), tmp_path)


def test_malformed_json_lines_report_the_line(tmp_path):
    lines = [json.dumps(r) for r in RECORDS]
    lines[4] = lines[4][:-1]
    (tmp_path / "broken.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(UserError, match=r"broken\.jsonl:5: malformed JSON line"):
        load(str(tmp_path / "broken.jsonl"), tmp_path)


def test_sharegpt_roles_out_of_order_name_the_record(tmp_path):
    good = {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]}
    bad = {"conversations": [{"from": "human", "value": "hi"}, {"from": "human", "value": "again"}]}
    (tmp_path / "chat.json").write_text(json.dumps([good, good, bad]))
    (tmp_path / "dataset_info.json").write_text(json.dumps({"chat": {"file_name": "chat.json", "formatting": "sharegpt"}}))
    with pytest.raises(UserError, match=r"dataset 'chat' record 2: message 1 has role 'human' where a 'gpt' or"):
        load("chat", tmp_path)


def test_sharegpt_custom_tags_and_system_message(tmp_path):
    record = {
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "yo"},
        ]
    }
    (tmp_path / "c.json").write_text(json.dumps([record]))
    info = {
        "c": {
            "file_name": "c.json",
            "formatting": "sharegpt",
            "columns": {"messages": "messages"},
            "tags": {"role_tag": "role", "content_tag": "content", "user_tag": "user", "assistant_tag": "assistant"},
        }
    }
    (tmp_path / "dataset_info.json").write_text(json.dumps(info))
    [dataset] = load("c", tmp_path)
    assert dataset[0]["system"] == "be brief" and [m["role"] for m in dataset[0]["messages"]] == ["user", "assistant"]


def splits_for(tmp_path, tokenizer, **keys):
    (tmp_path / "d.json").write_text(json.dumps(RECORDS))
    (tmp_path / "e.json").write_text(json.dumps(RECORDS[:3]))
    (tmp_path / "dataset_info.json").write_text(json.dumps({"d": {"file_name": "d.json"}, "e": {"file_name": "e.json"}}))
    raw = {"model_name_or_path": "m", "dataset_dir": str(tmp_path), "template": "llama3", "do_train": True, **keys}
    return build_splits(build_config(raw), tokenizer, TEMPLATES["llama3"])


def test_max_samples_per_dataset_several_datasets_and_val_size(tmp_path, demo_tokenizer):
    splits = splits_for(tmp_path, demo_tokenizer, dataset="d,e", max_samples=4, val_size=0.25)
    assert len(splits.train) + len(splits.eval) == 4 + 3 and len(splits.eval) == 2


def test_eval_dataset_and_prediction_prompts(tmp_path, demo_tokenizer):
    splits = splits_for(tmp_path, demo_tokenizer, dataset="d", eval_dataset="e", do_predict=True)
    assert len(splits.train) == 10 and len(splits.eval) == 3
    assert splits.predict["reference"] == ["a0", "a1", "a2"]
    prompt = demo_tokenizer.decode(splits.predict[1]["input_ids"])
    assert prompt.endswith("q1<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n")


def test_val_size_and_eval_dataset_together_are_refused(tmp_path, demo_tokenizer):
    with pytest.raises(UserError, match="either eval_dataset or val_size"):
        splits_for(tmp_path, demo_tokenizer, dataset="d", eval_dataset="e", val_size=0.2)


@pytest.mark.parametrize("formatting, records, message", [
    ("alpaca", [{"instruction": "q", "output": "a"}, {"instruction": "q", "output": 5}],
     r"dataset 'rows' record 1: column 'output' holds int 5 where text belongs"),
    ("alpaca", [{"instruction": "q", "input": "", "output": "a"}, {"instruction": ["q"], "input": None, "output": "a"}],
     r"dataset 'rows' record 1: column 'instruction' holds list \['q'\] where text belongs"),
    ("sharegpt", [{"conversations": [{"from": "system", "value": 7}, {"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]}],
     r"dataset 'rows' record 0: column 'conversations', the 'value' of the system message holds int 7"),
    ("sharegpt", [{"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": None}]}],
     r"dataset 'rows' record 0: column 'conversations', the 'value' of message 1 holds null where text belongs"),
])  # fmt: skip
def test_a_value_of_the_wrong_type_names_dataset_record_and_column(tmp_path, formatting, records, message):
    """Text columns hold strings; null stands for a missing alpaca column, as datasets fills absent keys with it."""
    (tmp_path / "rows.json").write_text(json.dumps(records))
    (tmp_path / "dataset_info.json").write_text(json.dumps({"rows": {"file_name": "rows.json", "formatting": formatting}}))
    with pytest.raises(UserError, match=message):
        load("rows", tmp_path)


def test_null_in_an_alpaca_column_is_an_empty_one(tmp_path):
    records = [{"instruction": "q", "input": None, "output": "a", "system": None}, {"instruction": "p", "output": None}]
    (tmp_path / "rows.json").write_text(json.dumps(records))
    [dataset] = load(str(tmp_path / "rows.json"), tmp_path)
    assert dataset[0]["messages"] == [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    assert dataset[1]["messages"] == [{"role": "user", "content": "p"}] and dataset[0]["system"] == ""
