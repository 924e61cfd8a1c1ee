"""patch: the kernels spec, selectors, report, revert, parameter identity, PEFT, compile, training parity."""

import json
import sys
import textwrap
from types import SimpleNamespace

import peft
import pytest
import torch
from _steps import adamw_losses
from transformers import LlamaConfig, LlamaForCausalLM

from tiletune.errors import UserError
from tiletune.kernels import registry
from tiletune.numerics import errors
from tiletune.patch import apply_kernels, parse_kernel_spec, parse_layers, revert_kernels

LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 64}


def tiny_llama(layers: int = 2, seed: int = 0, attn: str = "eager", head_dim: int = 16) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim, max_position_embeddings=256,
                         rope_scaling=LLAMA3_SCALING, attn_implementation=attn)
    model = LlamaForCausalLM(config).eval()
    for p in model.parameters():  # RMSNorm weights start at 1: make them count
        torch.nn.init.normal_(p, std=0.2)
    return model


def tokens(seed: int = 1, batch: int = 2, seq: int = 11) -> torch.Tensor:
    return torch.randint(0, 128, (batch, seq), generator=torch.Generator().manual_seed(seed))


# ---- spec -----------------------------------------------------------------------------------------


def test_parse_all_none_and_per_op():
    assert parse_kernel_spec("none").ops == () and parse_kernel_spec(None).ops == ()
    assert {s.op: s.impl for s in parse_kernel_spec("all").ops} == {op: registry.default_impl(op) for op in registry.OPS
                                                                    if op not in registry.OPT_IN}
    assert registry.default_impl("rms_norm") == "tilelang" and registry.default_impl("linear_cross_entropy") == "tilelang"
    spec = parse_kernel_spec({"rms_norm": "tilelang", "linear": {"impl": "reference", "layers": "0-2,5",
                                                                 "modules": "mlp.*"}, "strict": True})
    by_op = {s.op: s for s in spec.ops}
    assert spec.strict and set(by_op) == {"rms_norm", "linear"}
    assert by_op["linear"].layers == (0, 1, 2, 5) and by_op["linear"].modules == ("mlp.*",)
    assert by_op["rms_norm"].layers is None


def test_parse_command_line_forms():
    assert [s.op for s in parse_kernel_spec("rms_norm,swiglu").ops] == ["rms_norm", "swiglu"]
    assert [(s.op, s.impl) for s in parse_kernel_spec("rope=reference").ops] == [("rope", "reference")]
    spec = parse_kernel_spec("{linear: {impl: tilelang, layers: '10'}}")
    assert spec.ops[0].layers == (10,)


@pytest.mark.parametrize("layers,expected", [("10", (10,)), (3, (3,)), ("0-3", (0, 1, 2, 3)), ("0,4,8", (0, 4, 8)),
                                             ([1, "3-4"], (1, 3, 4)), ("all", None)])
def test_parse_layers(layers, expected):
    assert parse_layers(layers) == expected


@pytest.mark.parametrize("value,message", [
    ({"rms_nrom": "tilelang"}, "unknown op 'rms_nrom'.*rms_norm, swiglu, geglu, rope, linear"),
    ({"rms_norm": "cuda"}, "unknown implementation 'cuda'; rms_norm has: reference, tilelang"),
    ({"linear": {"impl": "tilelang", "layer": "1"}}, "unknown key 'layer'"),
    ({"linear": {"layers": "3-1"}}, "bad layer selector '3-1'"),
    ({"linear": {"layers": "x"}}, "bad layer selector 'x'"),
    ({"plugins": ["no_such_plugin_mod"]}, "cannot import 'no_such_plugin_mod'"),
    ({"strict": "yes"}, "kernels.strict"),
    ({"linear_logprobs": {"layers": "0-3"}}, "binds to no module \\(the training stage calls it\\); it takes no layers"),
    ({"library": 3}, "kernels.library: expected the folder"),
])
def test_parse_errors_name_the_culprit(value, message):
    with pytest.raises(UserError, match=message):
        parse_kernel_spec(value)


# ---- apply / revert -------------------------------------------------------------------------------


def test_apply_all_patches_every_op_and_keeps_parameters():
    model = tiny_llama()
    params = [(n, id(p)) for n, p in model.named_parameters()]
    with torch.no_grad():
        before = model(tokens()).logits
    report = apply_kernels(model, "all")
    counts = {op: info["patched"] for op, info in report.to_dict()["ops"].items()}
    assert counts == {"rms_norm": 4, "swiglu": 2, "rope": 2, "linear": 14, "lora_linear": 0, "linear_cross_entropy": 1,
                      "quant_linear": 0, "quant_lora_linear": 0, "geglu": 0, "linear_logprobs": 0, "moe_experts": 0}
    assert [(n, id(p)) for n, p in model.named_parameters()] == params
    with torch.no_grad():
        torch.testing.assert_close(model(tokens()).logits, before, rtol=1e-5, atol=1e-5)
    layer = model.model.layers[0]
    assert "forward" in layer.input_layernorm.__dict__ and "forward" in layer.self_attn.__dict__
    report.revert()
    assert all("forward" not in m.__dict__ for m in model.modules())
    assert [(n, id(p)) for n, p in model.named_parameters()] == params


def test_patched_model_really_calls_the_custom_ops(monkeypatch):
    model = tiny_llama()
    calls = []
    for op in ("rms_norm", "swiglu", "rope", "linear"):
        impl = registry.get(op, "reference")
        monkeypatch.setitem(registry._impls[op], "reference",
                            impl.__class__(**{**impl.__dict__, "forward": (lambda f, o: lambda *a: calls.append(o) or f(*a))(impl.forward, op)}))
    apply_kernels(model, "all")
    with torch.no_grad():
        model(tokens())
    assert {op: calls.count(op) for op in set(calls)} == {"rms_norm": 5 - 1, "swiglu": 2, "rope": 2, "linear": 14}


def test_selectors_layers_and_module_globs():
    model = tiny_llama(layers=3)
    report = apply_kernels(model, {"linear": {"impl": "tilelang", "layers": "1", "modules": ["mlp.gate_proj", "self_attn.[qk]_proj"]},
                                   "rms_norm": {"layers": "0,2", "modules": "post_*"}})
    got = sorted((e.op, e.layer, e.module) for e in report.entries)
    assert got == [("linear", 1, "mlp.gate_proj"), ("linear", 1, "self_attn.k_proj"), ("linear", 1, "self_attn.q_proj"),
                   ("rms_norm", 0, "post_attention_layernorm"), ("rms_norm", 2, "post_attention_layernorm")]
    assert "forward" in model.model.layers[1].mlp.gate_proj.__dict__
    assert "forward" not in model.model.layers[0].mlp.gate_proj.__dict__
    revert_kernels(model)
    assert all("forward" not in m.__dict__ for m in model.modules())


@pytest.mark.parametrize("spec,message", [
    ({"linear": {"layers": "7"}}, "layer 7 does not exist; the model has layers 0-1"),
    ({"linear": {"modules": ["mlp.gate"]}}, "'mlp.gate' matches no linear module; candidates.*mlp.gate_proj"),
])
def test_apply_errors_name_what_exists(spec, message):
    with pytest.raises(UserError, match=message):
        apply_kernels(tiny_llama(), spec)


def test_fallback_reported_once_with_reason(tmp_path):
    model = tiny_llama()
    report = apply_kernels(model, {"rms_norm": "tilelang", "swiglu": "reference"})
    assert set(report.fallbacks()) == {"rms_norm"}
    assert "no CUDA or ROCm GPU" in report.fallbacks()["rms_norm"] or "not installed" in report.fallbacks()["rms_norm"]
    with torch.no_grad():
        model(tokens())
    saved = json.loads(report.save(tmp_path).read_text())
    assert saved["ops"]["rms_norm"]["fallback"] == report.fallbacks()["rms_norm"]
    assert saved["ops"]["swiglu"]["fallback"] is None
    assert any(item["op"] == "rms_norm" and item["calls"] >= 4 for item in saved["runtime_fallbacks"])
    summary = report.summary()
    assert "rms_norm" in summary and "falls back to reference" in summary and len(summary.splitlines()) < 25


def test_strict_turns_fallback_into_error():
    with pytest.raises(UserError, match="cannot run here.*strict"):
        apply_kernels(tiny_llama(), {"rms_norm": "tilelang", "strict": True})


def test_plugin_registers_an_implementation(tmp_path, monkeypatch):
    (tmp_path / "my_kernels_plugin.py").write_text(textwrap.dedent("""
        import tiletune.kernels
        import torch.nn.functional as F

        @tiletune.kernels.register("swiglu", "doubled")
        def doubled(gate, up):
            '''Twice silu(gate) * up: visibly not the reference.'''
            return 2 * F.silu(gate) * up
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    model = tiny_llama()
    with torch.no_grad():
        mlp = model.model.layers[0].mlp
        x = torch.randn(3, 64)
        stock = mlp(x)
        apply_kernels(model, {"swiglu": "doubled", "plugins": ["my_kernels_plugin"]})
        doubled = mlp(x)
    assert not torch.allclose(stock, doubled)
    monkeypatch.delitem(sys.modules, "my_kernels_plugin")
    registry._impls["swiglu"].pop("doubled")


def test_peft_lora_gets_kernel_on_base_layer():
    model = peft.get_peft_model(tiny_llama(), peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    params = [id(p) for p in model.parameters()]
    report = apply_kernels(model, {"linear": {"modules": ["self_attn.q_proj"]}})
    q = model.base_model.model.model.layers[0].self_attn.q_proj
    assert [e.module for e in report.entries] == ["self_attn.q_proj", "self_attn.q_proj"]
    assert "forward" in q.base_layer.__dict__ and "forward" not in q.__dict__
    assert all("forward" not in m.__dict__ for m in q.lora_A.modules())
    assert [id(p) for p in model.parameters()] == params


def lora_llama(dropout: float = 0.0):
    """tiny_llama with LoRA r4 on q_proj and v_proj, A and B drawn non-zero so the adapters count."""
    model = peft.get_peft_model(tiny_llama(), peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                              lora_dropout=dropout))
    torch.manual_seed(3)
    for p in model.parameters():
        if p.requires_grad:
            torch.nn.init.normal_(p, std=0.1)
    return model


def _loss_and_lora_grads(model, autocast: bool):
    model.zero_grad()
    ids = tokens()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = model(ids, labels=ids).loss
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters() if p.requires_grad]


@pytest.mark.parametrize("autocast", [False, True])
def test_lora_linear_gives_stock_peft_outputs_and_gradients(autocast):
    model = lora_llama()
    stock_loss, stock_grads = _loss_and_lora_grads(model, autocast)
    report = apply_kernels(model, "lora_linear")
    assert sorted((e.layer, e.module) for e in report.entries) == [(i, f"self_attn.{m}_proj") for i in (0, 1) for m in "qv"]
    assert report.fallbacks() in ({}, {"lora_linear": registry.get("lora_linear", "tilelang").unavailable()})
    q = model.base_model.model.model.layers[0].self_attn.q_proj
    assert "forward" in q.__dict__ and "forward" not in q.base_layer.__dict__
    loss, grads = _loss_and_lora_grads(model, autocast)
    torch.testing.assert_close(loss, stock_loss, rtol=1e-6, atol=1e-6)  # bf16 too: the reference rounds where peft does
    assert len(grads) == len(stock_grads) == 8
    for g, s in zip(grads, stock_grads):
        assert g.dtype == torch.float32
        if autocast:  # bf16 products summed in another order than autograd's: judged by relative L2 error
            assert errors(g, s).rel_l2 < 1e-2
        else:
            torch.testing.assert_close(g, s, rtol=1e-5, atol=1e-6)


def test_lora_linear_really_runs_the_op(monkeypatch):
    model = lora_llama()
    calls = []
    impl = registry.get("lora_linear", "reference")
    monkeypatch.setitem(registry._impls["lora_linear"], "reference",
                        impl.__class__(**{**impl.__dict__, "forward": lambda *a: calls.append(1) or impl.forward(*a)}))
    apply_kernels(model, {"lora_linear": "reference"})
    with torch.no_grad():
        model(tokens())
        assert len(calls) == 4
        with model.disable_adapter():  # adapters disabled at run time: peft's own forward
            model(tokens())
    assert len(calls) == 4


def test_lora_dropout_keeps_the_stock_forward_and_says_why():
    model = lora_llama(dropout=0.05).eval()  # eval: dropout is off, so stock and patched must agree exactly
    with torch.no_grad():
        stock = model(tokens()).logits
    report = apply_kernels(model, "lora_linear")
    assert report.fallbacks() == {"lora_linear": "lora_dropout=0.05: stock peft forward kept"}
    assert "lora_dropout=0.05: stock peft forward kept" in report.summary()
    with torch.no_grad():
        torch.testing.assert_close(model(tokens()).logits, stock, rtol=0, atol=0)


def test_linear_and_lora_linear_patch_disjoint_modules():
    model = lora_llama()
    report = apply_kernels(model, {"linear": "reference", "lora_linear": "reference"})
    by_op = {op: {(e.layer, e.module) for e in report.entries if e.op == op} for op in ("linear", "lora_linear")}
    assert by_op["lora_linear"] == {(i, f"self_attn.{m}_proj") for i in (0, 1) for m in "qv"}
    assert len(by_op["linear"]) == 10 and not by_op["linear"] & by_op["lora_linear"]
    patched = [m for m in model.modules() if "forward" in m.__dict__]
    assert len(patched) == 14 and not any(hasattr(m, "lora_A") and "forward" in m.base_layer.__dict__ for m in patched)
    # lora_linear on layer 1 only: layer 0's LoRA wrappers keep linear on their base layers
    report = apply_kernels(model, {"linear": "reference", "lora_linear": {"impl": "reference", "layers": "1"}})
    assert sum(e.op == "linear" for e in report.entries) == 12


# ---- training-level checks ------------------------------------------------------------------------


@pytest.mark.parametrize("attn,kernels", [("eager", "all"), ("sdpa", "all,attention")])
def test_torch_compile_aot_eager_on_patched_model(attn, kernels):
    model = tiny_llama(attn=attn)
    ids = tokens()
    expected_loss = model(ids, labels=ids).loss
    expected_loss.backward()
    expected_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    apply_kernels(model, kernels)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=False)
    loss = compiled(ids, labels=ids).loss
    loss.backward()
    torch.testing.assert_close(loss, expected_loss, rtol=1e-5, atol=1e-6)
    for p, g in zip(model.parameters(), expected_grads):
        torch.testing.assert_close(p.grad, g, rtol=1e-4, atol=1e-6)


def _train_lora(kernels, steps: int = 4, attn: str = "eager") -> tuple[list[float], list[torch.Tensor], int]:
    model = peft.get_peft_model(tiny_llama(attn=attn), peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
    model.train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.enable_input_require_grads()
    report = apply_kernels(model, kernels)
    assert model.base_model.model.model.gradient_checkpointing
    torch.manual_seed(0)
    for p in model.parameters():  # LoRA B starts at zero; give it values so every path carries gradient
        if p.requires_grad:
            torch.nn.init.normal_(p, std=0.05)
    losses = adamw_losses(model, tokens(), [p for p in model.parameters() if p.requires_grad], steps)
    return losses, [p.detach().clone() for p in model.parameters() if p.requires_grad], len(report.entries)


def test_lora_with_gradient_checkpointing_trains_identically_all_vs_none():
    losses_none, params_none, patched_none = _train_lora("none")
    losses_all, params_all, patched_all = _train_lora("all")
    assert patched_none == 0 and patched_all == 23  # 22 modules in the layers + the lm_head loss
    assert losses_none[-1] < losses_none[0]
    torch.testing.assert_close(torch.tensor(losses_all), torch.tensor(losses_none), rtol=1e-5, atol=1e-6)
    for a, b in zip(params_all, params_none):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


# ---- attention ------------------------------------------------------------------------------------


def test_all_leaves_attention_out_until_named():
    assert "attention" not in {s.op for s in parse_kernel_spec("all").ops}
    assert "attention" not in {s.op for s in parse_kernel_spec({"all": "reference"}).ops}
    for spec in ("all,attention", {"all": True, "attention": "tilelang"}, "attention"):
        assert {s.op: s.impl for s in parse_kernel_spec(spec).ops}["attention"] == "tilelang"
    with pytest.raises(UserError, match="unknown implementation 'flash'; attention has: reference, tilelang"):
        parse_kernel_spec({"attention": "flash"})


def _count_reference_calls(monkeypatch, op: str) -> list:
    calls = []
    impl = registry.get(op, "reference")
    monkeypatch.setitem(registry._impls[op], "reference",
                        impl.__class__(**{**impl.__dict__, "forward": lambda *a: calls.append(1) or impl.forward(*a)}))
    return calls


def _loss_and_grads(model, ids, **kwargs):
    model.zero_grad()
    loss = model(ids, labels=ids, **kwargs).loss
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_attention_gives_stock_loss_and_gradients_and_reverts(monkeypatch, dtype):
    model = tiny_llama(attn="sdpa").to(dtype).train()
    ids = tokens()
    stock_loss, stock_grads = _loss_and_grads(model, ids)
    calls = _count_reference_calls(monkeypatch, "attention")
    report = apply_kernels(model, {"attention": "reference", "rope": "reference"})  # rope patches the same forward
    assert sorted((e.op, e.layer, e.module) for e in report.entries) == [
        (op, i, "self_attn") for op in ("attention", "rope") for i in (0, 1)]
    assert report.fallbacks() == {}
    loss, grads = _loss_and_grads(model, ids)
    assert len(calls) == 2  # the op ran in both layers, not the stock SDPA
    tol = {"rtol": 1e-12, "atol": 1e-12} if dtype == torch.float64 else {"rtol": 1e-5, "atol": 1e-6}
    torch.testing.assert_close(loss, stock_loss, **tol)
    for g, s in zip(grads, stock_grads, strict=True):
        torch.testing.assert_close(g, s, **tol)
    report.revert()
    assert all("forward" not in m.__dict__ for m in model.modules())
    torch.testing.assert_close(_loss_and_grads(model, ids)[0], stock_loss, rtol=0, atol=0)
    assert len(calls) == 2


def test_attention_selects_layers_and_composes_with_rope_either_way(monkeypatch):
    model = tiny_llama(layers=3, attn="sdpa")
    calls = {op: _count_reference_calls(monkeypatch, op) for op in ("attention", "rope")}
    report = apply_kernels(model, {"attention": {"impl": "reference", "layers": "1"}, "rope": "reference"})
    assert [(e.layer, e.module) for e in report.entries if e.op == "attention"] == [(1, "self_attn")]
    with torch.no_grad():
        model(tokens())
    assert (len(calls["attention"]), len(calls["rope"])) == (1, 3)
    apply_kernels(model, {"rope": "reference", "attention": "reference"})  # the other order
    with torch.no_grad():
        model(tokens())
    assert (len(calls["attention"]), len(calls["rope"])) == (4, 6)
    revert_kernels(model)
    assert all("forward" not in m.__dict__ for m in model.modules())


def test_attention_with_a_padding_mask_runs_stock_attention_and_says_why(monkeypatch):
    model = tiny_llama(attn="sdpa").eval()
    ids = tokens()
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding
    with torch.no_grad():
        stock = model(ids, attention_mask=mask).logits
    calls = _count_reference_calls(monkeypatch, "attention")
    report = apply_kernels(model, {"attention": "reference"})
    with torch.no_grad():
        torch.testing.assert_close(model(ids, attention_mask=mask).logits, stock, rtol=0, atol=0)
    assert calls == []
    runtime = {item["reason"]: item["calls"] for item in report.to_dict()["runtime_fallbacks"] if item["op"] == "attention"}
    assert runtime.get("an attention mask (padding, packed sequences, or the eager implementation's explicit causal "
                       "mask): stock attention") == 2
    assert "fell back at run time on 2 calls: an attention mask" in report.summary()


@pytest.mark.parametrize("make,reason", [
    (lambda: tiny_llama(attn="eager"), "attn_implementation eager builds an explicit mask"),
    (lambda: _qwen2(sliding_window=4), "sliding window 4: stock attention kept"),
])
def test_attention_unfit_models_keep_stock_attention_and_say_why(make, reason):
    model = make()
    ids = tokens()
    with torch.no_grad():
        stock = model(ids).logits
    report = apply_kernels(model, "attention")
    assert reason in report.fallbacks()["attention"]
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, stock, rtol=0, atol=0)


def _qwen2(sliding_window: int):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, use_sliding_window=True, sliding_window=sliding_window, max_window_layers=0,
                         attn_implementation="sdpa")
    return Qwen2ForCausalLM(config).eval()


def test_attention_dropout_in_training_runs_stock_attention():
    model = tiny_llama(attn="sdpa")
    model.config.attention_dropout = 0.0
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.1
    report = apply_kernels(model.eval(), {"attention": "reference"})
    with torch.no_grad():
        model(tokens())  # eval: dropout is off, the op runs
    model.train()
    model(tokens())
    reasons = {item["reason"] for item in report.to_dict()["runtime_fallbacks"] if item["op"] == "attention"}
    assert "attention dropout 0.1 in training: stock attention" in reasons


def test_lora_with_gradient_checkpointing_trains_identically_with_attention(monkeypatch):
    calls = _count_reference_calls(monkeypatch, "attention")
    losses_none, params_none, _ = _train_lora("none", attn="sdpa")
    losses_attn, params_attn, patched = _train_lora({"attention": "reference", "lora_linear": "reference"}, attn="sdpa")
    assert patched == 6 and len(calls) >= 4 * 2 * 2  # steps x layers x (forward + checkpoint recompute)
    torch.testing.assert_close(torch.tensor(losses_attn), torch.tensor(losses_none), rtol=1e-5, atol=1e-6)
    for a, b in zip(params_attn, params_none, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_warmup_without_gpu_says_why():
    from tiletune.patch.warmup import warmup_kernels

    if registry.get("rms_norm", "tilelang").unavailable() is None:
        pytest.skip("TileLang can run here; with the GPU hidden it runs: CUDA_VISIBLE_DEVICES= HIP_VISIBLE_DEVICES= "
                    "python -m pytest -q tests/patch/test_patch.py -k warmup_without_gpu")
    with pytest.raises(UserError, match="cannot run here"):
        warmup_kernels(tiny_llama(), {"rms_norm": "tilelang"}, torch.bfloat16)


def test_warmup_plans_one_compile_per_kernel_shape(monkeypatch):
    """What warmup compiles, with the compile itself recorded: no GPU needed to check the plan."""
    import tiletune.patch.warmup as patch

    compiled = []
    monkeypatch.setattr(patch, "_run_once", lambda binding, shapes, impl, dtype: compiled.append((binding.op, shapes)))
    monkeypatch.setattr(registry, "get", lambda op, impl: SimpleNamespace(unavailable=lambda: None))  # as on a GPU
    with torch.device("meta"):
        model = LlamaForCausalLM(tiny_llama().config)
    done = patch.warmup_kernels(model, "all", torch.bfloat16)
    assert len(done) == len(compiled) == len(set(compiled))  # one compile per (op, static shapes)
    assert sorted({op for op, _ in compiled}) == ["linear", "linear_cross_entropy", "rms_norm", "rope", "swiglu"]
    assert [shapes for op, shapes in compiled if op == "linear_cross_entropy"] == [(128, 0.0)]  # vocabulary, soft-cap
    assert [shapes for op, shapes in compiled if op == "rms_norm"] == [(64, 1e-6, 0.0)]  # Llama's x·w form only
    assert {shapes[2] for op, shapes in compiled if op == "linear"} == {"trained"}  # full fine-tuning: dW too
    compiled.clear()
    lora = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    patch.warmup_kernels(lora, {"linear": "tilelang"}, torch.bfloat16)
    assert compiled and {shapes[2] for _, shapes in compiled} == {"frozen"}  # LoRA's base layers: no dW GEMM
    compiled.clear()
    patch.warmup_kernels(model, "attention", torch.bfloat16)
    assert compiled == [("attention", (4, 2, 16, 0.25))]  # heads q/kv, head_dim, scale: the static parameters


def test_warmup_before_a_run_skips_what_cannot_run_and_warns_for_a_failed_warm_up(monkeypatch, caplog):
    """compile_ahead's warm-up (strict=False): an op that cannot run here is left to its runtime fallback, a
    warm-up that fails to its first call, with one warning; the others compile, in threads."""
    import threading

    import tiletune.patch.warmup as patch

    threads = set()

    def run_once(binding, shapes, impl, dtype):
        threads.add(threading.current_thread().name)
        if binding.op == "swiglu":
            raise RuntimeError("no tile fits")

    monkeypatch.setattr(patch, "_run_once", run_once)
    monkeypatch.setattr(registry, "get", lambda op, impl: SimpleNamespace(
        unavailable=lambda: "needs sm_90" if op == "rope" else None))  # fmt: skip
    with torch.device("meta"):
        model = LlamaForCausalLM(tiny_llama().config)
    done = patch.warmup_kernels(model, "all", torch.bfloat16, jobs=3, strict=False)
    assert sorted({line.split()[0] for line in done}) == ["linear", "linear_cross_entropy", "rms_norm"]
    assert "warming up swiglu tilelang" in caplog.text and "no tile fits" in caplog.text
    assert threads and all(name.startswith("tiletune-warmup") for name in threads)
    with pytest.raises(UserError, match="rope implementation 'tilelang' cannot run here: needs sm_90"):
        patch.warmup_kernels(model, "all", torch.bfloat16)  # the command itself refuses


# ---- on the GPU -----------------------------------------------------------------------------------


@pytest.mark.gpu
def test_warmup_compiles_every_kernel_a_model_needs():
    from tiletune.patch.warmup import warmup_kernels

    with torch.device("meta"):
        model = LlamaForCausalLM(tiny_llama().config)
    done = warmup_kernels(model, "all", torch.bfloat16)
    assert sorted(line.split()[0] for line in done) == ["linear"] * 4 + ["linear_cross_entropy", "rms_norm", "rope",
                                                                         "swiglu"]


@pytest.mark.gpu
def test_patched_model_on_gpu_trains_like_stock():
    results = {}
    for kernels in ("none", {"rms_norm": "tilelang", "swiglu": "tilelang", "rope": "tilelang", "linear": "tilelang",
                             "strict": True}):
        model = tiny_llama().to("cuda", torch.bfloat16).train()
        report = apply_kernels(model, kernels)
        ids = tokens(batch=3, seq=77).cuda()
        loss = model(ids, labels=ids).loss
        loss.backward()
        results[str(len(report.entries))] = (loss.item(), torch.cat([p.grad.float().flatten() for p in model.parameters()]))
    (loss_stock, grad_stock), (loss_tl, grad_tl) = results["0"], results["22"]
    assert abs(loss_tl - loss_stock) / loss_stock < 1e-2
    assert torch.isfinite(grad_tl).all()
    assert torch.nn.functional.cosine_similarity(grad_tl, grad_stock, dim=0) > 0.999


@pytest.mark.gpu
def test_attention_on_gpu_trains_like_stock_sdpa():
    """A training step with TileLang attention (strict) against stock SDPA, bf16, head_dim 64, 77 tokens."""
    results, before = {}, dict(registry.runtime_fallbacks)
    for kernels in ("none", {"attention": "tilelang", "strict": True}):
        model = tiny_llama(attn="sdpa", head_dim=64).to("cuda", torch.bfloat16).train()
        report = apply_kernels(model, kernels)
        ids = tokens(batch=3, seq=77).cuda()
        loss, grads = _loss_and_grads(model, ids)
        results[len(report.entries)] = (loss.item(), torch.cat([g.float().flatten() for g in grads]))
    assert {k: n for k, n in registry.runtime_fallbacks.items() if k[0] == "attention"} == {
        k: n for k, n in before.items() if k[0] == "attention"}  # every call ran the kernels (strict: no reference)
    (loss_stock, grad_stock), (loss_tl, grad_tl) = results[0], results[2]
    assert abs(loss_tl - loss_stock) / loss_stock < 1e-2
    assert torch.isfinite(grad_tl).all()
    assert torch.nn.functional.cosine_similarity(grad_tl, grad_stock, dim=0) > 0.999


@pytest.mark.gpu
def test_lora_linear_on_gpu_trains_like_stock_peft():
    """bf16 base, float32 adapters under bf16 autocast, as training runs it; the TileLang path strict."""
    results = {}
    for kernels in ("none", {"lora_linear": "tilelang", "strict": True}):
        model = lora_llama()
        model.base_model.model.to("cuda", torch.bfloat16)
        for p in model.parameters():
            if p.requires_grad:
                p.data = p.data.float()
        report = apply_kernels(model, kernels)
        ids = tokens(batch=3, seq=77).cuda()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(ids, labels=ids).loss
        loss.backward()
        grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.requires_grad])
        results[len(report.entries)] = (loss.item(), grads)
    (loss_stock, grad_stock), (loss_tl, grad_tl) = results[0], results[4]
    assert abs(loss_tl - loss_stock) / loss_stock < 1e-2
    assert grad_tl.dtype == torch.float32 and torch.isfinite(grad_tl).all()
    assert torch.nn.functional.cosine_similarity(grad_tl, grad_stock, dim=0) > 0.999


@pytest.mark.gpu
def test_warmup_compiles_lora_linear_for_a_lora_model():
    from tiletune.patch.warmup import warmup_kernels

    with torch.device("meta"):
        model = peft.get_peft_model(LlamaForCausalLM(tiny_llama().config), peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    done = warmup_kernels(model, {"linear": "tilelang", "lora_linear": "tilelang"}, torch.bfloat16)
    assert sorted(line.split()[0] for line in done) == ["linear"] * 4 + ["lora_linear"] * 2


def test_apply_kernels_is_exported_lazily():
    import subprocess

    code = "import sys, tiletune; assert 'torch' not in sys.modules; from tiletune import apply_kernels; print(apply_kernels.__module__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "tiletune.patch"


def test_warmup_cli_reads_the_config(tmp_path):
    from click.testing import CliRunner

    from tiletune.cli import main

    tiny_llama().config.save_pretrained(tmp_path / "tiny")
    config = tmp_path / "c.yaml"
    config.write_text(f"model_name_or_path: {tmp_path / 'tiny'}\nkernels: none\nbf16: true\noutput_dir: {tmp_path / 'out'}\n")
    result = CliRunner().invoke(main, ["kernels", "warmup", str(config)])
    assert result.exit_code == 0 and "nothing to compile" in result.output
    if registry.get("rms_norm", "tilelang").unavailable():
        result = CliRunner().invoke(main, ["kernels", "warmup", str(config), "kernels=rms_norm"])
        assert result.exit_code == 2 and "cannot run here" in result.output
