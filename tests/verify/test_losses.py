"""verify/losses.py: `tiletune verify` of a preference stage differentiates the stage's loss; the log-prob op is
checked like a kernel (a wrong one fails), for dpo's losses and kto, from the data or random pairs."""

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from tiletune.cli import main
from tiletune.kernels import registry
from tiletune.kernels.linear_logprobs import chunked_backward, chunked_forward
from tiletune.kernels.registry import Impl

REPO = Path(__file__).resolve().parents[2]


def verify(tmp_path, *args: str):
    config = [str(REPO / "examples" / "demo_dpo.yaml"), f"model_name_or_path={REPO / 'examples' / 'tiny-llama'}",
              f"dataset_dir={REPO / 'examples' / 'data'}", f"output_dir={tmp_path / 'run'}"]  # fmt: skip
    return CliRunner().invoke(main, ["verify", *config, "--out", str(tmp_path / "v"), "--batches", "1", *args])


@pytest.mark.parametrize("overrides", [(), ("pref_loss=orpo", "pref_ftx=0.5", "--random-tokens"),
                                       ("stage=kto", "--random-tokens", "--seq", "24")])  # fmt: skip
def test_the_preference_loss_verifies_its_log_prob_op(tmp_path, overrides):
    result = verify(tmp_path, "kernels={linear_logprobs: chunked}", *overrides)
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "v" / "verify.json").read_text())
    names = {tensor["name"] for tensor in report["tensors"]}
    assert report["passed"] and "b0.loss" in names and any(".lora_A." in name for name in names)


@pytest.fixture
def wrong_log_probs():
    """A linear_logprobs 1% off in its log-probs (its gradients right): the loss and every gradient behind it move."""
    def one_percent_off(*inputs):
        log_probs, *rest = chunked_forward(*inputs)
        return log_probs * 1.01, *rest

    registry.add(Impl("linear_logprobs", "one_percent_off", one_percent_off, chunked_backward))
    yield "kernels={linear_logprobs: one_percent_off}"
    registry._impls["linear_logprobs"].pop("one_percent_off")


def test_a_wrong_log_prob_op_fails(tmp_path, wrong_log_probs):
    result = verify(tmp_path, wrong_log_probs)
    assert result.exit_code == 1, result.output
    failed = {t["name"] for t in json.loads((tmp_path / "v" / "verify.json").read_text())["tensors"] if not t["passed"]}
    assert "b0.loss" in failed


def test_stage_rm_is_refused_in_one_line(tmp_path):
    result = verify(tmp_path, "stage=rm", "kernels=all")
    assert result.exit_code == 2 and "stage rm's value-head loss" in result.output
    assert "Traceback" not in result.output and len(result.output.strip().splitlines()) == 1
