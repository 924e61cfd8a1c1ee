"""Every family end to end on the CPU, as a user runs it: a tiny random-init model of the family saved with the
demo tokenizer (holding the family template's stop words, as the family's own tokenizer does), then `tiletune
train` with every kernel in the family's chat template (the PatchReport in kernels.json names what took which
modules), `tiletune verify` of every kernel's reference (the TileLang kernels cannot run on a CPU), `tiletune
export` of the adapter and one `tiletune chat` turn."""

import json
from fnmatch import fnmatch

import pytest
import torch
import transformers
from test_records import EVERY_KERNEL, MODELS, NOT_TAKEN

from tiletune.config import build_config
from tiletune.data.templates import TEMPLATES
from tiletune.families import family_of
from tiletune.train.chat import load_session, run_chat
from tiletune.train.export import run_export
from tiletune.train.trainer import run_train
from tiletune.verify.run import VerifyOptions, run_verify

# each family's chat template, by LLaMA-Factory's name (Gemma 2 writes Gemma's format); GPT-OSS's harmony format
# (LLaMA-Factory's `gpt`, a reasoning template with efficient EOS) is not in tiletune: it trains in `default`
TEMPLATE_OF = {"llama": "llama3", "mistral": "mistral", "qwen2": "qwen", "qwen3": "qwen3", "qwen3_moe": "qwen3",
               "mixtral": "mistral", "llama4_text": "llama4", "gemma2": "gemma", "gemma3_text": "gemma3", "phi3": "phi",
               "gpt_oss": "default", "deepseek_v3": "deepseek3"}
RECORDS = [{"instruction": f"say {w}", "input": "", "output": f"{w} {w}"} for w in "abcdefgh"]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    data = tmp_path_factory.mktemp("data")
    (data / "t.json").write_text(json.dumps(RECORDS))
    (data / "dataset_info.json").write_text(json.dumps({"t": {"file_name": "t.json"}}))
    return data


def saved_model(model_type: str, folder, tokenizer_dir):
    """A 2-layer random-init model of the family with the demo tokenizer and its template's stop words, in `folder`."""
    from transformers import AutoTokenizer

    config_class, model_class, extra = MODELS[model_type]
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    stops = list(TEMPLATES[TEMPLATE_OF[model_type]].stop_words)
    tokenizer.add_special_tokens({"additional_special_tokens": stops}, replace_extra_special_tokens=False)
    tokenizer.save_pretrained(folder)
    shape = {"vocab_size": -(-len(tokenizer) // 64) * 64,  # padded, as real vocabularies are
             "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 256,
             "bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
             "pad_token_id": tokenizer.pad_token_id}
    # the family's own shape keys win (DeepSeek's MLA: head_dim is the rotated slice, as many kv heads as heads);
    # token ids are the tokenizer's
    config = getattr(transformers, config_class)(**{**shape, **{k: v for k, v in extra.items() if not k.endswith("_token_id")}})
    torch.manual_seed(0)
    getattr(transformers, model_class)(config).save_pretrained(folder)
    return folder


@pytest.mark.parametrize("model_type", MODELS)
def test_train_verify_export_chat(model_type, tmp_path, tokenizer_dir, data_dir):
    model_dir = saved_model(model_type, tmp_path / "model", tokenizer_dir)
    keys = {"model_name_or_path": str(model_dir), "stage": "sft", "do_train": True, "finetuning_type": "lora",
            "lora_target": "all", "dataset": "t", "dataset_dir": str(data_dir), "template": TEMPLATE_OF[model_type],
            "cutoff_len": 32,
            "per_device_train_batch_size": 4, "learning_rate": 1e-3, "max_steps": 2, "logging_steps": 1,
            "report_to": "none", "output_dir": str(tmp_path / "out"), "kernels": EVERY_KERNEL}
    run_train(build_config(keys))
    patched = json.loads((tmp_path / "out" / "kernels.json").read_text())
    family = family_of(transformers.AutoConfig.from_pretrained(model_dir))
    assert patched["family"] == family.name
    ops = patched["ops"]
    assert ops["rms_norm"]["patched"] > 0 and ops["lora_linear"]["patched"] >= 8  # LoRA on all linears
    assert all(any(fnmatch(m, norm.path) for norm in family.norms) for m in ops["rms_norm"]["modules"])
    if NOT_TAKEN.get(model_type, {}).get("rope", (1,))[0]:
        assert ops["rope"]["patched"] >= 1 and ops["rope"]["modules"] == [family.attention.path]
    else:  # refused at every layer (DeepSeek's MLA rotary), saying why
        assert ops["rope"]["patched"] == 0 and ops["rope"]["fallback"].endswith("no kernel yet: stock forward kept")
    log = [json.loads(line) for line in (tmp_path / "out" / "trainer_log.jsonl").read_text().splitlines()]
    assert len(log) == 2 and all(torch.isfinite(torch.tensor(row["loss"])) for row in log)

    references = "all=reference,geglu=reference"  # what runs on a CPU: verify says NOT VERIFIED for TileLang here
    result = run_verify(build_config({**keys, "do_train": False, "kernels": references}),
                        VerifyOptions(out_dir=tmp_path / "verify", seq=16, random_tokens=True))
    assert result["outcome"] == "pass" and result["tensors"]

    inference = {**keys, "do_train": False, "adapter_name_or_path": str(tmp_path / "out")}
    exported = run_export(build_config({**inference, "export_dir": str(tmp_path / "merged")}))
    assert transformers.AutoModelForCausalLM.from_pretrained(exported).config.model_type == model_type
    session, _ = load_session(build_config({**inference, "max_new_tokens": 3}))
    said = []
    run_chat(session, ["hello"], said.append)
    assert "Assistant: " in said
