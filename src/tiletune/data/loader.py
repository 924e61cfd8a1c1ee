"""Find, load and normalise datasets named in the config.

Names are looked up in `<dataset_dir>/dataset_info.json` (LLaMA-Factory's format: file_name or
hf_hub_url, formatting alpaca|sharegpt, columns, tags, split, subset, folder, num_samples). A name
that is not there may be a local file (json, jsonl, csv, parquet, txt) or a hub id `owner/name`.
Every record becomes {"messages": [{"role", "content"}, ...], "system": str, "tools": str}; a ranking
dataset's (`ranking: true`, for dpo and rm) holds the prompt's messages only, plus "chosen" and "rejected"
answers (text); a feedback dataset's (a `kto_tag` column, for kto) also "kto_tag" (bool: the answer is desirable).
"""

from __future__ import annotations

import difflib
import functools
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tiletune.data.templates import ASSISTANT, FUNCTION, OBSERVATION, USER
from tiletune.errors import UserError

FILE_TYPES = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet", ".txt": "text", ".arrow": "arrow"}
ALPACA_COLUMNS = {"prompt": "instruction", "query": "input", "response": "output", "history": None, "system": None}
SHAREGPT_COLUMNS = {"messages": "conversations", "system": None, "tools": None}
SHAREGPT_TAGS = {
    "role_tag": "from",
    "content_tag": "value",
    "user_tag": "human",
    "assistant_tag": "gpt",
    "observation_tag": "observation",
    "function_tag": "function_call",
    "system_tag": "system",
}
RANKING_COLUMNS = {"chosen": "chosen", "rejected": "rejected"}
MEDIA_COLUMNS = ("images", "videos", "audios")


@dataclass
class DatasetAttr:
    """One entry of dataset_info.json (or a bare file / hub id), resolved."""

    name: str
    source: str  # "file" or "hub"
    path: str
    formatting: str = "alpaca"
    columns: dict[str, Any] = field(default_factory=dict)
    tags: dict[str, str] = field(default_factory=dict)
    split: str = "train"
    subset: str | None = None
    folder: str | None = None
    num_samples: int | None = None
    ranking: bool = False

    def __post_init__(self):
        defaults = ALPACA_COLUMNS if self.formatting == "alpaca" else SHAREGPT_COLUMNS
        self.columns = {**defaults, **(RANKING_COLUMNS if self.ranking else {}), **self.columns}
        self.tags = {**SHAREGPT_TAGS, **self.tags}


def resolve_datasets(names: str, dataset_dir: str) -> list[DatasetAttr]:
    """DatasetAttr for each comma-separated name, from dataset_info.json, a file path or a hub id."""
    info_path = Path(dataset_dir) / "dataset_info.json"
    info: dict[str, Any] = {}
    if info_path.is_file():
        info = _read_json_file(info_path)
    attrs = []
    for name in (n.strip() for n in names.split(",") if n.strip()):
        if name in info:
            attrs.append(_attr_from_info(name, info[name], Path(dataset_dir), info_path))
        elif Path(name).exists():
            attrs.append(DatasetAttr(name=name, source="file", path=name))
        elif "/" in name and not name.startswith((".", "/")):
            attrs.append(DatasetAttr(name=name, source="hub", path=name))
        else:
            raise UserError(_unknown_dataset_message(name, info, info_path, dataset_dir))
    return attrs


def _unknown_dataset_message(name: str, info: dict, info_path: Path, dataset_dir: str) -> str:
    if not info:
        return (
            f"dataset {name!r} is not a file or a hub id 'owner/name', and {dataset_dir} has no dataset_info.json; "
            "set dataset_dir to the folder holding dataset_info.json"
        )
    close = difflib.get_close_matches(name, list(info), n=3, cutoff=0.5)
    hint = f"did you mean {', '.join(close)}?" if close else f"it names {len(info)} datasets, e.g. {', '.join(list(info)[:5])}"
    return f"dataset {name!r} is not in {info_path} and is not a file or a hub id 'owner/name'; {hint}"


def _attr_from_info(name: str, entry: dict[str, Any], dataset_dir: Path, info_path: Path) -> DatasetAttr:
    formatting = entry.get("formatting", "alpaca")
    if formatting not in ("alpaca", "sharegpt"):
        raise UserError(f"{info_path}: dataset {name!r} has formatting {formatting!r}; supported: alpaca, sharegpt")
    columns = entry.get("columns", {})
    media = [c for c in MEDIA_COLUMNS if columns.get(c)]
    if media:
        raise UserError(f"{info_path}: dataset {name!r} has {', '.join(media)}; multimodal data is not supported yet")
    common = dict(
        name=name,
        formatting=formatting,
        columns=columns,
        tags=entry.get("tags", {}),
        split=entry.get("split", "train"),
        subset=entry.get("subset"),
        folder=entry.get("folder"),
        num_samples=entry.get("num_samples"),
        ranking=bool(entry.get("ranking")),
    )
    if "file_name" in entry:
        return DatasetAttr(source="file", path=str(dataset_dir / entry["file_name"]), **common)
    if "hf_hub_url" in entry:
        return DatasetAttr(source="hub", path=entry["hf_hub_url"], **common)
    raise UserError(
        f"{info_path}: dataset {name!r} has neither file_name nor hf_hub_url "
        "(ModelScope, Modelers and script sources are not supported)"
    )


# ---- reading -----------------------------------------------------------------------------------


def load_raw(attr: DatasetAttr, cache_dir: str | None = None, overwrite_cache: bool = False, hub_token=None):
    """The dataset's records as a `datasets.Dataset`, before normalisation."""
    import datasets

    mode = "force_redownload" if overwrite_cache else None
    if attr.source == "hub":
        return datasets.load_dataset(
            attr.path, name=attr.subset, data_dir=attr.folder, split=attr.split,
            cache_dir=cache_dir, token=hub_token, download_mode=mode,
        )  # fmt: skip
    files = _data_files(attr)
    kind = FILE_TYPES[Path(files[0]).suffix]
    try:
        return datasets.load_dataset(kind, data_files=files, split="train", cache_dir=cache_dir, download_mode=mode)
    except Exception as err:  # report malformed JSON by file and line, which datasets does not
        for path in files:
            if kind == "json":
                _check_json_file(Path(path))
        raise UserError(f"dataset {attr.name!r}: cannot read {', '.join(files)}: {err}") from err


def _data_files(attr: DatasetAttr) -> list[str]:
    path = Path(attr.path)
    if path.is_dir():
        files = sorted(str(p) for p in path.iterdir() if p.suffix in FILE_TYPES)
    elif path.is_file():
        files = [str(path)]
    else:
        raise UserError(f"dataset {attr.name!r}: file {path} not found; check file_name in dataset_info.json")
    if not files:
        raise UserError(f"dataset {attr.name!r}: no {'/'.join(FILE_TYPES)} files in {path}")
    unknown = [f for f in files if Path(f).suffix not in FILE_TYPES]
    if unknown:
        raise UserError(f"dataset {attr.name!r}: {unknown[0]} is not one of {', '.join(FILE_TYPES)}")
    if len({FILE_TYPES[Path(f).suffix] for f in files}) > 1:
        raise UserError(f"dataset {attr.name!r}: {path} mixes file types; keep one type per dataset")
    return files


def _read_json_file(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise UserError(f"{path}:{err.lineno}: malformed JSON ({err.msg}); fix the file") from None


def _check_json_file(path: Path) -> None:
    """Raise a UserError naming file and line if `path` is neither a JSON document nor JSON lines."""
    text = path.read_text(encoding="utf-8")
    if text.lstrip().startswith("["):
        _read_json_file(path)
        return
    for lineno, line in enumerate(text.splitlines(), start=1):
        if line.strip():
            try:
                json.loads(line)
            except json.JSONDecodeError as err:
                raise UserError(f"{path}:{lineno}: malformed JSON line ({err.msg}); fix the file") from None


# ---- normalising -------------------------------------------------------------------------------


def cache_fingerprint(dataset, function) -> str:
    """The datasets-cache key of `dataset.map(function)`, covering tiletune's own data code too.

    datasets hashes a callable object by its state, not by its class's code: without the source
    hash, a cached result made by an older tiletune would be reused after an upgrade.
    """
    from datasets.fingerprint import Hasher

    return Hasher.hash((dataset._fingerprint, Hasher.hash(function), _data_source_hash()))


@functools.cache
def _data_source_hash() -> str:
    sources = sorted(Path(__file__).parent.glob("*.py"))
    return hashlib.sha256(b"".join(p.read_bytes() for p in sources)).hexdigest()



def normalise(dataset, attr: DatasetAttr, num_proc: int | None, overwrite_cache: bool):
    """Map the records of `attr`'s format to messages/system/tools, failing on malformed records."""
    convert = _AlpacaConverter(attr) if attr.formatting == "alpaca" else _SharegptConverter(attr)
    missing = [c for c in convert.required_columns() if c not in dataset.column_names]
    if missing:
        raise UserError(
            f"dataset {attr.name!r}: column {missing[0]!r} not found (it has {', '.join(dataset.column_names)}); "
            "set `columns` for it in dataset_info.json"
        )
    return dataset.map(
        convert,
        with_indices=True,
        new_fingerprint=cache_fingerprint(dataset, convert),
        remove_columns=dataset.column_names,
        num_proc=num_proc if num_proc and len(dataset) >= 2 * num_proc else None,
        load_from_cache_file=not overwrite_cache,
        desc=f"Converting {attr.name}",
    )


class _AlpacaConverter:
    def __init__(self, attr: DatasetAttr):
        self.attr, self.col = attr, attr.columns

    def required_columns(self) -> list[str]:
        return [self.col["prompt"]] + ([self.col["chosen"], self.col["rejected"]] if self.attr.ranking else [])

    def __call__(self, record: dict[str, Any], index: int) -> dict[str, Any]:
        col, attr = self.col, self.attr
        messages = []
        for old_prompt, old_response in (record.get(col["history"]) or []) if col.get("history") else []:
            where = f"column {col['history']!r}"
            messages += [{"role": USER, "content": _text(attr, index, where, old_prompt)},
                         {"role": ASSISTANT, "content": _text(attr, index, where, old_response)}]
        query = [text for c in (col["prompt"], col.get("query")) if (text := _column_text(attr, record, index, c))]
        messages.append({"role": USER, "content": "\n".join(query)})
        answers = {}
        if attr.ranking:
            answers = {key: _column_text(attr, record, index, col[key]) for key in RANKING_COLUMNS}
        elif col.get("response") and record.get(col["response"]) is not None:
            messages.append({"role": ASSISTANT, "content": _column_text(attr, record, index, col["response"])})
        return {
            "messages": messages,
            "system": _column_text(attr, record, index, col.get("system")),
            "tools": _tools_text(record.get(col["tools"])) if col.get("tools") else "",
            **answers,
            **_kto_tag(attr, record, index),
        }


class _SharegptConverter:
    def __init__(self, attr: DatasetAttr):
        self.attr, self.col, self.tags = attr, attr.columns, attr.tags
        t = attr.tags
        self.roles = {
            t["user_tag"]: USER,
            t["assistant_tag"]: ASSISTANT,
            t["observation_tag"]: OBSERVATION,
            t["function_tag"]: FUNCTION,
            t["system_tag"]: "system",
        }

    def required_columns(self) -> list[str]:
        return [self.col["messages"]] + ([self.col["chosen"], self.col["rejected"]] if self.attr.ranking else [])

    def __call__(self, record: dict[str, Any], index: int) -> dict[str, Any]:
        t = self.tags
        turns = record[self.col["messages"]] or []
        where = f"column {self.col['messages']!r}, the {t['content_tag']!r} of"  # + which message
        system = _column_text(self.attr, record, index, self.col.get("system"))
        if turns and turns[0].get(t["role_tag"]) == t["system_tag"]:
            system = _text(self.attr, index, f"{where} the system message", turns[0][t["content_tag"]])
            turns = turns[1:]
        messages = []
        for position, turn in enumerate(turns):
            role = self.roles.get(turn.get(t["role_tag"]))
            expected = (USER, OBSERVATION) if position % 2 == 0 else (ASSISTANT, FUNCTION)
            if role not in expected:
                raise UserError(
                    f"dataset {self.attr.name!r} record {index}: message {position} has role "
                    f"{turn.get(t['role_tag'])!r} where a {' or '.join(repr(self._tag_of(r)) for r in expected)} "
                    f"message is expected; fix the record or the `tags` in dataset_info.json"
                )
            content = _text(self.attr, index, f"{where} message {position}", turn[t["content_tag"]])
            messages.append({"role": role, "content": content})
        if bool(len(messages) % 2) != self.attr.ranking:  # a ranking record ends with the question
            raise UserError(
                f"dataset {self.attr.name!r} record {index}: the conversation ends with a "
                f"{self._tag_of(messages[-1]['role']) if messages else 'no'!r} message; it must end with "
                + ("a question (the answers are in the chosen and rejected columns)" if self.attr.ranking else "an answer")
            )
        answers = {key: self._answer(record, index, self.col[key]) for key in RANKING_COLUMNS} if self.attr.ranking else {}
        return {
            "messages": messages,
            "system": system,
            "tools": _tools_text(record.get(self.col["tools"])) if self.col.get("tools") else "",
            **answers,
            **_kto_tag(self.attr, record, index),
        }

    def _answer(self, record: dict[str, Any], index: int, column: str) -> str:
        """The text of a ranking record's chosen or rejected message, which must be an assistant's."""
        t, message = self.tags, record[column]
        if not isinstance(message, dict) or self.roles.get(message.get(t["role_tag"])) not in (ASSISTANT, FUNCTION):
            raise UserError(f"dataset {self.attr.name!r} record {index}: column {column!r} holds {message!r:.60} where "
                            f"an {t['assistant_tag']!r} message belongs")
        return _text(self.attr, index, f"column {column!r}", message[t["content_tag"]])

    def _tag_of(self, role: str) -> str:
        return next(tag for tag, r in self.roles.items() if r == role)


def _text(attr: DatasetAttr, index: int, where: str, value: Any) -> str:
    """`value`, where record `index` must hold text; a UserError naming the dataset, the record and where otherwise."""
    if not isinstance(value, str):
        held = "null" if value is None else f"{type(value).__name__} {value!r:.40}"
        raise UserError(f"dataset {attr.name!r} record {index}: {where} holds {held} where text belongs; "
                        "make it a string in the data")
    return value


def _column_text(attr: DatasetAttr, record: dict[str, Any], index: int, column: str | None) -> str:
    """The text in `column` of record `index`; '' where the format has no such column or the record holds null."""
    value = record.get(column) if column else None
    return "" if value is None else _text(attr, index, f"column {column!r}", value)


def _kto_tag(attr: DatasetAttr, record: dict[str, Any], index: int) -> dict[str, bool]:
    """{"kto_tag": whether the answer is desirable} when the dataset names a `kto_tag` column, else {}."""
    column = attr.columns.get("kto_tag")
    if not column:
        return {}
    if not isinstance(record.get(column), bool):
        raise UserError(f"dataset {attr.name!r} record {index}: column {column!r} holds {record.get(column)!r:.40} "
                        "where true or false belongs")
    return {"kto_tag": record[column]}


def _tools_text(value: Any) -> str:
    if not value:
        return ""
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)

