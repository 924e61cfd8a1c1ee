"""Every family record against a tiny random-init model of its family: each part the record names exists,
`kernels: all` binds where the record says, and the patched model computes what the stock one does."""

import fnmatch

import pytest
import torch
import transformers
from _grads import loss_and_grads

from tiletune.families import family_of, known
from tiletune.patch import apply_kernels
from tiletune.patch.sites import causal_lm, layer_sites, layers_of

SHAPE = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 256}
MOE = {"num_experts": 4, "num_local_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
# model_type -> (config class, model class, extra config); one tiny model per record
MODELS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", MOE),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", MOE),
    # layer 0 dense, layer 1 MoE with its shared expert; layer 1 without rope (temperature-tuned queries)
    "llama4_text": ("Llama4TextConfig", "Llama4ForCausalLM",
                    {**MOE, "interleave_moe_layer_step": 2, "intermediate_size_mlp": 128, "no_rope_layers": [1, 0]}),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {}),
    "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM", {}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {"pad_token_id": 0}),
    # attention sinks, a sliding window on layer 0, YaRN rotary with each angle once, biased clamped-SwiGLU experts
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", {**MOE, "layer_types": ["sliding_attention", "full_attention"],
                                                      "sliding_window": 4}),
    # MLA (q/k heads of 16 + 8, v heads of 16; both latent norms), layer 0 dense, layer 1 routed + shared experts
    # behind a grouped sigmoid router, YaRN rotary on adjacent pairs
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                    {**MOE, "n_routed_experts": 4, "n_group": 2, "topk_group": 1, "first_k_dense_replace": 1,
                     "n_shared_experts": 1, "num_key_value_heads": 4, "q_lora_rank": 16, "kv_lora_rank": 16, "qk_rope_head_dim": 8,
                     "qk_nope_head_dim": 16, "v_head_dim": 16, "head_dim": 8,
                     "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                                      "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}}),
}
# what `kernels: all` cannot take in a family: op -> (sites it takes, the fallback of the others); every other site
# installs. The routed experts train here (a full fine-tune): moe_experts computes no weight gradient and says so
_EXPERTS_TRAIN = "the expert weights train (the op computes no weight gradient): stock experts kept"
NOT_TAKEN = {
    "llama4_text": {"rope": (1, "no rotary embedding in this layer (NoPE): stock forward kept"),  # rope on pairs in layer 0
                    "moe_experts": (0, "Llama4TextExperts.forward takes no top_k_index and top_k_weights (pre-sorted "
                                       "rows): stock experts kept")},
    "deepseek_v3": {"rope": (0, ("MLA rotary (the qk_rope_head_dim slice of each q head and one shared k head; "
                                 "adjacent pairs returned in halves order under rope_interleave): no kernel yet: stock "
                                 "forward kept")),
                    "moe_experts": (0, _EXPERTS_TRAIN)},
    "qwen3_moe": {"moe_experts": (0, _EXPERTS_TRAIN)},
    "mixtral": {"moe_experts": (0, _EXPERTS_TRAIN)},
    "gpt_oss": {"moe_experts": (0, "experts computing clamped_swiglu with biases: the op computes silu(gate)·up without "
                                   "biases: stock experts kept")},
}
EVERY_KERNEL = "all"
# attention (opt-in) and moe_experts (experts frozen) where a family refuses them, per site: op -> why (every site of
# the op's role says it)
OPT_IN_REFUSED = {
    "gpt_oss": {"attention": "attention sinks: no kernel yet: stock attention kept",
                "moe_experts": "experts computing clamped_swiglu with biases: the op computes silu(gate)·up without biases: "
                                "stock experts kept"},
    "deepseek_v3": {"attention": "multi-head latent attention (q/k head_dim 24, v head_dim 16; the op takes one "
                                 "head_dim): no kernel yet: stock attention kept"},
}
# a model type without a record: it trains stock, every op's fallback naming the missing record
UNRECORDED = {"olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {})}


def tiny(model_type: str):
    config_class, model_class, extra = MODELS[model_type]
    torch.manual_seed(0)
    config = getattr(transformers, config_class)(**{**SHAPE, **extra})
    return getattr(transformers, model_class)(config).eval()


def test_every_record_has_a_model_here():
    assert set(MODELS) == set(known())


@pytest.mark.parametrize("model_type", MODELS)
def test_every_part_the_record_names_exists(model_type):
    model = tiny(model_type)
    family = family_of(model.config)
    layers = layers_of(causal_lm(model)[0], family)
    assert len(layers) == 2
    roles = {}
    for index, layer in enumerate(layers):
        for site in layer_sites(family, index, layer):
            roles.setdefault(site.role, set()).add(site.path)
    assert all(fnmatch.filter(roles["norm"], norm.path) for norm in family.norms)  # no norm glob matches nothing
    assert {"rotary", "attention", "linear"} <= set(roles)
    assert ("mlp" in roles) == (family.mlp is not None) and ("experts" in roles) == (family.experts is not None)


@pytest.mark.parametrize("model_type", MODELS)
def test_kernels_all_binds_and_computes_as_stock(model_type):
    model = tiny(model_type)
    family = family_of(model.config)
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        stock = model(ids).logits
    report = apply_kernels(model, EVERY_KERNEL)
    patched = {op: info["patched"] for op, info in report.to_dict()["ops"].items()}
    assert report.family == family.name and not report.unbound
    mlp_op = {"silu": "swiglu", "gelu_tanh": "geglu"}[family.mlp.activation] if family.mlp else None
    expected = {"rms_norm": len(family.norms) * 2, "rope": 2, "linear_cross_entropy": 1, **({mlp_op: 2} if mlp_op else {})}
    for op, (taken, fallback) in NOT_TAKEN.get(model_type, {}).items():
        expected[op] = taken
        assert {e.fallback for e in report.entries if e.op == op and not e.installed} == {fallback}
    assert {op: patched[op] for op in expected} == expected and patched["linear"] >= 8
    assert all(entry.installed for entry in report.entries if entry.op not in NOT_TAKEN.get(model_type, {}))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, stock, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("model_type", MODELS)
def test_a_training_step_with_every_kernel_equals_stock(model_type):
    """Loss and every gradient of one training step (the lm_head's fused loss included) as the stock model's."""
    model = tiny(model_type).train()
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(1))
    runs = []
    for spec in ("", EVERY_KERNEL):
        apply_kernels(model, spec)
        runs.append(loss_and_grads(model, ids))
    (stock_loss, stock_grads), (loss, grads) = runs
    torch.testing.assert_close(loss, stock_loss, rtol=1e-5, atol=1e-6)
    assert set(grads) == set(stock_grads)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, stock_grads[name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("model_type", UNRECORDED)
def test_a_family_without_a_record_trains_stock_and_every_op_says_why(model_type):
    config_class, model_class, extra = UNRECORDED[model_type]
    torch.manual_seed(0)
    model = getattr(transformers, model_class)(getattr(transformers, config_class)(**{**SHAPE, **extra}))
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(1))
    stock = model(input_ids=ids, labels=ids).loss.detach()
    report = apply_kernels(model, EVERY_KERNEL)
    assert report.family is None and not any(entry.installed for entry in report.entries)
    reasons = {info["fallback"] for info in report.to_dict()["ops"].values()}
    assert len(reasons) == 1 and reasons.pop().startswith(f"no family record for model_type {model_type!r}")
    torch.testing.assert_close(model(input_ids=ids, labels=ids).loss.detach(), stock, rtol=0, atol=0)


@pytest.mark.parametrize("model_type", OPT_IN_REFUSED)
def test_opt_in_ops_refuse_what_they_cannot_compute_and_say_why(model_type):
    """attention (opt-in) named on top of `all`, the routed experts frozen (as under LoRA): every site of an op
    the family refuses reports why and keeps its stock forward, the others install, and a training step computes
    what the stock model's does."""
    model = tiny(model_type).train()
    for name, param in model.named_parameters():
        if ".experts." in name:
            param.requires_grad_(False)
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(1))
    runs = []
    for spec in ("", "all,attention"):
        report = apply_kernels(model, spec)
        runs.append(loss_and_grads(model, ids))
    refused = OPT_IN_REFUSED[model_type]
    for op in ("attention", "moe_experts"):
        entries = [e for e in report.entries if e.op == op]
        assert len(entries) == (2 if op == "attention" else 1 + (model_type == "gpt_oss"))  # deepseek: layer 1 only
        if op in refused:
            assert all(not e.installed and e.fallback == refused[op] for e in entries), entries
            assert report.to_dict()["ops"][op]["fallback"] == refused[op]
        else:
            assert all(e.installed for e in entries)
    (stock_loss, stock_grads), (loss, grads) = runs
    torch.testing.assert_close(loss, stock_loss, rtol=1e-5, atol=1e-6)
    assert set(grads) == set(stock_grads)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, stock_grads[name], rtol=1e-4, atol=1e-6, msg=name)


def test_gpt_oss_norms_and_rotary_compute_bit_for_bit_as_stock_in_bfloat16():
    """GPT-OSS's RMSNorm rounds once (its weight kept in float32, as transformers loads it) and its rotary holds each
    angle once: rms_norm (round_once) and rope (half_angles) reproduce both exactly in bfloat16, not just closely."""
    model = tiny("gpt_oss").to(torch.bfloat16)
    for layer in model.model.layers:
        layer.input_layernorm.float()
        layer.post_attention_layernorm.float()
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        stock = model(ids).logits
        report = apply_kernels(model, "rms_norm=reference,rope=reference")
        assert [e.op for e in report.entries if e.installed] == ["rms_norm"] * 4 + ["rope"] * 2
        assert torch.equal(model(ids).logits, stock)


# these families' presets, in billions of parameters as their model cards give them (DeepSeek-V3 without its
# multi-token-prediction layer, which transformers does not build)
PUBLISHED = {"gpt-oss-20b": 20.91, "deepseek-v3": 671.0, "moonlight-16b-a3b": 16.0}


@pytest.mark.parametrize("name", PUBLISHED)
def test_presets_build_at_their_published_size_into_the_record(name):
    from transformers import AutoModelForCausalLM

    from tiletune.train.presets import preset_config

    config = preset_config(name)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert family_of(config) is not None
    assert sum(p.numel() for p in model.parameters()) / 1e9 == pytest.approx(PUBLISHED[name], rel=0.01)
    if config.model_type == "deepseek_v3":  # the rotary embedding turns the qk_rope_head_dim slice
        assert config.head_dim == config.qk_rope_head_dim
