"""`tiletune llamafactory train`: the `kernels:` block is split off, the rest goes to LLaMA-Factory as is.

The end-to-end test needs `llamafactory` importable; the main environment does not have it, and
.ci/llamafactory-env.sh runs this file in a venv with LLaMA-Factory and its pinned dependencies.
"""

import json
import sys
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from tiletune.cli import main
from tiletune.errors import UserError
from tiletune.kernels.registry import OPS, OPT_IN
from tiletune.train.llamafactory import split_config

ALL = [op for op in OPS if op not in OPT_IN]  # what `kernels: all` selects

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
CONFIG = {
    "model_name_or_path": str(EXAMPLES / "tiny-llama"),
    "stage": "sft",
    "do_train": True,
    "finetuning_type": "lora",
    "lora_target": "all",
    "dataset": "demo_train",
    "dataset_dir": str(EXAMPLES / "data"),
    "template": "llama3",
    "cutoff_len": 64,
    "max_samples": 32,
    "per_device_train_batch_size": 8,
    "max_steps": 3,
    "logging_steps": 1,
    "report_to": "none",
    "kernels": "all",
}


def write_config(tmp_path, **changes) -> Path:
    path = tmp_path / "lf.yaml"
    path.write_text(yaml.safe_dump({**CONFIG, "output_dir": str(tmp_path / "out"), **changes}))
    return path


def test_kernels_are_split_off_and_the_rest_passes_unchanged(tmp_path):
    args, spec = split_config(str(write_config(tmp_path, quantization_bit=None)), ["learning_rate=1.0e-4"])
    assert "kernels" not in args and args["learning_rate"] == 1e-4 and args["quantization_bit"] is None
    assert {key: args[key] for key in CONFIG if key != "kernels"} == {k: v for k, v in CONFIG.items() if k != "kernels"}
    assert sorted(sel.op for sel in spec.ops) == sorted(ALL)
    assert split_config(str(write_config(tmp_path, kernels=None)))[1] is None


def test_a_bad_kernels_block_fails_before_llamafactory_runs(tmp_path):
    with pytest.raises(UserError, match="kernels"):
        split_config(str(write_config(tmp_path, kernels={"no_such_op": "tilelang"})))


def test_without_llamafactory_one_line_with_the_install_command(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "llamafactory.train.tuner", None)  # as if not installed
    result = CliRunner().invoke(main, ["llamafactory", "train", str(write_config(tmp_path))])
    assert result.exit_code == 2
    assert "pip install llamafactory==" in result.output and len(result.output.strip().splitlines()) == 1


def test_llamafactory_trains_with_tiletune_kernels(tmp_path, capfd):
    pytest.importorskip("llamafactory",
                        reason="LLaMA-Factory is not installed here: bash .ci/llamafactory-env.sh runs this in its own venv")
    import llamafactory.model.loader as loader

    original = loader.load_model
    result = CliRunner().invoke(main, ["llamafactory", "train", str(write_config(tmp_path))])
    assert result.exit_code == 0, result.output
    out = tmp_path / "out"
    assert (out / "adapter_model.safetensors").is_file() and (out / "trainer_log.jsonl").is_file()
    report = json.loads((out / "kernels.json").read_text())
    # lora_target all: every projection is a LoRA layer, so lora_linear takes them all and linear none; the base is
    # not quantized, so the quantized ops have no site; a Llama's MLP is SwiGLU, so geglu has none either; the
    # preference stages' log-prob op binds to no module; a Llama has no MoE experts
    assert {op: info["patched"] > 0 for op, info in report["ops"].items()} == dict.fromkeys(ALL, True) | {
        "linear": False, "quant_linear": False, "quant_lora_linear": False, "geglu": False, "linear_logprobs": False,
        "moe_experts": False}
    assert report["decoder_layers"]["count"] == 4
    ran = {item["op"] for item in report["runtime_fallbacks"] if item["calls"] > 0}
    assert all(op in ran for op, info in report["ops"].items() if info["fallback"])  # patched forwards ran
    assert "kernels (4 decoder layers" in capfd.readouterr().out + result.output
    assert loader.load_model is original  # the wrapper is gone after the run
