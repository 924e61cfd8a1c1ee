"""moe_experts: the routing's tile schedule, the reference against transformers' own experts in float64, a
wrong kernel caught by the gate, the binding on tiny Qwen3-MoE and Mixtral models, and (GPU) the TileLang
grouped GEMMs against float64 at Qwen3-30B-A3B's and Mixtral-8x7B's expert shapes. The LoRA form (LoRA on the
expert weights, peft's target_parameters): against the merged weights W + s·B·A in float64, its custom op, every
variant's tile schedule, the binding against peft's own path on tiny models (and each adapter state it leaves to
peft, named per call), and (GPU) its TileLang path against float64."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F
import transformers

from tiletune import families
from tiletune.errors import UserError
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


def test_without_tiles_the_routing_is_the_same_and_its_schedule_keeps_its_shape():
    """GEMMs that read the offsets alone (torch's grouped GEMM) skip the tile schedule: the same order, tokens and
    offsets, and a schedule of the shape the custom op's schema gives it."""
    index, _ = routes(300, 16, 4)
    full, lean = route(index, 16), route(index, 16, tiles=False)
    for name in ("token", "order", "offsets"):
        assert torch.equal(getattr(lean, name), getattr(full, name)), name
    assert lean.tiles.shape == full.tiles.shape and lean.tiles.dtype == torch.int32


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


@pytest.mark.parametrize("tokens,experts,k,block", [(300, 16, 4, 128), (77, 8, 2, 128), (1, 4, 1, 256)])
def test_larger_tiles_keep_the_smallest_tiles_bound_with_the_active_tiles_first(tokens, experts, k, block):
    """A config of block_m > BLOCK_M routes into the tiles tensor sized for BLOCK_M (the custom op's fake shape):
    its active tiles first, -1 after, and no more active tiles than its own bound (grouped_gemm's slice)."""
    index, _ = routes(tokens, experts, k)
    routing = route(index, experts, block, moe.BLOCK_M)
    rows = tokens * k
    assert routing.tiles.shape == (-(-rows // moe.BLOCK_M) + experts, 3)
    active = (routing.tiles[:, 0] >= 0).int()
    assert torch.equal(active, active.sort(descending=True, stable=True).values)  # active tiles first
    assert int(active.sum()) <= -(-rows // block) + experts
    sorted_experts = index.reshape(-1)[routing.order]
    covered = torch.zeros(rows, dtype=torch.int64)
    for expert, first, end in routing.tiles.tolist():
        if expert >= 0:
            covered[first:min(first + block, end)] += 1
            assert (sorted_experts[first:min(first + block, end)] == expert).all()
    assert (covered == 1).all()
    with pytest.raises(AssertionError):
        route(index, experts, 32, 64)


def _emulated_grouped_gemm(config):
    """grouped_gemm(config)'s arithmetic in PyTorch, tile by tile as the kernel runs it: the routing's tiles cut
    to the config's bound, each tile's block_m rows from its first (zero past the last row, as TMA fills them;
    gathered: the token of each row, the expert's last row past its end) times its expert's weights, stored below
    the expert's end."""
    def gemm(kind, x, weights, routing, gathered=False):
        experts, n, k = weights.shape
        count = routing.token.shape[0] if gathered else x.shape[0]
        tiles = routing.tiles[: -(-count // config.block_m) + experts]
        padded = torch.cat([x, x.new_zeros(config.block_m, x.shape[1])])
        out = torch.full((count, n if kind == "nt" else k), float("nan"), dtype=x.dtype)
        for expert, first, end in tiles.tolist():
            if expert >= 0:
                w = weights[expert]
                if gathered:
                    rows = x[routing.token[torch.arange(first, first + config.block_m).clamp(max=end - 1)]]
                else:
                    rows = padded[first:first + config.block_m]
                block = rows @ (w.t() if kind == "nt" else w)
                stop = min(first + config.block_m, end)
                out[first:stop] = block[: stop - first]
        return out
    return gemm


@pytest.mark.parametrize("variant", sorted(moe.VARIANTS))
def test_every_variants_tile_schedule_computes_the_reference(variant):
    """The forward and backward with each variant's block_m and bound (in float64, emulated on the CPU) equal the
    expert loop's: every row written by its own expert's tiles, an empty expert (1) included."""
    config = moe.VARIANTS[variant]
    index, weights = routes(600, 8, 2)  # ~170 rows per expert: several tiles of each block_m
    torch.manual_seed(0)
    hidden, gate_up, down = torch.randn(600, 16).double(), torch.randn(8, 48, 16).double(), torch.randn(8, 16, 24).double()
    want = moe._experts_forward(moe._loop_gemm, hidden, index, weights.double(), gate_up, down)
    got = moe._experts_forward(_emulated_grouped_gemm(config), hidden, index, weights.double(), gate_up, down,
                               config.block_m)
    torch.testing.assert_close(got[0], want[0], rtol=1e-12, atol=1e-12)
    dy = torch.randn_like(hidden)
    want_grads = moe._experts_backward(moe._loop_gemm, dy, *want[1:], weights.double(), gate_up, down)
    got_grads = moe._experts_backward(_emulated_grouped_gemm(config), dy, *got[1:], weights.double(), gate_up, down)
    for mine, theirs in zip(got_grads, want_grads):
        torch.testing.assert_close(mine, theirs, rtol=1e-12, atol=1e-12)


def test_the_config_table_keeps_the_measured_defaults_until_a_gpu_picks_another(monkeypatch):
    # Qwen3-30B-A3B's experts on sm_90: the H100 sweep of 2026-12-05; other shapes: the default timed on the H200
    assert moe.config_for("sm_90") == moe.VARIANTS["m128n256_fullrow"]
    assert moe.config_for("sm_90", 64, 4096, 1408) == moe.GroupedConfig(64, 128, 64, 3, 128)
    assert moe.config_for("sm_86") == moe.GroupedConfig(64, 128, 32, 2, 128)
    assert moe.config_for("gfx942") == moe.GroupedConfig(64, 128, 32, 2, 256)
    monkeypatch.setitem(moe.TUNED, ("sm_90", 128, 2048, 768, "bfloat16"), "m128")
    assert moe.config_for("sm_90", 128, 2048, 768, "bfloat16").block_m == 128
    assert moe.config_for("sm_90", 8, 4096, 14336, "bfloat16") == moe.VARIANTS["m64"]
    assert moe.config_for("sm_90", variant="m128n256") == moe.VARIANTS["m128n256"]
    for family, names in moe.CANDIDATES.items():
        assert moe.DEFAULT_CONFIG[family] in names and set(names) <= set(moe.VARIANTS)
    for config in moe.VARIANTS.values():  # the schedule's bound is sized for BLOCK_M rows
        assert config.block_m >= moe.BLOCK_M and config.block_m % 64 == 0


# every variant on each architecture family that sweeps it (config_for picks among an architecture's own candidates)
LOWERINGS = [(target, variant) for family, target in (("sm_90", "cuda:sm_90"), ("hip", "hip:gfx942"), ("sm_80", "cuda:sm_80"))
             for variant in moe.CANDIDATES[family]]


def test_every_variant_is_some_architectures_candidate():
    assert {variant for _, variant in LOWERINGS} == set(moe.VARIANTS)


@pytest.mark.parametrize("target,variant", LOWERINGS)
def test_every_variant_lowers_onto_the_matrix_units(target, variant):
    """Both grouped GEMMs of every variant lower without a GPU on the architectures that sweep it: on sm_90 with TMA
    loads and wgmma (as linear's GEMMs do), on gfx942 with MFMA, on sm_80 with mma; a persistent variant's grid does
    not grow with the tiles."""
    pytest.importorskip("tilelang", reason="TileLang is not installed or cannot be imported")
    from tiletune.kernels import _tilelang

    config = moe.VARIANTS[variant]
    for kind in ("nt", "nn"):
        source = _tilelang.lower_source(moe.grouped_gemm_kernel(kind, 128, 1536, 2048, "bfloat16", config), target)
        if target == "cuda:sm_90":
            assert "wgmma" in source and "tl::tma_load(" in source
        elif target == "cuda:sm_80":
            assert "mma" in source and "wgmma" not in source
        else:
            assert "mfma" in source.lower()
        assert "tiles[" in source and "int rows" in source
        assert ("blockIdx.y" not in source and "step" in source) if config.persistent else "blockIdx.y" in source


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


def test_without_keep_rows_the_input_waits_for_the_backward_and_the_result_is_the_same():
    """keep_rows off: the op returns no gate_up rows and saves the hidden states instead (fewer bytes: the rows are
    k·2·intermediate wide, the hidden states hidden wide); the backward computes the rows again, so the output and
    every gradient equal the op's that kept them (float64, the expert loop: bit for bit)."""
    index, weights = routes(37, 6, 2)
    hidden = torch.randn(37, 16, dtype=torch.float64)
    gate_up, down = torch.randn(6, 24, 16, dtype=torch.float64) / 4, torch.randn(6, 16, 12, dtype=torch.float64) / 4
    results, saved_bytes = {}, {}
    for keep in (True, False):
        x, w = hidden.clone().requires_grad_(), weights.double().requires_grad_()
        packed = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t.nbytes) or t, lambda t: t):
            y, rows, *_ = torch.ops.tiletune.moe_experts(x, index, w, gate_up, down, keep, True, "reference", False)
        (y * torch.linspace(-1, 1, 16, dtype=torch.float64)).sum().backward()
        results[keep], saved_bytes[keep] = (rows.shape[0], y.detach(), x.grad, w.grad), sum(packed)
    assert results[True][0] == 74 and results[False][0] == 0
    assert saved_bytes[True] - saved_bytes[False] == (74 * 24 - 37 * 16) * 8
    for mine, theirs in zip(results[False][1:], results[True][1:], strict=True):
        assert torch.equal(mine, theirs)


def test_a_kernel_with_the_wrong_activation_fails_the_gate():
    """An implementation computing gelu(gate)·up: the gate must catch it (so the GPU check can fail)."""
    def wrong_forward(hidden, top_k_index, top_k_weights, gate_up, down, keep_rows, output_read):
        gelu_gate = dataclasses.replace(moe.REFERENCE_GLUE,
                                        activation=lambda h: F.gelu(h.chunk(2, dim=-1)[0]) * h.chunk(2, dim=-1)[1])
        return moe._experts_forward(moe._loop_gemm, hidden, top_k_index, top_k_weights, gate_up, down,
                                    glue=gelu_gate, keep_rows=keep_rows, output_read=output_read)

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


def tiny_moe(model_type: str):
    """A 2-layer random-init model of the family (4 experts, top 2), seeded."""
    config_class, model_class, extra = MOE_MODELS[model_type]
    config = getattr(transformers, config_class)(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, **extra)  # fmt: skip
    torch.manual_seed(0)
    return getattr(transformers, model_class)(config)


@pytest.mark.parametrize("model_type", MOE_MODELS)
def test_bound_into_moe_models_with_the_stock_loss_and_gradients(model_type):
    model = tiny_moe(model_type)
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


@pytest.mark.parametrize("use_reentrant", [True, False])
@pytest.mark.parametrize("model_type", MOE_MODELS)
def test_a_checkpointed_layers_recomputation_runs_no_down_gemm_and_the_gradients_stay(monkeypatch, model_type,
                                                                                     use_reentrant):  # fmt: skip
    """Recomputing a checkpointed layer in the backward, nothing reads the experts' output (it only joins the residual
    sum): the op computes the routing and the gate_up rows the backward needs, not the activation, the down GEMM or
    the merge. Loss and gradients equal the run without checkpointing; with the family's output marked kept (a
    post-feedforward norm would read it) the recomputation computes it all."""
    model = tiny_moe(model_type)
    for name, param in model.named_parameters():
        param.requires_grad_("experts" not in name)
    ids = torch.randint(0, 128, (2, 19))
    trainable = [p for p in model.parameters() if p.requires_grad]
    apply_kernels(model, {"moe_experts": "reference"})
    forward_gemms = []  # the "nt" GEMMs: gate_up and down in a forward
    loop_gemm = moe._loop_gemm
    monkeypatch.setattr(moe, "_loop_gemm", lambda kind, *a, **k: forward_gemms.append(kind == "nt") or loop_gemm(kind, *a, **k))
    def step():  # re-entrant checkpointing takes .backward(), not autograd.grad
        for param in trainable:
            param.grad = None
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss.detach(), [param.grad for param in trainable]

    plain, plain_grads = step()
    assert sum(forward_gemms) == 2 * 2  # two layers
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": use_reentrant})
    model.train()
    forward_gemms.clear()
    loss, grads = step()
    assert sum(forward_gemms) == 2 * 3  # the forward's two, the recomputation's gate_up alone
    assert float(loss) == float(plain)
    for mine, theirs in zip(grads, plain_grads, strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-7)
    family = families.family_of(model.config)
    monkeypatch.setattr(families, "_families", {**families._families, model_type: dataclasses.replace(
        family, experts=dataclasses.replace(family.experts, output_kept=True))})
    apply_kernels(model, {"moe_experts": "reference"})  # a later op of the layer would read the output: computed
    forward_gemms.clear()
    step()
    assert sum(forward_gemms) == 2 * 4


def test_where_the_kernels_cannot_run_the_stock_experts_compute_not_the_per_expert_loop(monkeypatch):
    """`kernels: all` on a machine without the TileLang kernels (this one): each experts call runs transformers' own
    experts and counts a fallback naming why; the op's reference loop (as slow as the eager experts) never runs;
    `strict` refuses when patching."""
    model = tiny_moe("qwen3_moe").requires_grad_(False)
    ids = torch.randint(0, 128, (2, 19))
    with torch.no_grad():
        stock = model(input_ids=ids).logits
    monkeypatch.setitem(registry._impls["moe_experts"], "tilelang", registry.Impl(
        "moe_experts", "tilelang", moe.tilelang_forward, moe.tilelang_backward, lambda: "no GPU here"))
    monkeypatch.setattr(moe, "_loop_gemm", None)  # the reference's GEMMs: calling them fails the test
    monkeypatch.setattr(registry, "runtime_fallbacks", {})
    report = apply_kernels(model, {"moe_experts": "tilelang"})
    assert report.to_dict()["ops"]["moe_experts"]["patched"] == 2
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, stock)
    assert registry.runtime_fallbacks == {("moe_experts", "tilelang", "no GPU here: stock experts"): 2}
    report.revert()
    with pytest.raises(UserError, match="no GPU here"):
        apply_kernels(model, {"moe_experts": "tilelang", "strict": True})


def test_kernels_all_picks_torchs_grouped_gemm_and_elsewhere_the_stock_experts(monkeypatch):
    """The op's default is the grouped_mm implementation (the step's fastest on an H100 at both MoE shapes); on a
    machine where torch's grouped GEMM is no single kernel (this CPU), each call runs the stock experts and says why."""
    assert registry.default_impl("moe_experts") == "grouped_mm"
    model = tiny_moe("qwen3_moe").requires_grad_(False)
    ids = torch.randint(0, 128, (2, 19))
    with torch.no_grad():
        stock = model(input_ids=ids).logits
    monkeypatch.setattr(registry, "runtime_fallbacks", {})
    report = apply_kernels(model, {"moe_experts": True})
    assert {e.impl for e in report.entries if e.op == "moe_experts"} == {"grouped_mm"}
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, stock)
    (key, calls), = registry.runtime_fallbacks.items()
    assert calls == 2 and key[1] == "grouped_mm" and key[2] == "no CUDA or ROCm GPU visible to torch: stock experts"


@pytest.mark.parametrize("weighted", [False, True])
def test_routes_merge_chunk_by_chunk_as_whole(monkeypatch, weighted):
    """Each token's k routes merged (summed, or weighted by the routing weights) from rows sorted by expert, in chunks
    of 5 tokens (the last one short), equal the routes put back in token order and reduced at once, in float64."""
    tokens, k, width = 37, 4, 24
    order = torch.randperm(tokens * k)
    rows = torch.randn(tokens * k, width, dtype=torch.float64)
    weights = torch.rand(tokens, k, dtype=torch.float64) if weighted else None
    by_route = torch.empty_like(rows)
    by_route[order] = rows  # row j of the sorted rows is route order[j]
    routes = by_route.view(tokens, k, width)
    expected = (routes * weights[..., None]).sum(1) if weighted else routes.sum(1)
    monkeypatch.setattr(moe, "MERGE_CHUNK_BYTES", 5 * k * width * rows.element_size())
    merged = moe._merge_routes(rows, order, torch.empty(tokens, width, dtype=torch.float64), weights)
    torch.testing.assert_close(merged, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("width", [2048, 4096, 2880, 24, 8])
def test_the_merge_blocks_divide_the_row_with_eight_columns_a_thread(width):
    tokens, columns = moe.merge_block(width)
    assert width % columns == 0 and columns <= 512
    assert tokens * columns == moe.MERGE_THREADS * moe.MERGE_VECTOR


@pytest.mark.parametrize("target", ["cuda:sm_90", "hip:gfx942"])
@pytest.mark.parametrize("weighted", [True, False])
@pytest.mark.parametrize("k,width,dtype", [(8, 2048, "bfloat16"), (2, 24, "float16"), (4, 2880, "bfloat16")])
def test_the_merge_kernel_lowers_reading_each_route_row_in_place(target, weighted, k, width, dtype):
    """The merge kernel lowers without a GPU for CUDA and HIP at awkward widths; it reads the rows through the
    positions (no gathered copy) with 16-byte loads on CUDA, and the weights only when weighted."""
    pytest.importorskip("tilelang", reason="TileLang is not installed or cannot be imported")
    from tiletune.kernels import _tilelang

    source = _tilelang.lower_source(moe.merge_kernel(k, width, dtype, weighted), target)
    assert "POS[" in source and "ROWS" in source and "OUT" in source
    assert ("W[" in source) == weighted
    if target.startswith("cuda"):
        assert "uint4*)(ROWS" in source


def test_the_binding_runs_the_grouped_gemms_only_at_shapes_a_sweep_measured(monkeypatch):
    """An implementation that could run (here: the reference's math under the name tilelang) still leaves experts of a
    shape without a TUNED config to the stock path, naming the sweep that would measure one; once TUNED has the shape
    it runs."""
    model = tiny_moe("mixtral").requires_grad_(False)
    ids = torch.randint(0, 128, (2, 19))
    with torch.no_grad():
        stock = model(input_ids=ids).logits
    ran = []
    monkeypatch.setitem(registry._impls["moe_experts"], "tilelang", registry.Impl(
        "moe_experts", "tilelang", lambda *a: ran.append(1) or moe.reference_forward(*a), moe.reference_backward))
    monkeypatch.setattr(registry, "runtime_fallbacks", {})
    apply_kernels(model, {"moe_experts": "tilelang"})
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, stock)
    (key, calls), = registry.runtime_fallbacks.items()
    assert not ran and calls == 2 and key[2] == (
        "no grouped GEMM config measured for 4 experts of 64 x 128 (float32) on sm_90; benchmarks/kernel_bench.py "
        "--only moe sweeps them, moe_experts.TUNED takes the fastest: stock experts")
    monkeypatch.setitem(moe.TUNED, ("sm_90", 4, 64, 128, "float32"), "m64")
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, stock)
    assert len(ran) == 2


@pytest.mark.parametrize("kind", ["nt", "nn"])
def test_torchs_grouped_gemm_computes_the_expert_loop(kind):
    """The grouped_mm implementation's GEMMs (torch's grouped GEMM over the routing's offsets; on the CPU aten's loop,
    on sm_90 one CUTLASS kernel) against the per-expert loop, float32, an expert with no rows included."""
    index, _ = routes(61, 8, 2)
    routing = route(index, 8)
    weights = torch.randn(8, 48, 32)  # [experts, n, k]
    rows = torch.randn(index.numel(), 32 if kind == "nt" else 48)
    torch.testing.assert_close(moe.vendor_gemm(kind, rows, weights, routing), moe._loop_gemm(kind, rows, weights, routing))
    assert "one kernel only for bf16" in moe.grouped_mm_unsupported(rows, index, None, weights, weights)


# ---- LoRA on the expert weights -------------------------------------------------------------------------


def lora_inputs(tokens=61, experts=8, k=2, hidden=16, inter=12, ranks=(4, 3), dtype=torch.float64, seed=0):
    """Routes (expert 1 empty), hidden states, base weights and LoRA factors A [E, r, in], B [E, out, r]."""
    index, weights = routes(tokens, experts, k, seed)
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(dtype)

    return (rand(tokens, hidden), index, weights.to(dtype), rand(experts, 2 * inter, hidden, scale=0.3),
            rand(experts, hidden, inter, scale=0.3), rand(experts, ranks[0], hidden, scale=0.3),
            rand(experts, 2 * inter, ranks[0], scale=0.3), rand(experts, ranks[1], inter, scale=0.3),
            rand(experts, hidden, ranks[1], scale=0.3), 2.0, 0.5)


def merged_lora(hidden, index, weights, gate_up, down, a1, b1, a2, b2, s1, s2):
    """What peft's ParamWrapper computes: the experts on W + s·B·A, in plain autograd (each route's weights gathered)."""
    gate_up, down = gate_up + s1 * b1 @ a1, down + s2 * b2 @ a2
    y = torch.zeros_like(hidden)
    for j in range(index.shape[1]):
        h = torch.einsum("th,toh->to", hidden, gate_up[index[:, j]])
        y = y + weights[:, j, None] * torch.einsum("ti,toi->to", moe._silu_gate(h), down[index[:, j]])
    return y


@pytest.mark.parametrize("ranks", [(4, 3), (4, 0), (0, 2)])
def test_lora_form_is_the_merged_weights_in_float64(ranks):
    """y and the gradients of the hidden states, the routing weights and all four factors equal autograd through the
    merged weights; a projection of rank 0 (no adapter on it) is the plain weight."""
    inputs = list(lora_inputs(ranks=ranks))
    for i in (0, 2, 5, 6, 7, 8):
        inputs[i].requires_grad_()
    grad_out = torch.randn(inputs[0].shape, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    leaves = [inputs[i] for i in (0, 2, 5, 6, 7, 8)]
    want = merged_lora(*inputs)
    want_grads = torch.autograd.grad(want, leaves, grad_out, allow_unused=True)
    got = moe.moe_experts_lora(*inputs)
    got_grads = torch.autograd.grad(got, leaves, grad_out, allow_unused=True)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    for mine, theirs in zip(got_grads, want_grads):
        theirs = torch.zeros_like(mine) if theirs is None else theirs  # rank 0: an empty factor
        torch.testing.assert_close(mine, theirs, rtol=1e-10, atol=1e-12)


def test_lora_form_passes_opcheck():
    """Its custom op (schema, fakes, autograd, torch.compile's view) as test_customop checks every op's."""
    inputs = [x.float().requires_grad_(i in (0, 2, 5, 6, 7, 8)) if isinstance(x, torch.Tensor) and x.is_floating_point()
              else x for i, x in enumerate(lora_inputs(tokens=7, experts=3, hidden=16, inter=12))]  # fmt: skip
    results = torch.library.opcheck(torch.ops.tiletune.moe_experts_lora.default, (*inputs, "reference", False))
    assert set(results.values()) == {"SUCCESS"}


@pytest.mark.parametrize("variant", sorted(moe.VARIANTS))
def test_every_variants_tile_schedule_computes_the_lora_reference(variant):
    """The LoRA form with each variant's grouped GEMM (emulated tile by tile) for the base weights equals the loop's."""
    config = moe.VARIANTS[variant]
    inputs = lora_inputs(tokens=600)
    want = moe._lora_experts_forward(moe._loop_gemm, *inputs)
    got = moe._lora_experts_forward(_emulated_grouped_gemm(config), *inputs, config.block_m)
    torch.testing.assert_close(got[0], want[0], rtol=1e-12, atol=1e-12)
    dy = torch.randn_like(inputs[0])
    want_grads = moe._lora_experts_backward(moe._loop_gemm, dy, inputs[0], *want[1:], *inputs[2:])
    got_grads = moe._lora_experts_backward(_emulated_grouped_gemm(config), dy, inputs[0], *got[1:], *inputs[2:])
    for mine, theirs in zip(got_grads, want_grads):
        torch.testing.assert_close(mine, theirs, rtol=1e-12, atol=1e-12)


def test_tilelang_lora_path_wires_the_grouped_gemm_for_the_base_weights(monkeypatch):
    """tilelang_lora_forward / _backward with the TileLang grouped GEMM replaced by its emulation (CPU, float64):
    the reference's outputs and gradients, so only the kernel itself is left to the GPU test."""
    monkeypatch.setattr(moe, "grouped_gemm", _emulated_grouped_gemm)
    monkeypatch.setattr(moe, "TILELANG_GLUE", moe.REFERENCE_GLUE)  # its kernels need a GPU
    inputs = lora_inputs(tokens=300)
    want = moe.reference_lora_forward(*inputs)
    got = moe.tilelang_lora_forward(*inputs)
    torch.testing.assert_close(got[0], want[0], rtol=1e-12, atol=1e-12)
    dy = torch.randn_like(inputs[0])
    for mine, theirs in zip(moe.tilelang_lora_backward(dy, inputs[0], *got[1:], *inputs[2:]),
                            moe.reference_lora_backward(dy, inputs[0], *want[1:], *inputs[2:])):
        torch.testing.assert_close(mine, theirs, rtol=1e-12, atol=1e-12)
    assert moe.tilelang_lora_unsupported(*inputs) is not None  # 16 x 12 experts: not multiples of the tiles


def awkward_routes(seed=0):
    """40 tokens, top-2 over 8 experts: experts 1 and 5 get no rows, 2 one, 3 two, the rest 5, 20, 22 and 30."""
    counts = {0: 20, 2: 1, 3: 2, 4: 30, 6: 5, 7: 22}
    flat = torch.tensor([e for e, c in counts.items() for _ in range(c)])
    index = torch.stack([flat[:40], flat[40:]], dim=1)  # no token routed twice to one expert
    gen = torch.Generator().manual_seed(seed)
    return index[torch.randperm(40, generator=gen)], torch.softmax(torch.rand(40, 2, generator=gen), dim=-1)


def awkward_lora_inputs(dtype, hidden, inter, ranks, seed=0):
    index, weights = awkward_routes(seed)
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=0.3):
        return (torch.randn(*shape, generator=gen) * scale).to(dtype)

    return (rand(40, hidden, scale=1.0), index, weights.to(dtype), rand(8, 2 * inter, hidden), rand(8, hidden, inter),
            rand(8, ranks[0], hidden), rand(8, 2 * inter, ranks[0]), rand(8, ranks[1], inter), rand(8, hidden, ranks[1]),
            2.0, 0.5)


def _strides_ok(t):
    """grouped_mm's operand check (16-byte strides, either inner dimension contiguous) and CUTLASS's (aligned start)."""
    align = 16 // t.element_size()
    row = t.stride(-1) == 1 and t.stride(-2) % align == 0 and t.stride(-2) >= max(1, t.shape[-1])
    col = t.stride(-2) == 1 and t.stride(-1) % align == 0 and t.stride(-1) >= max(1, t.shape[-2])
    return (row or col) and t.data_ptr() % 16 == 0 and (t.dim() == 2 or t.stride(0) % align == 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hidden,inter", [(16, 24), (18, 10)])
@pytest.mark.parametrize("ranks", [(1, 16), (16, 1), (3, 0)])
def test_grouped_rank_products_equal_the_expert_loop_on_awkward_groups(monkeypatch, dtype, hidden, inter, ranks):
    """The rank-r parts through torch's grouped GEMM (on the CPU aten runs it per group: float32 and bf16) against the
    per-expert loop, forward and backward, with experts of no rows, one row and uneven counts, ranks 1, 3 and 16 (and
    0: no adapter), sizes off 16 bytes. Each grouped_mm call gets the operands CUDA's kernel needs: int32 offsets
    ending at the rows, 16-byte strides; M-grouped rows row-major; K-grouped xᵀ column-major and y row-major (the one
    pair taking groups without rows); the rank padded to 16 bytes where the other sizes are."""
    calls = []
    original = torch._grouped_mm

    def spy(mat_a, mat_b, offs=None, **kwargs):
        calls.append((mat_a.dim(), mat_b.dim()))
        assert offs.dtype == torch.int32 and offs.shape == (8,)
        assert _strides_ok(mat_a) and _strides_ok(mat_b)
        if mat_b.dim() == 3:
            assert mat_a.stride(-1) == 1 and int(offs[-1]) == mat_a.shape[0]
        else:
            assert mat_a.stride(-2) == 1 and mat_b.stride(-1) == 1 and int(offs[-1]) == mat_b.shape[0]
        align = 16 // mat_a.element_size()
        sizes = (mat_a.shape[1], *mat_b.shape[1:]) if mat_b.dim() == 3 else (mat_a.shape[0], mat_b.shape[1])
        if hidden % align == 0 and inter % align == 0:  # (K, N) of each group's GEMM; M of the K-grouped form
            assert all(size % align == 0 for size in sizes), sizes
        return original(mat_a, mat_b, offs=offs, **kwargs)

    inputs = awkward_lora_inputs(dtype, hidden, inter, ranks)
    want = moe._lora_experts_forward(moe._loop_gemm, *inputs)
    dy = torch.randn(inputs[0].shape, generator=torch.Generator().manual_seed(5)).to(dtype)
    want_grads = moe._lora_experts_backward(moe._loop_gemm, dy, inputs[0], *want[1:], *inputs[2:])
    monkeypatch.setattr(torch, "_grouped_mm", spy)
    monkeypatch.setattr(moe, "_LoopRank", None)  # no per-expert loop (and no host read) for the rank-r parts
    got = moe._lora_experts_forward(moe._loop_gemm, *inputs, grouped=True)
    got_grads = moe._lora_experts_backward(moe._loop_gemm, dy, inputs[0], *got[1:], *inputs[2:], grouped=True)
    active = sum(r > 0 for r in ranks)
    assert sorted(calls).count((2, 3)) == 4 * active and sorted(calls).count((2, 2)) == 2 * active
    for name, mine, theirs in zip(["y", "xa", "aa", "dhidden", "dweights", "dA_gu", "dB_gu", "dA_down", "dB_down"],
                                  [got[0], got[3], got[4], *got_grads], [want[0], want[3], want[4], *want_grads]):
        assert mine.shape == theirs.shape and mine.dtype == theirs.dtype and mine.is_contiguous(), name
        # float32: the GEMMs' summation order differs (BLAS blocking), up to a few ulps of the largest entry
        scale = float(theirs.abs().max()) if theirs.numel() else 0.0
        tolerance = {"rtol": 1e-5, "atol": 1e-6 * (1 + scale)} if dtype == torch.float32 else {}
        torch.testing.assert_close(mine, theirs, **tolerance, msg=lambda m, name=name: f"{name}: {m}")


def test_grouped_rank_products_run_where_torch_has_one_kernel_for_them(monkeypatch):
    """bf16 on CUDA sm_90 / sm_100 (no host sync); the loop for other dtypes, GPUs, ROCm, the CPU and 1024+ experts."""
    from types import SimpleNamespace

    def rows(dtype, device="cuda"):
        return SimpleNamespace(dtype=dtype, device=torch.device(device, 0) if device == "cuda" else torch.device(device))

    monkeypatch.setattr(torch.version, "hip", None)
    for capability, runs in (((9, 0), True), ((10, 0), True), ((8, 0), False), ((12, 0), False)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, c=capability: c)
        assert moe.grouped_mm_runs(rows(torch.bfloat16), 128) is runs
    for dtype in (torch.float16, torch.float32, torch.float64):
        assert not moe.grouped_mm_runs(rows(dtype), 128)
    assert not moe.grouped_mm_runs(rows(torch.bfloat16), 1024)
    assert not moe.grouped_mm_runs(torch.zeros(2, 2, dtype=torch.bfloat16), 8)  # the CPU
    monkeypatch.setattr(torch.version, "hip", "6.4")
    assert not moe.grouped_mm_runs(rows(torch.bfloat16), 128)


def test_tilelang_lora_path_takes_the_grouped_rank_products_where_they_run(monkeypatch):
    """With grouped_mm_runs true (as on an H200 in bf16), the TileLang path's forward and backward run the rank-r parts
    grouped (the base GEMMs emulated, float32 on the CPU) and equal the reference."""
    monkeypatch.setattr(moe, "grouped_gemm", _emulated_grouped_gemm)
    monkeypatch.setattr(moe, "TILELANG_GLUE", moe.REFERENCE_GLUE)  # its kernels need a GPU
    monkeypatch.setattr(moe, "grouped_mm_runs", lambda rows, experts: True)
    inputs = [x.float() if isinstance(x, torch.Tensor) and x.is_floating_point() else x for x in lora_inputs(tokens=300)]
    want = moe.reference_lora_forward(*inputs)
    dy = torch.randn_like(inputs[0])
    want_grads = moe.reference_lora_backward(dy, inputs[0], *want[1:], *inputs[2:])
    monkeypatch.setattr(moe, "_LoopRank", None)
    got = moe.tilelang_lora_forward(*inputs)
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
    for mine, theirs in zip(moe.tilelang_lora_backward(dy, inputs[0], *got[1:], *inputs[2:]), want_grads):
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-5)


def lora_model(model_type, adapters=("default",)):
    """A tiny float64 MoE model (transformers' eager experts) with LoRA on q_proj and both expert weights, B non-zero."""
    from peft import LoraConfig, get_peft_model

    config_class, model_class, extra = MOE_MODELS[model_type]
    config = getattr(transformers, config_class)(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, **extra)  # fmt: skip
    config._experts_implementation = "eager"  # float64: torch's grouped_mm takes none
    torch.manual_seed(0)
    model = getattr(transformers, model_class)(config).double()
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"], task_type="CAUSAL_LM",
                      target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    model = get_peft_model(model, lora, adapter_name=adapters[0])
    for name in adapters[1:]:
        model.add_adapter(name, lora)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=gen, dtype=param.dtype) * 0.1)
    return model


@pytest.mark.parametrize("model_type", MOE_MODELS)
def test_lora_on_the_experts_binds_with_peft_loss_and_adapter_gradients(model_type):
    """peft folds W + s·B·A into a merged expert stack per forward; the op's LoRA form computes x·Wᵀ + s·(x·Aᵀ)·Bᵀ per
    expert group: the same loss and gradients (float64), the report saying the experts took the op."""
    model = lora_model(model_type)
    ids = torch.randint(0, 128, (2, 19), generator=torch.Generator().manual_seed(2))
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert sum(1 for n, p in model.named_parameters() if p.requires_grad and ".experts." in n) == 8  # A, B x 2 x 2 layers
    stock = model(input_ids=ids, labels=ids).loss
    stock_grads = torch.autograd.grad(stock, trainable)
    with model.disable_adapter():
        base = model(input_ids=ids, labels=ids).loss
    report = apply_kernels(model, {"moe_experts": "reference"})
    assert [(e.module, e.installed, e.fallback) for e in report.entries] == [("mlp.experts", True, None)] * 2
    loss = model(input_ids=ids, labels=ids).loss
    torch.testing.assert_close(loss, stock, rtol=1e-12, atol=0)
    for mine, theirs in zip(torch.autograd.grad(loss, trainable), stock_grads):
        torch.testing.assert_close(mine, theirs, rtol=1e-9, atol=1e-12)
    with model.disable_adapter():  # adapters off (a preference stage's reference): the plain op on the base weights
        torch.testing.assert_close(model(input_ids=ids, labels=ids).loss, base, rtol=1e-12, atol=0)
    assert report.runtime_fallbacks() == []
    report.revert()


def test_adapter_states_the_lora_form_does_not_compute_run_peft_and_say_so_per_call():
    """Two active adapters on the experts, or an adapter merged into them: peft's own path (right), each call counted
    with the reason; never the op on the un-adapted weights."""
    model = lora_model("qwen3_moe", adapters=("default", "second"))
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(2))
    model.base_model.set_adapter(["default", "second"])
    stock = model(input_ids=ids, labels=ids).loss
    report = apply_kernels(model, {"moe_experts": "reference"})
    entry = report.entries[0]
    assert entry.installed and entry.fallback == "LoRA on expert weights: 2 active adapters on down_proj: stock peft experts"
    torch.testing.assert_close(model(input_ids=ids, labels=ids).loss, stock, rtol=1e-12, atol=0)
    assert report.runtime_fallbacks() == [{"op": "moe_experts", "impl": "reference", "calls": 2,
                                           "reason": "LoRA on expert weights: 2 active adapters on down_proj: stock peft experts"}]
    report.revert()
    model.base_model.set_adapter("default")
    merged = model.get_base_model().model.layers[0].mlp.experts
    merged.merge()
    report = apply_kernels(model, {"moe_experts": "reference"})
    assert report.entries[0].fallback == "LoRA on expert weights: adapter merged into down_proj: stock peft experts"
    assert report.entries[1].fallback is None
    model(input_ids=ids, labels=ids)
    assert [f["calls"] for f in report.runtime_fallbacks()] == [1]
    report.revert()


def _lora_case(tokens, dtype=torch.bfloat16, experts=128, k=8, hidden=2048, inter=768, rank=8):
    """Routed bf16 inputs of the LoRA form on the GPU (Qwen3-30B-A3B's shape by default): the hidden states, the
    routing weights, both expert weights and the four factors of rank `rank`."""
    index, weights = routes(tokens, experts, k, device="cuda")
    x = torch.randn(tokens, hidden, device="cuda", dtype=dtype, requires_grad=True)
    w = weights.to(dtype).requires_grad_()
    gate_up = (torch.randn(experts, 2 * inter, hidden, device="cuda") / hidden**0.5).to(dtype)
    down = (torch.randn(experts, hidden, inter, device="cuda") / inter**0.5).to(dtype)
    factors = [(torch.randn(*shape, device="cuda") / shape[-1] ** 0.5).to(dtype).requires_grad_()
               for shape in ((experts, rank, hidden), (experts, 2 * inter, rank), (experts, rank, inter), (experts, hidden, rank))]
    return index, [x, w, gate_up, down, *factors]


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["tilelang", "grouped_mm"])
@pytest.mark.parametrize("name,tokens,experts,k,hidden,inter", [
    ("qwen3-30b-a3b", 1024, 128, 8, 2048, 768), ("mixtral-8x7b", 77, 8, 2, 4096, 14336)])
def test_lora_form_matches_float64(impl, name, tokens, experts, k, hidden, inter):
    """The LoRA form on implementation `impl` (TileLang's or torch's grouped GEMMs; rank 8 on both weights) against
    float64, bf16: y and the gradients of the hidden states, the routing weights and the four factors."""
    from _gpu_check import check

    if impl == "grouped_mm":
        _skip_unless_grouped_mm_runs()
    index, inputs = _lora_case(tokens, experts=experts, k=k, hidden=hidden, inter=inter)
    check("moe_lora", f"{name} {impl}", torch.bfloat16, inputs,
          lambda x, w, gu, d, a1, b1, a2, b2: moe.moe_experts_lora(x, index, w, gu, d, a1, b1, a2, b2, 2.0, 2.0),
          lambda x, w, gu, d, a1, b1, a2, b2: moe.moe_experts_lora(x, index, w, gu, d, a1, b1, a2, b2, 2.0, 2.0,
                                                                   impl, True),
          ["y", "dhidden", "dweights", "dA_gu", "dB_gu", "dA_down", "dB_down"])


class _LoraRankParts(torch.autograd.Function):
    """The LoRA form's forward and backward with the base GEMMs by the expert loop and the rank-r parts grouped or not
    (its scalings 2.0), for the GPU check of the grouped rank-r parts alone."""

    @staticmethod
    def forward(ctx, grouped, index, x, w, gate_up, down, a1, b1, a2, b2):
        out = moe._lora_experts_forward(moe._loop_gemm, x, index, w, gate_up, down, a1, b1, a2, b2, 2.0, 2.0,
                                        grouped=grouped)
        ctx.grouped = grouped
        ctx.save_for_backward(x, *out[1:], w, gate_up, down, a1, b1, a2, b2)
        return out[0]

    @staticmethod
    def backward(ctx, dy):
        x, *kept, w, gate_up, down, a1, b1, a2, b2 = ctx.saved_tensors
        dx, dw, da1, db1, da2, db2 = moe._lora_experts_backward(moe._loop_gemm, dy.contiguous(), x, *kept, w, gate_up,
                                                                down, a1, b1, a2, b2, 2.0, 2.0, grouped=ctx.grouped)
        return None, None, dx, dw, None, None, da1, db1, da2, db2




def _skip_unless_grouped_mm_runs():
    probe = torch.zeros(1, device="cuda", dtype=torch.bfloat16)
    if not moe.grouped_mm_runs(probe, 128):
        pytest.skip(f"torch's grouped_mm has one kernel for bf16 on CUDA sm_90/sm_100 only, not on "
                    f"{torch.cuda.get_device_name()} (torch {torch.__version__}): the per-expert loop runs here")


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["tilelang", "grouped_mm"])
def test_a_recomputation_without_the_output_keeps_the_gradients_at_qwen3_30b_a3b_shape(monkeypatch, impl):
    """Qwen3-30B-A3B's experts (2 layers, bf16, 2 x 512 tokens) on the GPU implementations: under re-entrant
    checkpointing the recomputation skips the output (`output_read` False) and the loss and every trainable gradient
    match the run without checkpointing (bf16 attention's backward is not bitwise deterministic: 2% of each
    gradient's largest magnitude)."""
    _skip_unless_grouped_mm_runs()
    config = transformers.Qwen3MoeConfig(vocab_size=1024, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                                         num_experts=128, num_experts_per_tok=8, num_hidden_layers=2, num_attention_heads=32,
                                         num_key_value_heads=4, head_dim=128)  # fmt: skip
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.Qwen3MoeForCausalLM(config).to(torch.bfloat16)
    for name, param in model.named_parameters():
        param.requires_grad_("experts" not in name)
    apply_kernels(model, {"moe_experts": impl, "strict": True})
    reads, forward = [], moe._experts_forward
    monkeypatch.setattr(moe, "_experts_forward", lambda *a, **k: reads.append(a[9] if len(a) > 9 else k.get("output_read", True))
                        or forward(*a, **k))
    ids = torch.randint(0, 1024, (2, 512), device="cuda")
    trainable = [p for p in model.parameters() if p.requires_grad]

    def step():
        for param in trainable:
            param.grad = None
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss.detach(), [param.grad.clone() for param in trainable]

    model.train()
    plain, plain_grads = step()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    reads.clear()
    loss, grads = step()
    assert reads == [True, True, False, False]  # the two forwards, then the two recomputations
    assert torch.isfinite(loss) and float(loss) == pytest.approx(float(plain), rel=1e-3)
    for mine, theirs in zip(grads, plain_grads, strict=True):
        assert torch.isfinite(mine).all()
        torch.testing.assert_close(mine, theirs, rtol=0, atol=0.02 * float(theirs.abs().max()) + 1e-6)


@pytest.mark.gpu
def test_grouped_rank_products_match_float64_at_qwen3_30b_a3b_shapes():
    """The rank-r parts through torch's grouped GEMM (bf16, one kernel per product) against float64, the per-expert
    loop in bf16 the bar: Qwen3-30B-A3B's experts (128, top-8, hidden 2048, intermediate 768), rank 8 on both
    weights, 4,096 tokens (an expert with no rows included); y and the gradients of the hidden states, the routing
    weights and the four factors. The base GEMMs are the loop's in all three runs."""
    from _gpu_check import check

    _skip_unless_grouped_mm_runs()
    index, inputs = _lora_case(4096)
    check("moe_lora", "qwen3-30b-a3b grouped rank-r", torch.bfloat16, inputs,
          lambda x, w, gu, d, a1, b1, a2, b2: _LoraRankParts.apply(False, index, x, w, gu, d, a1, b1, a2, b2),
          lambda x, w, gu, d, a1, b1, a2, b2: _LoraRankParts.apply(True, index, x, w, gu, d, a1, b1, a2, b2),
          ["y", "dhidden", "dweights", "dA_gu", "dB_gu", "dA_down", "dB_down"])


@pytest.mark.gpu
def test_grouped_rank_products_read_nothing_on_the_host():
    """The grouped rank-r parts, forward and backward of both projections, under CUDA's sync debug mode "error": no
    host sync (the loop's one read of the offsets per forward and per backward is gone)."""
    _skip_unless_grouped_mm_runs()
    index, (x, _, _, _, a1, b1, a2, b2) = _lora_case(512)
    routing = route(index, 128)
    rows = x.detach()[routing.token]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        rank = moe._GroupedRank(routing.offsets)
        xa, up = rank.forward(rows, a1.detach(), b1.detach())
        aa, _ = rank.forward(up[:, :768].contiguous(), a2.detach(), b2.detach())
        rank.backward(torch.randn_like(rows), up[:, :768].contiguous(), aa, a2.detach(), b2.detach(), 2.0)
        rank.backward(torch.randn_like(up), rows, xa, a1.detach(), b1.detach(), 2.0)
        torch.cuda.synchronize()
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name,tokens,experts,k,hidden,inter", [
    ("qwen3-30b-a3b", 8192, 128, 8, 2048, 768), ("qwen3-30b-a3b", 77, 128, 8, 2048, 768),
    ("mixtral-8x7b", 1024, 8, 2, 4096, 14336), ("mixtral-8x7b", 3, 8, 2, 4096, 14336),
])
def test_tilelang_matches_float64(dtype, name, tokens, experts, k, hidden, inter):
    check_against_float64(f"{name} tokens={tokens}", dtype, tokens, experts, k, hidden, inter)


@pytest.mark.gpu
@pytest.mark.parametrize("name,tokens,experts,k,hidden,inter", [
    ("qwen3-30b-a3b", 8192, 128, 8, 2048, 768), ("qwen3-30b-a3b", 77, 128, 8, 2048, 768),
    ("mixtral-8x7b", 1024, 8, 2, 4096, 14336), ("mixtral-8x7b", 3, 8, 2, 4096, 14336),
])
@pytest.mark.parametrize("impl", ["grouped_mm", "gather_fused"])
def test_grouped_mm_implementations_match_float64(impl, name, tokens, experts, k, hidden, inter):
    """The grouped_mm implementation (torch's grouped GEMM, the packed activation kernels) and gather_fused (TileLang's
    gathering grouped GEMM for two of the four) against float64, bf16."""
    _skip_unless_grouped_mm_runs()
    check_against_float64(f"{name} tokens={tokens} {impl}", torch.bfloat16, tokens, experts, k, hidden, inter, impl)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["nt", "nn"])
@pytest.mark.parametrize("tokens", [8192, 77, 1])
def test_the_gathered_grouped_gemm_reads_each_rows_token(kind, tokens):
    """The gathered grouped GEMM on Qwen3-30B-A3B's shapes (the gate_up forward, the down input gradient) against
    float64 of the gathered rows times their experts' weights, torch's grouped GEMM over the gathered copy as the
    bar; the kernel fed each row's neighbour's token (a wrong gather) fails the gate."""
    experts, k, hidden, inter = 128, 8, 2048, 768
    index, _ = routes(tokens, experts, k, device="cuda")
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    shape = (experts, 2 * inter, hidden) if kind == "nt" else (experts, hidden, inter)
    weights = (torch.randn(shape, device="cuda") / hidden**0.5).to(torch.bfloat16)
    config = moe.op_config(x, torch.empty(experts, 2 * inter, hidden, device="meta"))
    routing = moe.route(index, experts, config.block_m)
    exact = moe._loop_gemm(kind, x.double(), weights.double(), routing, gathered=True)
    bar = moe._loop_gemm(kind, x, weights, routing, gathered=True)
    gemm = moe.grouped_gemm(config, fuse_gather=True)
    assert gate(gemm(kind, x, weights, routing, gathered=True), bar, exact).passed
    if tokens > 1:
        shifted = dataclasses.replace(routing, token=routing.token.roll(1))
        assert not gate(gemm(kind, x, weights, shifted, gathered=True), bar, exact).passed


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["tilelang", "grouped_mm", "gather_fused"])
def test_the_rows_computed_again_in_the_backward_match_float64(impl):
    """Without keep_rows (a selective layer's), Qwen3-30B-A3B's shape at 8,192 tokens: the backward's second gate_up
    GEMM feeds the same gradients, against float64, bf16."""
    if impl != "tilelang":
        _skip_unless_grouped_mm_runs()
    check_against_float64("qwen3-30b-a3b rows computed again", torch.bfloat16, 8192, 128, 8, 2048, 768, impl, False)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("weighted", [True, False])
@pytest.mark.parametrize("tokens,k,width", [(8192, 8, 2048), (77, 8, 2048), (3, 2, 4096), (37, 4, 24), (1, 1, 2880)])
def test_the_merge_kernel_matches_float64(dtype, weighted, tokens, k, width):
    """The TileLang merge of each token's k expert rows (the forward's weighted output, the backward's summed input
    gradient) against float64 on fresh random rows, routes and weights, the PyTorch merge in `dtype` as the bar; the
    kernel fed positions off by one (a wrong gather) fails the gate."""
    from tiletune.kernels import _tilelang

    order = torch.randperm(tokens * k, device="cuda")
    rows = torch.randn(tokens * k, width, device="cuda", dtype=dtype)
    weights = torch.rand(tokens, k, device="cuda").softmax(-1) if weighted else None
    like = torch.empty(tokens, width, device="cuda", dtype=dtype)
    exact = moe._merge_routes(rows.double(), order, like.double(), None if weights is None else weights.double())
    bar = moe._merge_routes(rows, order, like, weights)
    merged = moe.tilelang_merge(rows, order, like, weights)
    assert merged.dtype == dtype and gate(merged, bar, exact).passed
    kernel = _tilelang.compiled(("moe_experts", "merge", k, width, _tilelang.DTYPES[dtype], weighted),
                                lambda: moe.merge_kernel(k, width, _tilelang.DTYPES[dtype], weighted))
    wrong = torch.empty_like(bar)
    off_by_one = ((moe._positions(order) + 1) % order.numel()).view(tokens, k)
    kernel(rows, off_by_one, *([weights.contiguous()] if weighted else []), wrong)
    if tokens * k > 1:
        assert not gate(wrong, bar, exact).passed


def check_against_float64(label: str, dtype, tokens: int, experts: int, k: int, hidden: int, inter: int,
                          impl: str = "tilelang", keep_rows: bool = True) -> None:  # fmt: skip
    """The whole op on implementation `impl` (both forward GEMMs, both input-gradient GEMMs) against float64 on
    fresh random routes, inputs and expert weights."""
    from _gpu_check import check

    index, weights = routes(tokens, experts, k, device="cuda")
    x = torch.randn(tokens, hidden, device="cuda", dtype=dtype, requires_grad=True)
    w = weights.to(dtype).requires_grad_()
    gate_up = (torch.randn(experts, 2 * inter, hidden, device="cuda") / hidden**0.5).to(dtype)
    down = (torch.randn(experts, hidden, inter, device="cuda") / inter**0.5).to(dtype)
    check("moe", label, dtype, [x, w, gate_up, down],
          lambda x, w, gu, d: moe_experts(x, index, w, gu, d),
          lambda x, w, gu, d: moe_experts(x, index, w, gu, d, impl=impl, strict=True, keep_rows=keep_rows),
          ["y", "dhidden", "dweights"])


def _this_gpus_candidates():
    """The sweep's candidates of every architecture (the test skips those not of this GPU's)."""
    return sorted({name for names in moe.CANDIDATES.values() for name in names})


@pytest.fixture(scope="module")
def candidates_compiled():
    """Every candidate of this GPU compiled at once for both test shapes (one by one they take minutes)."""
    from tiletune.kernels import _tilelang

    names = moe.CANDIDATES[moe.arch_family(_tilelang.device_arch())]
    for experts, hidden, inter in ((128, 2048, 768), (8, 4096, 14336)):
        moe.compile_all([moe.VARIANTS[n] for n in names], experts, hidden, inter, "bfloat16", torch.device("cuda", 0))


@pytest.mark.gpu
@pytest.mark.usefixtures("candidates_compiled")
@pytest.mark.parametrize("variant", _this_gpus_candidates())
@pytest.mark.parametrize("name,tokens,experts,k,hidden,inter", [
    ("qwen3-30b-a3b", 8192, 128, 8, 2048, 768), ("qwen3-30b-a3b", 77, 128, 8, 2048, 768),
    ("mixtral-8x7b", 3, 8, 2, 4096, 14336),
])
def test_every_candidate_config_matches_float64(monkeypatch, variant, name, tokens, experts, k, hidden, inter):
    """Each grouped GEMM config the sweep may pick (benchmarks/kernel_bench.py --only moe), through the whole op
    (both forward GEMMs, both input-gradient GEMMs) against float64, bf16; an expert with no rows included."""
    from tiletune.kernels import _tilelang

    arch = _tilelang.device_arch()
    if variant not in moe.CANDIDATES[moe.arch_family(arch)]:
        pytest.skip(f"{variant} is not a candidate on {arch}")
    monkeypatch.setitem(moe.TUNED, (arch, experts, hidden, inter, "bfloat16"), variant)
    assert moe.config_for(arch, experts, hidden, inter, "bfloat16") == moe.VARIANTS[variant]
    check_against_float64(f"{name} {variant} t={tokens}", torch.bfloat16, tokens, experts, k, hidden, inter)
