"""`tiletune bench` end to end on the CPU (tiny preset): fresh processes, outputs, ratios, FLOP counts."""

import importlib.util
import json

import pytest
from click.testing import CliRunner

from tiletune.train.presets import preset_config
from tiletune.bench.runner import resolve_peaks, short_label, summarise
from tiletune.bench.worker import step_flops
from tiletune.cli import main
from tiletune.errors import UserError


def test_bench_runs_variants_in_fresh_processes_and_writes_outputs(tmp_path):
    config = tmp_path / "b.yaml"
    config.write_text("model_name_or_path: unused\nfinetuning_type: lora\nlora_target: q_proj,v_proj\n")
    out = tmp_path / "bench"
    args = ["bench", str(config), "--model-preset", "tiny", "--variants", "baseline,rms_norm", "--batch", "2",
            "--seq", "32", "--steps", "2", "--warmup", "1", "--repeats", "2", "--out", str(out)]  # fmt: skip
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert "| baseline |" in result.output and "| rms_norm |" in result.output
    data = json.loads((out / "bench.json").read_text())
    rows = {r["variant"]: r for r in data["variants"]}
    assert rows["baseline"]["timed_steps"] == 4 and rows["baseline"]["time_ratio"] == 1.0
    assert rows["rms_norm"]["patched"] is not None
    # same data and seed in both variants: the reference-fallback kernel gives the same first loss
    assert rows["rms_norm"]["final_loss"] == pytest.approx(rows["baseline"]["final_loss"], rel=1e-4)
    assert (out / "bench.csv").read_text().startswith("variant,step_time_s")
    assert (out / "bench.png").stat().st_size > 1000
    logged = [json.loads(line) for line in (out / "runs.jsonl").read_text().splitlines()]
    assert [(r["repeat"], r["variant"]) for r in logged] == [(0, "baseline"), (0, "rms_norm"), (1, "baseline"), (1, "rms_norm")]
    again = CliRunner().invoke(main, args)
    assert again.exit_code == 2 and "already holds bench results" in again.output


def test_unknown_variant_and_missing_baseline_are_refused(tmp_path):
    config = tmp_path / "b.yaml"
    config.write_text("model_name_or_path: unused\n")
    cases = [("baseline,flash", "variant 'flash' is unknown"), ("all", "needs the 'baseline'"),
             ("baseline,rms_norm+flash:bf16=true", "variant 'flash' is unknown")]
    if importlib.util.find_spec("liger_kernel") is None:
        cases.append(("baseline,liger", "needs Liger-Kernel; pip install liger-kernel"))
    for variants, message in cases:
        result = CliRunner().invoke(main, ["bench", str(config), "--variants", variants, "--out", str(tmp_path / "o")])
        assert result.exit_code == 2 and message in result.output


def test_all_joined_with_an_opt_in_op_is_every_kernel_plus_that_op(tmp_path):
    from tiletune.bench.runner import check_variants
    from tiletune.bench.worker import variant_kernels
    from tiletune.kernels.registry import OPT_IN
    from tiletune.patch.spec import parse_kernel_spec

    check_variants(["baseline", "all+attention"])  # accepted, like `kernels: {all: true, attention: true}`
    selected = {selection.op for selection in parse_kernel_spec(variant_kernels("all+attention")).ops}
    everyday = {selection.op for selection in parse_kernel_spec("all").ops}
    assert "attention" in OPT_IN and selected == everyday | {"attention"}


def test_a_variant_picks_an_ops_implementation_and_an_unknown_one_is_refused():
    from tiletune.bench.runner import check_variants
    from tiletune.bench.worker import variant_kernels
    from tiletune.patch.spec import parse_kernel_spec

    check_variants(["baseline", "rms_norm+linear_cross_entropy=tilelang"])
    spec = parse_kernel_spec(variant_kernels("rms_norm+linear_cross_entropy=tilelang"))
    assert {s.op: s.impl for s in spec.ops} == {"rms_norm": "tilelang", "linear_cross_entropy": "tilelang"}
    assert {s.op: s.impl for s in parse_kernel_spec(variant_kernels("linear_cross_entropy=chunked")).ops} == {
        "linear_cross_entropy": "chunked"}
    with pytest.raises(UserError, match="linear_cross_entropy has no implementation 'fused'; it has reference"):
        check_variants(["baseline", "linear_cross_entropy=fused"])


def test_ablation_takes_extra_variants_into_the_same_run(tmp_path, monkeypatch):
    import tiletune.bench.runner as runner

    asked = {}
    monkeypatch.setattr(runner, "run_bench", lambda config, overrides, variants, *args, **kwargs: asked.update(v=variants))
    monkeypatch.setattr(runner, "table", lambda result: "")
    config = tmp_path / "b.yaml"
    config.write_text("model_name_or_path: unused\n")
    extra = "all:gradient_checkpointing=auto"
    result = CliRunner().invoke(main, ["bench", str(config), "--ablation", "--variants", f"baseline,{extra}"])
    assert result.exit_code == 0, result.output
    assert asked["v"] == [*runner.ablation_variants(), extra]


def test_step_flops_of_llama3_8b_lora_matches_the_6nt_rule():
    config = preset_config("llama3-8b")
    tokens = 4 * 2048
    flops = step_flops(config, trainable_linear=0, tokens=tokens, seq=2048, recomputed=1.0)
    linear_params = 32 * (4096 * (2 * 4096 + 2 * 1024) + 3 * 4096 * 14336) + 4096 * 128256
    attention = 4 * 32 * 2 * 2048 * 4096 * tokens  # fwd + 2x bwd + recompute
    assert flops == pytest.approx(6 * linear_params * tokens - 2 * 4096 * 128256 * tokens + attention)
    assert 3.6e14 < flops < 4.0e14  # design.md: about 6 x 7.5e9 x 8192 + attention


def test_summarise_reports_ratios_against_the_baseline():
    def run(times, memory):
        return {"step_times": times, "losses": [1.0], "tokens_per_step": 100, "flops_per_step": 1e12,
                "peak_allocated_gib": memory, "peak_reserved_gib": memory}  # fmt: skip

    result = summarise({"baseline": [run([2.0, 2.2], 10.0)], "all": [run([1.0, 1.2], 5.0)]}, matmul_peak_tflops=10.0)
    rows = {r["variant"]: r for r in result["variants"]}
    assert rows["all"]["time_ratio"] == pytest.approx(1.1 / 2.1) and rows["all"]["memory_ratio"] == 0.5
    assert rows["all"]["utilisation"] == pytest.approx(1e12 / 1.1 / 1e12 / 10.0)


def test_plot_labels_abbreviate_config_overrides_and_keep_the_ops():
    assert short_label("baseline") == "baseline"
    assert (short_label("rms_norm+lora_linear:gradient_checkpointing=auto:gradient_checkpointing_budget=28.9")
            == "rms_norm+lora_linear : gc auto : budget 28.9")


def test_a_failing_variant_is_reported_and_the_others_go_on_qlora_variants_included(tmp_path):
    """A variant over its memory budget fails alone (named in the table and bench.json); `quantization_bit=4`
    builds the preset quantized, and `all` then binds the quantized ops; `bnb` needs bitsandbytes."""
    config = tmp_path / "b.yaml"
    config.write_text("model_name_or_path: unused\nfinetuning_type: lora\nlora_target: q_proj,v_proj\n")
    out = tmp_path / "bench"
    over_budget = "all:gradient_checkpointing=auto:gradient_checkpointing_budget=0.00001"
    args = ["bench", str(config), "--model-preset", "tiny", "--variants", f"baseline,{over_budget},all:quantization_bit=4",
            "--batch", "2", "--seq", "32", "--steps", "1", "--warmup", "1", "--repeats", "1", "--out", str(out)]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    data = json.loads((out / "bench.json").read_text())
    assert "below the" in data["failed"][over_budget] and f"{over_budget} failed:" in result.output
    rows = {r["variant"]: r for r in data["variants"]}
    ops = rows["all:quantization_bit=4"]["patched"]["ops"]
    assert ops["quant_lora_linear"]["patched"] == 4 and ops["quant_linear"]["patched"] == 10
    if importlib.util.find_spec("bitsandbytes") is None:
        refused = CliRunner().invoke(main, [*args[:5], "baseline,bnb:quantization_bit=4", "--out", str(tmp_path / "o")])
        assert refused.exit_code == 2 and "needs bitsandbytes" in refused.output


def test_a_budget_may_be_another_variants_peak_measured_earlier_in_the_run(tmp_path):
    """`gradient_checkpointing_budget=@liger`: the peer's peak of this run becomes the budget (the issue's "at no
    more memory than the peer, in the same run"); the peer must come first."""
    runs = {"liger": [{"peak_allocated_gib": 17.25}, {"peak_allocated_gib": 17.5}]}
    variant = "all:gradient_checkpointing=auto:gradient_checkpointing_budget=@liger"
    assert resolve_peaks(variant, runs) == "all:gradient_checkpointing=auto:gradient_checkpointing_budget=17.500"
    assert resolve_peaks("all:bf16=true", runs) == "all:bf16=true"
    assert resolve_peaks("all:gradient_checkpointing_budget=@liger*0.5", runs) == "all:gradient_checkpointing_budget=8.750"
    with pytest.raises(UserError, match="@VARIANT\\*FACTOR with a positive factor"):
        resolve_peaks("all:gradient_checkpointing_budget=@liger*half", runs)
    config = tmp_path / "b.yaml"
    config.write_text("model_name_or_path: unused\n")
    result = CliRunner().invoke(main, ["bench", str(config), "--variants", f"baseline,{variant},rms_norm",
                                       "--out", str(tmp_path / "o")])
    assert result.exit_code == 2 and "takes the peak memory of 'liger': list 'liger' before it" in result.output


def test_a_preference_stage_is_timed_on_its_trainer_with_each_log_prob_head(tmp_path):
    """stage dpo: TRL's fused head (baseline), LLaMA-Factory's full-logits log-probs and tiletune's linear_logprobs
    give the same first loss on the same pairs (log 2: the policy is its reference); orpo (no reference) and kto run
    too, and the step counts chosen + rejected tokens (also where each pair's prompt runs once)."""
    config = tmp_path / "dpo.yaml"
    config.write_text("model_name_or_path: unused\nstage: dpo\nfinetuning_type: lora\nlora_target: q_proj,v_proj\n"
                      "pref_beta: 0.1\n")  # fmt: skip
    out = tmp_path / "bench"
    variants = ("baseline,llamafactory,linear_logprobs,linear_logprobs:pref_shared_prompt=true,"
                "linear_logprobs:pref_loss=orpo,baseline:stage=kto")
    result = CliRunner().invoke(main, ["bench", str(config), "--model-preset", "tiny", "--variants", variants,
                                       "--batch", "2", "--seq", "32", "--steps", "1", "--warmup", "1", "--repeats", "1",
                                       "--out", str(out)])  # fmt: skip
    assert result.exit_code == 0, result.output
    runs = {run["variant"]: run for run in map(json.loads, (out / "runs.jsonl").read_text().splitlines())}
    for name in ("baseline", "llamafactory", "linear_logprobs", "linear_logprobs:pref_shared_prompt=true"):
        assert runs[name]["losses"][0] == pytest.approx(0.693147, abs=1e-4)  # -log sigmoid(0)
    assert runs["linear_logprobs:pref_shared_prompt=true"]["tokens_per_step"] == 2 * 2 * 32
    assert not runs["linear_logprobs:pref_shared_prompt=true"]["patched"]["runtime_fallbacks"]
    assert runs["linear_logprobs:pref_loss=orpo"]["losses"][0] > 1.0  # the chosen answer's NLL of random tokens
    assert runs["baseline"]["tokens_per_step"] == 2 * 2 * 32 and runs["baseline:stage=kto"]["tokens_per_step"] == 2 * 32
    assert runs["linear_logprobs"]["patched"]["ops"]["linear_logprobs"]["impl"] == "chunked"


def test_bench_refuses_a_stage_it_cannot_time_and_llamafactory_outside_preference_stages(tmp_path):
    config = tmp_path / "c.yaml"
    for text, variants, message in [("stage: rm\n", "baseline", "stage 'rm' has no step to time here"),
                                    ("stage: sft\n", "baseline,llamafactory", "it needs stage dpo or kto")]:
        config.write_text("model_name_or_path: unused\n" + text)
        result = CliRunner().invoke(main, ["bench", str(config), "--variants", variants, "--out", str(tmp_path / "o")])
        assert result.exit_code == 2 and message in result.output, result.output
