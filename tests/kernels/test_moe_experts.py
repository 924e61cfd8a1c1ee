"""moe_experts: the routing's tile schedule, the reference against transformers' own experts in float64, a
wrong kernel caught by the gate, the binding on tiny Qwen3-MoE and Mixtral models, and (GPU) the TileLang
grouped GEMMs against float64 at Qwen3-30B-A3B's and Mixtral-8x7B's expert shapes."""

import pytest
import torch
import torch.nn.functional as F
import transformers

from tiletune.kernels import moe_experts as moe
from tiletune.kernels import registry
from tiletune.kernels.moe_experts import moe_experts, route
from tiletune.numerics import gate
from tiletune.patch import apply_kernels


def routes(tokens, experts, k, seed=0, device="cpu"):
    """Top-k routes with distinct experts per token and softmax weights; expert 1 never chosen (an empty group)."""
    gen = torch.Generator().manual_seed(seed)
    scores = torch.rand(tokens, experts, generator=gen)
    scores[:, 1] = -1
    weights, index = scores.topk(k, dim=-1)
    return index.to(device), torch.softmax(weights, dim=-1).to(device)


@pytest.mark.parametrize("tokens,experts,k,block", [(77, 8, 2, 64), (5, 8, 2, 4), (300, 16, 4, 16), (1, 4, 1, 64)])
def test_the_tile_schedule_covers_every_sorted_row_once_within_its_expert(tokens, experts, k, block):
    index, _ = routes(tokens, experts, k)
    routing = route(index, experts, block)
    rows = tokens * k
    assert routing.tiles.shape == ((rows + block - 1) // block + experts, 3)
    sorted_experts = index.reshape(-1)[routing.order]
    assert torch.equal(sorted_experts, sorted_experts.sort().values)  # rows sorted by expert
    assert torch.equal(routing.token, routing.order // k)
    covered = torch.zeros(rows, dtype=torch.int64)
    for expert, first, end in routing.tiles.tolist():
        if expert < 0:
            continue
        stop = min(first + block, end)
        assert first < stop and (sorted_experts[first:stop] == expert).all()
        covered[first:stop] += 1
    assert (covered == 1).all()
    assert routing.offsets.tolist() == [int((sorted_experts < e).sum()) for e in range(experts + 1)]


def _stock_experts(config_class, **shape):
    config = getattr(transformers, config_class)(hidden_size=32, hidden_act="silu", **shape)
    config._experts_implementation = "eager"  # transformers' own per-expert loop
    module_name = {"Qwen3MoeConfig": "qwen3_moe", "MixtralConfig": "mixtral"}[config_class]
    classes = {"qwen3_moe": "Qwen3MoeExperts", "mixtral": "MixtralExperts"}
    module = getattr(getattr(transformers.models, module_name), f"modeling_{module_name}")
    torch.manual_seed(0)
    experts = getattr(module, classes[module_name])(config).double()
    for param in experts.parameters():
        torch.nn.init.normal_(param, std=0.2)
    return experts


@pytest.mark.parametrize("config_class,shape", [
    ("Qwen3MoeConfig", {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 24}),
    ("MixtralConfig", {"num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 40}),
])
def test_reference_is_transformers_experts_in_float64(config_class, shape):
    experts = _stock_experts(config_class, **shape)
    num_experts, k = experts.gate_up_proj.shape[0], shape["num_experts_per_tok"]
    index, weights = routes(37, num_experts, k)
    hidden = torch.randn(37, 32, dtype=torch.float64, requires_grad=True)
    weights = weights.double().requires_grad_()
    want = experts(hidden, index, weights)
    grad_out = torch.randn_like(want)
    want_grads = torch.autograd.grad(want, (hidden, weights), grad_out)
    got = moe_experts(hidden, index, weights, experts.gate_up_proj.detach(), experts.down_proj.detach())
    got_grads = torch.autograd.grad(got, (hidden, weights), grad_out)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    for mine, theirs in zip(got_grads, want_grads):
        torch.testing.assert_close(mine, theirs, rtol=1e-10, atol=1e-12)


def test_a_kernel_with_the_wrong_activation_fails_the_gate():
    """An implementation computing gelu(gate)·up: the gate must catch it (so the GPU check can fail)."""
    def wrong_forward(hidden, top_k_index, top_k_weights, gate_up, down):
        original = moe._silu_gate
        moe._silu_gate = lambda h: F.gelu(h.chunk(2, dim=-1)[0]) * h.chunk(2, dim=-1)[1]
        try:
            return moe.reference_forward(hidden, top_k_index, top_k_weights, gate_up, down)
        finally:
            moe._silu_gate = original

    registry.add(registry.Impl("moe_experts", "gelu_by_mistake", wrong_forward, moe.reference_backward))
    try:
        index, weights = routes(50, 8, 2)
        hidden = torch.randn(50, 32)
        gate_up, down = torch.randn(8, 48, 32) / 6, torch.randn(8, 32, 24) / 5
        exact = moe_experts(hidden.double(), index, weights.double(), gate_up.double(), down.double())
        stock = moe_experts(hidden, index, weights, gate_up, down)
        assert gate(stock, stock, exact).passed
        assert not gate(moe_experts(hidden, index, weights, gate_up, down, "gelu_by_mistake"), stock, exact).passed
    finally:
        registry._impls["moe_experts"].pop("gelu_by_mistake")


MOE_MODELS = {
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {"num_local_experts": 4, "num_experts_per_tok": 2}),
}


@pytest.mark.parametrize("model_type", MOE_MODELS)
def test_bound_into_moe_models_with_the_stock_loss_and_gradients(model_type):
    config_class, model_class, extra = MOE_MODELS[model_type]
    config = getattr(transformers, config_class)(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, **extra)  # fmt: skip
    torch.manual_seed(0)
    model = getattr(transformers, model_class)(config)
    for name, param in model.named_parameters():
        param.requires_grad_("experts" not in name)  # frozen experts, as under LoRA
    ids = torch.randint(0, 128, (2, 19))
    stock = model(input_ids=ids, labels=ids).loss
    trainable = [p for p in model.parameters() if p.requires_grad]
    stock_grads = torch.autograd.grad(stock, trainable)
    report = apply_kernels(model, {"moe_experts": "reference"})
    assert report.to_dict()["ops"]["moe_experts"]["patched"] == 2 and "experts" not in report.unbound_roles
    loss = model(input_ids=ids, labels=ids).loss
    assert float(loss) == pytest.approx(float(stock), rel=1e-5)
    for mine, theirs in zip(torch.autograd.grad(loss, trainable), stock_grads):
        torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-6)
    experts = model.model.layers[0].mlp.experts
    experts.down_proj.requires_grad_(True)  # unfrozen after patching: the stock path, so the weight trains
    model(input_ids=ids, labels=ids).loss.backward()
    assert experts.down_proj.grad is not None and experts.down_proj.grad.abs().sum() > 0
    report.revert()
    experts.down_proj.requires_grad_(False)
    experts.gate_up_proj.requires_grad_(True)  # training experts: the op computes no weight gradient
    report = apply_kernels(model, {"moe_experts": "reference"})
    entry = next(e for e in report.entries if e.op == "moe_experts" and e.layer == 0)
    assert not entry.installed and "expert weights train" in entry.fallback


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name,tokens,experts,k,hidden,inter", [
    ("qwen3-30b-a3b", 8192, 128, 8, 2048, 768), ("qwen3-30b-a3b", 77, 128, 8, 2048, 768),
    ("mixtral-8x7b", 1024, 8, 2, 4096, 14336), ("mixtral-8x7b", 3, 8, 2, 4096, 14336),
])
def test_tilelang_matches_float64(dtype, name, tokens, experts, k, hidden, inter):
    from _gpu_check import check

    index, weights = routes(tokens, experts, k, device="cuda")
    x = torch.randn(tokens, hidden, device="cuda", dtype=dtype, requires_grad=True)
    w = weights.to(dtype).requires_grad_()
    gate_up = (torch.randn(experts, 2 * inter, hidden, device="cuda") / hidden**0.5).to(dtype)
    down = (torch.randn(experts, hidden, inter, device="cuda") / inter**0.5).to(dtype)
    check("moe", f"{name} tokens={tokens}", dtype, [x, w, gate_up, down],
          lambda x, w, gu, d: moe_experts(x, index, w, gu, d),
          lambda x, w, gu, d: moe_experts(x, index, w, gu, d, impl="tilelang", strict=True),
          ["y", "dhidden", "dweights"])
