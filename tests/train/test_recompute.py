"""`gradient_checkpointing: auto`: the plan within a budget, the treatments' numerics, config and bench wiring."""

import dataclasses
import functools
import gc
import json

import pytest
import torch
from click.testing import CliRunner
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from tiletune.cli import main
from tiletune.config import build_config
from tiletune.errors import UserError
from tiletune.train.model import prepare_for_training
from tiletune.patch import decoder_layers
from tiletune.train import recompute
from tiletune.train.recompute import (RecomputePlan, apply_treatments, choose_treatments, place_recomputed_inputs,
                                     plan_recomputation)


def test_choose_spares_the_last_layers_and_prefers_the_cheaper_treatment():
    assert choose_treatments(4, keep_bytes=10, selective_bytes=6, free_bytes=0) == ["recompute"] * 4
    assert choose_treatments(4, 10, 6, 13) == ["recompute", "recompute", "selective", "selective"]
    # 2 selective cost 12; the 1 left cannot upgrade one (needs 4); with 16, one layer is kept whole
    assert choose_treatments(4, 10, 6, 16) == ["recompute", "recompute", "selective", "keep"]
    assert choose_treatments(4, 10, 6, 10**9) == ["keep"] * 4
    assert choose_treatments(3, keep_bytes=5, selective_bytes=5, free_bytes=11) == ["recompute", "keep", "keep"]
    assert choose_treatments(3, 5, 5, -7) == ["recompute"] * 3


def _budget_gib(usable: float, static: int) -> float:
    """The budget (GiB) whose usable part (`recompute.usable_bytes`) is `usable` bytes, for a step of `static` bytes."""
    return (usable - recompute.MARGIN * static) / (1 - recompute.MARGIN) / 2**30


def _static(model) -> int:
    return recompute._static_bytes(model, next(model.parameters()).device)


def _model(layers=4, config_class=LlamaConfig, model_class=LlamaForCausalLM, **shape):
    config = config_class(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, **shape)  # fmt: skip
    torch.manual_seed(0)
    model = model_class(config)
    cfg = build_config({"model_name_or_path": "x", "finetuning_type": "lora", "lora_target": "q_proj,v_proj",
                        "gradient_checkpointing": "auto", "use_reentrant_gc": False})  # fmt: skip
    return prepare_for_training(cfg, model)


def _loss_and_grads(model, tokens):
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=tokens, labels=tokens).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def test_every_treatment_gives_the_same_loss_and_gradients():
    model = _model()
    model.train()
    _, layers = decoder_layers(model)
    tokens = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(1))
    apply_treatments(layers, ["keep"] * 4, use_reentrant=False)
    reference_loss, reference_grads = _loss_and_grads(model, tokens)
    for treatments in (["recompute"] * 4, ["selective"] * 4, ["recompute", "selective", "keep", "selective"]):
        apply_treatments(layers, treatments, use_reentrant=False)
        loss, grads = _loss_and_grads(model, tokens)
        torch.testing.assert_close(loss, reference_loss, rtol=0, atol=0)
        for name, grad in grads.items():
            torch.testing.assert_close(grad, reference_grads[name], rtol=1e-6, atol=1e-7, msg=name)


SELECTIVE_CASES = {  # model, the ops patched in: the GEMM op whose outputs a selective layer keeps, then the norm
    "llama": ({}, {"linear": "reference", "rms_norm": "reference"}),
    "qwen3_moe": (dict(config_class=Qwen3MoeConfig, model_class=Qwen3MoeForCausalLM, num_experts=4, num_experts_per_tok=2,
                       moe_intermediate_size=16), {"moe_experts": "reference", "rms_norm": "reference"}),
}


@pytest.mark.parametrize("case", SELECTIVE_CASES)
def test_selective_recompute_reruns_elementwise_ops_but_not_matmuls(monkeypatch, case):
    """Counted where the kernels run (a cached op is still dispatched, so a profiler would count it too)."""
    from tiletune.kernels import registry
    from tiletune.patch import apply_kernels

    shape, kernels = SELECTIVE_CASES[case]
    model = _model(layers=1, **shape)
    model.train()
    _, layers = decoder_layers(model)
    apply_kernels(model, kernels)  # through tiletune's custom ops
    gemm, norm = kernels
    calls = dict.fromkeys(kernels, 0)
    for op in calls:
        impl = registry.get(op, "reference")

        def counted(*args, _op=op, _forward=impl.forward):
            calls[_op] += 1
            return _forward(*args)

        monkeypatch.setitem(registry._impls[op], "reference", dataclasses.replace(impl, forward=counted))
    tokens = torch.randint(0, 96, (2, 24))
    counts = {}
    for treatment in ("keep", "selective", "recompute"):
        apply_treatments(layers, [treatment], use_reentrant=False)
        calls.update(dict.fromkeys(calls, 0))
        _loss_and_grads(model, tokens)
        counts[treatment] = dict(calls)
    assert counts["selective"][gemm] == counts["keep"][gemm] < counts["recompute"][gemm]
    assert counts["keep"][norm] < counts["selective"][norm] == counts["recompute"][norm]


def test_a_selective_moe_layer_keeps_the_experts_input_and_computes_their_rows_again(monkeypatch):
    """In a selective layer moe_experts runs without keep_rows, in its forward and its recomputation: the backward
    computes the gate_up rows again from the kept input. A kept layer keeps the rows; loss and gradients agree."""
    from tiletune.kernels import moe_experts as moe
    from tiletune.patch import apply_kernels

    shape, kernels = SELECTIVE_CASES["qwen3_moe"]
    model = _model(layers=1, **shape)
    model.train()
    _, layers = decoder_layers(model)
    apply_kernels(model, kernels)
    calls, backward_inputs = [], []
    op, backward = moe.moe_experts, moe._experts_backward
    monkeypatch.setattr(moe, "moe_experts", lambda *args, keep_rows=True, **kwargs: calls.append(keep_rows)
                        or op(*args, keep_rows=keep_rows, **kwargs))
    monkeypatch.setattr(moe, "_experts_backward", lambda *args, **kwargs: backward_inputs.append(
        kwargs.get("hidden") is not None) or backward(*args, **kwargs))
    tokens = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(2))
    results = {}
    for treatment, keeps in (("keep", [True]), ("selective", [False, False])):
        apply_treatments(layers, [treatment], use_reentrant=False)
        calls.clear(), backward_inputs.clear()
        results[treatment] = _loss_and_grads(model, tokens)
        assert calls == keeps and backward_inputs == [not keeps[0]]
    torch.testing.assert_close(results["selective"][0], results["keep"][0], rtol=0, atol=0)
    for name, grad in results["selective"][1].items():
        torch.testing.assert_close(grad, results["keep"][1][name], rtol=1e-6, atol=1e-7, msg=name)


def test_the_margin_is_taken_from_what_the_step_allocates_beyond_its_weights():
    """A budget mostly filled by frozen weights (Qwen3-30B-A3B's 12 layers: 15.3 of 16.3 GiB) keeps all but 5% of
    the room left beside them; a budget with no weights in it keeps 95%."""
    gib = 2**30
    assert recompute.usable_bytes(int(16.3 * gib), int(15.3 * gib)) == pytest.approx(16.25 * gib, abs=2)
    assert recompute.usable_bytes(20 * gib, 0) == 19 * gib
    assert recompute.usable_bytes(10 * gib, 12 * gib) == 10 * gib  # weights above the budget: the plan refuses it


def test_plan_on_cpu_measures_saved_activations_and_fits_the_budget():
    model = _model()
    plan = plan_recomputation(model, batch=2, seq=32, dtype=torch.float32, budget_gib=None, use_reentrant=False)
    assert plan.treatments == ["keep"] * 4 and plan.keep_bytes > 0  # no budget on the CPU: recompute nothing
    layer_bytes, base = plan.keep_bytes, plan.base_bytes
    budget = _budget_gib(base + 2.5 * layer_bytes, static=base)  # room for two layers and a half after the margin
    plan = plan_recomputation(model, batch=2, seq=32, dtype=torch.float32, budget_gib=budget, use_reentrant=False)
    assert plan.treatments == ["recompute", "recompute", "keep", "keep"]
    assert [layer.gradient_checkpointing for layer in decoder_layers(model)[1]] == [True, True, False, False]
    assert all(p.grad is None for p in model.parameters())  # the probe leaves no gradients behind
    with pytest.raises(UserError, match="below the .* GiB this step needs"):
        plan_recomputation(model, batch=2, seq=32, dtype=torch.float32, budget_gib=base / 2 / 2**30, use_reentrant=False)


def test_a_stack_of_alike_layers_is_probed_on_its_first_few_and_restored(monkeypatch):
    """Eight alike layers: the probe runs PROBE_LAYERS of them (the others never run while planning), the model gets
    its whole stack back, and the plan is the one a probe of every layer gives."""
    from tiletune.train import recompute

    model = _model(layers=8)
    _, layers = decoder_layers(model)
    assert recompute.probe_depth(layers) == recompute.PROBE_LAYERS == 4
    calls = [0] * 8
    for index, layer in enumerate(layers):
        layer.register_forward_pre_hook(lambda *args, i=index: calls.__setitem__(i, calls[i] + 1))
    plan = plan_recomputation(model, batch=2, seq=32, dtype=torch.float32, budget_gib=None, use_reentrant=False)
    assert calls[4:] == [0] * 4 and all(calls[:4])
    assert decoder_layers(model)[1] is layers and len(layers) == 8 and len(plan.treatments) == 8
    budget = (plan.base_bytes + 2.5 * plan.keep_bytes) / 0.95 / 2**30
    subset = plan_recomputation(model, batch=2, seq=32, dtype=torch.float32, budget_gib=budget, use_reentrant=False)
    monkeypatch.setattr(recompute, "PROBE_LAYERS", 8)  # a probe of the whole stack
    whole = plan_recomputation(model, batch=2, seq=32, dtype=torch.float32, budget_gib=budget, use_reentrant=False)
    assert subset.treatments == whole.treatments == ["recompute"] * 6 + ["keep"] * 2
    assert (subset.base_bytes, subset.keep_bytes) == (whole.base_bytes, whole.keep_bytes)


def test_unlike_layers_are_all_probed():
    """Gemma 3's sliding and global attention layers (or any layer with other shapes) are not extrapolated."""
    from transformers import Gemma3TextConfig, Gemma3ForCausalLM

    from tiletune.train.recompute import probe_depth

    config = Gemma3TextConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=6, head_dim=8,
                              num_attention_heads=4, num_key_value_heads=2, sliding_window_pattern=3)  # fmt: skip
    gemma = Gemma3ForCausalLM(config)
    assert len({layer.self_attn.is_sliding for layer in gemma.model.layers}) == 2
    assert probe_depth(gemma.model.layers) == 6
    llama = _model(layers=6)
    _, layers = decoder_layers(llama)
    assert probe_depth(layers) == 4
    layers[5].mlp.down_proj.weight.requires_grad_(True)  # trained in one layer only: its gradients differ
    assert probe_depth(layers) == 6


@pytest.mark.parametrize("raw,message", [
    ({"gradient_checkpointing": "auto", "disable_gradient_checkpointing": True}, "contradicts"),
    ({"gradient_checkpointing": "auto", "gradient_checkpointing_budget": -3}, "positive number of GiB"),
    ({"gradient_checkpointing_budget": 20}, "only with gradient_checkpointing=auto"),
    ({"gradient_checkpointing_offload": True}, "offload is read only with gradient_checkpointing=auto"),
    ({"gradient_checkpointing": "auto", "gradient_checkpointing_host_budget": 40}, "only with gradient_checkpointing_offload"),
    ({"gradient_checkpointing": "auto", "gradient_checkpointing_offload": True, "gradient_checkpointing_host_budget": 0},
     "host_budget=0.0 must be a positive number of GiB"),
    ({"gradient_checkpointing": "sometimes"}, "allowed: bool or one of 'auto' or null"),
])  # fmt: skip
def test_config_refuses_contradictions(raw, message):
    with pytest.raises(UserError, match=message):
        build_config({"model_name_or_path": "x", **raw})


def test_host_budget_is_half_the_free_memory_unless_set(monkeypatch):
    from tiletune.train import recompute

    monkeypatch.setattr(recompute, "_host_available_bytes", lambda: 100 * 2**30)
    assert recompute._host_budget_bytes(None) == 50 * 2**30
    assert recompute._host_budget_bytes(80) == 80 * 2**30
    with pytest.raises(UserError, match="host_budget=120 GiB is more than the 100.0 GiB of host memory free"):
        recompute._host_budget_bytes(120)


def test_checkpointing_follows_llamafactory_keys_unless_set():
    def mode(**raw):
        return build_config({"model_name_or_path": "x", **raw}).checkpointing

    assert mode() == "on" and mode(disable_gradient_checkpointing=True) == "off"
    assert mode(gradient_checkpointing=False) == "off" and mode(gradient_checkpointing="auto") == "auto"


def test_bench_variant_with_overrides_records_the_plan(tmp_path):
    config = tmp_path / "b.yaml"
    config.write_text("model_name_or_path: unused\nfinetuning_type: lora\nlora_target: q_proj,v_proj\n")
    out = tmp_path / "bench"
    args = ["bench", str(config), "--model-preset", "tiny", "--variants", "baseline,rms_norm+swiglu:gradient_checkpointing=auto",
            "--batch", "2", "--seq", "32", "--steps", "2", "--warmup", "1", "--repeats", "1", "--out", str(out)]  # fmt: skip
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    rows = {r["variant"]: r for r in json.loads((out / "bench.json").read_text())["variants"]}
    auto = rows["rms_norm+swiglu:gradient_checkpointing=auto"]
    assert auto["tflops_per_step"] < rows["baseline"]["tflops_per_step"]
    assert set(auto["patched"]["ops"]) == {"rms_norm", "swiglu"}
    runs = [json.loads(line) for line in (out / "runs.jsonl").read_text().splitlines()]
    plan = next(r["recompute"] for r in runs if r["variant"].startswith("rms_norm"))
    assert plan["treatments"] == ["keep", "keep"] and runs[0]["recompute"] is None


def test_recomputed_inputs_go_to_the_host_up_to_its_room_then_stay_on_the_device():
    """The host holds 3 layers' inputs; 2 more stay on the device (10 each), within the free bytes; when they do
    not fit, spared layers are recomputed instead, lowest first; when nothing is left to give way, a clear error."""
    held = {"keep": 25, "selective": 15, "recompute": 0, "recompute_device": 10}
    five = ["recompute"] * 5
    assert place_recomputed_inputs(five, 3, 20, held) == ["recompute"] * 3 + ["recompute_device"] * 2
    assert place_recomputed_inputs(five, 9, 0, held) == five  # room for all: nothing on the device
    assert place_recomputed_inputs(five, 9, -5, held) == five  # within the budget, not its margin: as above
    mixed = ["recompute"] * 4 + ["selective", "keep"]
    # 1 input on the device (10) + selective (15) + keep (25) = 50 > 45: the selective layer gives way
    assert place_recomputed_inputs(mixed, 3, 45, held) == ["recompute"] * 3 + ["recompute_device"] * 2 + ["keep"]
    with pytest.raises(ValueError, match="host memory holds 3 layers' inputs and the GPU budget 1 more; 5 are recomputed"):
        place_recomputed_inputs(five, 3, 19, held)
    plan = RecomputePlan(["recompute", "recompute_device", "keep"], 100, 50, 25, 15, "cuda memory", input_bytes=10,
                         offload_inputs=True)  # fmt: skip
    assert plan.held_bytes == {"keep": 35, "selective": 25, "offload": 0, "recompute": 0, "recompute_device": 10}
    assert plan.predicted_peak_bytes == 50 + 10 + 25 + 10  # the device-held input and the kept layer (with its input)


@pytest.mark.parametrize("forward_ms, copy_gib, pulled", [
    (5.0, 0.58, False),  # the 8-layer MoE step: the lm_head's 11.5 ms copy spares one layer's 5 ms of recomputation
    (30.0, 0.58, True),  # layers of 30 ms: the same copy pays off
    (30.0, 0.02, False),  # a small head frees too little to spare a layer: nothing gained
])
def test_an_eager_lever_is_pulled_only_where_the_recomputation_it_spares_costs_more_than_its_copy(
        monkeypatch, forward_ms, copy_gib, pulled):  # fmt: skip
    """8 layers holding 0.72 GiB each when kept, 0.3 GiB free under the budget's margin, a 54 GB/s host link (the
    H100 run of benchmarks/results/h100-2026-12-06's moe-auto)."""
    monkeypatch.setattr(recompute, "_host_link_bytes_per_s", lambda device, nbytes: 54e9)
    gib = 2**30
    keep = int(0.72 * gib)
    probe = recompute._ProbeResult(held={3: keep, 2: keep}, peak=0, peak_below=0, input_bytes=0, forward_ms=forward_ms,
                                   on_gpu=True, depth=4)  # fmt: skip
    lever = recompute.Lever("lm_head on host", lambda model: None, lambda model: None, lambda model: "",
                            eager=True, copied_bytes=lambda model: int(copy_gib * gib))  # fmt: skip
    usable = 14 * gib
    base = usable - int(0.3 * gib)
    assert recompute._recomputed(probe, base, 8, usable, offload_inputs=False) == 8
    assert recompute._pays_off(lever, None, probe, base, 8, usable, False, torch.device("cpu")) is pulled



@pytest.mark.parametrize("loss_ms_after, kept", [
    (40.0, False),  # the head read in slices from the host: 38 ms more in the loss for 3 layers' 12 ms
    (6.0, True),  # a copy that hides behind the loss's GEMMs: 4 ms more for 12 ms spared
])
def test_an_eager_lever_stays_only_where_its_measured_cost_is_less_than_what_it_spares(loss_ms_after, kept):
    """8 layers of 0.72 GiB kept; the lever frees 2.2 GiB, so 3 more layers are spared (4 ms forwards each); its
    cost is the loss's time after it less before it, probe to probe."""
    gib = 2**30
    keep = int(0.72 * gib)

    def probe(loss_ms):
        return recompute._ProbeResult(held={3: keep, 2: keep}, peak=0, peak_below=0, input_bytes=0, forward_ms=4.0,
                                      on_gpu=True, depth=4, loss_ms=loss_ms)  # fmt: skip

    usable = 14 * gib
    lever = recompute.Lever("lm_head on host", lambda model: None, lambda model: None, lambda model: "", eager=True)
    before = recompute._Before(probe(2.0), usable - int(0.3 * gib), usable, {}, lever, lambda: None)
    after_base = before.base - int(2.2 * gib)
    assert (recompute._recomputed(before.probe, before.base, 8, usable, False)
            - recompute._recomputed(before.probe, after_base, 8, usable, False)) == 3
    assert recompute._paid_off(before, probe(loss_ms_after), after_base, usable, 8, False) is kept
    assert recompute._paid_off(before, None, None, usable, 8, False) is False  # out of memory with it: undone
    needed = before._replace(base=usable + gib)  # the step did not fit without it: kept whatever it costs
    assert recompute._paid_off(needed, probe(loss_ms_after), after_base, usable, 8, False) is True

def _fresh_gpu_shape(intermediate: int, layers: int):
    """(LlamaConfig, LoRA q,v config with `auto`) of a 1024-wide model for the planner's GPU tests, with the memory an
    earlier test left freed first: the planner measures the whole device."""
    gc.collect()
    torch.cuda.empty_cache()
    config = LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=intermediate, num_hidden_layers=layers,
                         num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=8192)  # fmt: skip
    cfg = build_config({"model_name_or_path": "x", "finetuning_type": "lora", "lora_target": "q_proj,v_proj",
                        "gradient_checkpointing": "auto"})  # fmt: skip
    return config, cfg


@pytest.mark.gpu
@pytest.mark.parametrize("inputs_on_host", [False, True], ids=["inputs-on-gpu", "inputs-on-host"])
def test_on_the_gpu_a_probe_of_four_layers_predicts_the_whole_stack(monkeypatch, inputs_on_host):
    """12 alike layers at 8,192 tokens: the all-recomputed peak extrapolated from a probe of 4 layers is within 2% of
    a probe of all 12 (a recomputed layer adds its input, or nothing while it waits on the host), and a plan from
    the short probe keeps its step within the budget."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU: run on a CUDA machine (pytest -m gpu)")
    from _gpu_step import measured_step

    from tiletune.patch import apply_kernels
    from tiletune.train import recompute

    config, cfg = _fresh_gpu_shape(intermediate=4096, layers=12)
    torch.manual_seed(0)
    model = prepare_for_training(cfg, LlamaForCausalLM(config).to("cuda", torch.bfloat16))
    apply_kernels(model, {"linear_cross_entropy": "chunked"})
    tokens = torch.randint(0, 32000, (1, 8192), device="cuda")
    plan = functools.partial(plan_recomputation, model, 1, 8192, torch.bfloat16, use_reentrant=True, offload=inputs_on_host)
    short = plan(budget_gib=None)
    monkeypatch.setattr(recompute, "PROBE_LAYERS", 12)
    whole = plan(budget_gib=None)
    assert short.base_bytes == pytest.approx(whole.base_bytes, rel=0.02), (short.to_dict(), whole.to_dict())
    assert short.keep_bytes == pytest.approx(whole.keep_bytes, rel=0.02)
    monkeypatch.setattr(recompute, "PROBE_LAYERS", 4)
    budget = _budget_gib(short.base_bytes + 5 * short.keep_bytes, static=_static(model))
    planned = plan(budget_gib=budget)
    assert "recompute" in planned.treatments and len(set(planned.treatments)) > 1, planned.summary()
    _, peak = measured_step(model, tokens)
    assert peak <= budget * 2**30, (peak / 2**30, planned.summary())


@pytest.mark.gpu
def test_the_probes_memory_pool_is_handed_back_after_planning(monkeypatch):
    """A probe's high-water mark (here 1 GiB more, allocated and freed inside each probe) is not left reserved for
    the step: the caching allocator keeps freed blocks until emptied, and the planned step may need far less."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU: run on a CUDA machine (pytest -m gpu)")
    from tiletune.train import recompute

    probe = recompute._probe

    def with_a_high_water_mark(*args, **kwargs):
        torch.empty(2**30, dtype=torch.uint8, device="cuda")  # freed at once, kept in the allocator's pool
        return probe(*args, **kwargs)

    monkeypatch.setattr(recompute, "_probe", with_a_high_water_mark)
    model = _model(layers=2).to("cuda")
    torch.cuda.empty_cache()
    plan_recomputation(model, batch=2, seq=32, dtype=torch.float32, budget_gib=None, use_reentrant=False)
    assert torch.cuda.memory_reserved() < torch.cuda.memory_allocated() + 2**29


@pytest.mark.gpu
def test_levers_are_pulled_in_order_when_recomputation_is_not_enough():
    """A budget that makes layers recompute moves the lm_head to the host (its copy hides behind the forward); one
    below the all-recomputed step moves the input embeddings there, and that is enough when it frees what is missing
    (the margin is taken from the activations, not the weights); one below what both save also chunks the MLPs; each
    plan's step stays within its budget and computes the same loss."""
    from _gpu_step import measured_step

    # a wide MLP, so a layer's backward (not the loss's chunk of logits) is the peak: 256 MiB per intermediate
    config, cfg = _fresh_gpu_shape(intermediate=16384, layers=4)
    tokens = torch.randint(0, 32000, (1, 8192), device="cuda")
    table = 32000 * 1024 * 2

    def fresh():  # the loss chunked, so the peak is a layer's backward, not the [tokens, vocab] logits
        from tiletune.patch import apply_kernels

        torch.manual_seed(0)
        model = prepare_for_training(cfg, LlamaForCausalLM(config).to("cuda", torch.bfloat16))
        apply_kernels(model, {"linear_cross_entropy": "chunked"})
        return model

    model = fresh()
    unconstrained = plan_recomputation(model, 1, 8192, torch.bfloat16, budget_gib=None, use_reentrant=True)
    assert unconstrained.levers == []
    reference, _ = measured_step(model, tokens)
    head = "the lm_head in host memory (copied in during each forward, in slices by the fused loss)"
    embedding = "the input embeddings in host memory"
    static = _static(model)
    some_recomputed = _budget_gib(unconstrained.base_bytes + 2 * unconstrained.keep_bytes, static)
    embedding_first = _budget_gib(unconstrained.base_bytes - table // 2, static)
    all_three = _budget_gib(unconstrained.base_bytes - 2 * table - 256 * 2**20, static)
    for budget, levers in ((some_recomputed, [head]), (embedding_first, [embedding]), (all_three, [embedding, head])):
        del model  # the planner measures the whole device: the previous model (held in cycles) must be gone
        gc.collect()
        torch.cuda.empty_cache()
        model = fresh()
        plan = plan_recomputation(model, 1, 8192, torch.bfloat16, budget_gib=budget, use_reentrant=True)
        assert plan.levers[:len(levers)] == levers, plan.summary()
        assert plan.levers[len(levers):] == [] or budget == all_three, plan.summary()
        assert budget != all_three or plan.levers[2].startswith("the MLPs in "), plan.summary()
        loss, peak = measured_step(model, tokens)
        assert peak <= budget * 2**30, (peak, plan.to_dict())
        torch.testing.assert_close(loss, reference, rtol=1e-2, atol=0)
    del model
    gc.collect()
    with pytest.raises(UserError, match="with every layer recomputed"):
        plan_recomputation(fresh(), 1, 8192, torch.bfloat16, budget_gib=unconstrained.base_bytes / 4 / 2**30, use_reentrant=True)
