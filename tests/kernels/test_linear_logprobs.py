"""linear_logprobs: exact against PyTorch's log-softmax in float64, chunked at awkward sizes; float32 and bf16
log-probabilities and gradients within the precision gate of PyTorch's own; an off-by-one gather fails that gate.
The TileLang kernels: their tile walk emulated in float64 on the CPU (online log-sum-exp, statistics, argmax ties),
their lowering for sm_90 and gfx942, and (GPU) the kernels against float64 with a wrong variant that must fail."""

import pytest
import torch

import tiletune.kernels.linear_cross_entropy as lce
import tiletune.kernels.linear_logprobs as llp
from tiletune.kernels import registry
from tiletune.kernels.linear_logprobs import linear_logprobs
from tiletune.numerics import gate

SHAPES = [(77, 500), (5, 37), (130, 1001)]  # tokens not a multiple of the chunk, vocabularies not a power of 2


def problem(tokens, vocab, hidden=32, seed=0, device="cpu"):
    """Fresh float64 inputs: hidden states, weight, labels with every fifth ignored, an upstream gradient."""
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(tokens, hidden, generator=gen, dtype=torch.float64)
    w = torch.randn(vocab, hidden, generator=gen, dtype=torch.float64) / hidden**0.5
    y = torch.randint(0, vocab, (tokens,), generator=gen)
    y[::5] = -100
    return tuple(t.to(device) for t in (h, w, y, torch.randn(tokens, generator=gen, dtype=torch.float64)))


def tied(tokens, vocab, hidden=72, seed=0):
    """Inputs whose logits are integers (exact in any summation order) and whose weight repeats 16 rows across the
    vocabulary, so every row's maximum is held by many columns in several tiles; labels: the first of them, the
    last, or any column."""
    gen = torch.Generator().manual_seed(seed)
    h = torch.randint(-1, 2, (tokens, hidden), generator=gen).double()
    w = torch.randint(-1, 2, (16, hidden), generator=gen).double()[torch.randint(0, 16, (vocab,), generator=gen)]
    logits = h @ w.t()
    maxima = logits == logits.max(-1, keepdim=True).values
    columns = torch.arange(vocab)
    first, last = torch.where(maxima, -columns, -vocab).max(-1).indices, torch.where(maxima, columns, -1).max(-1).indices
    choices = torch.stack((first, last, torch.randint(0, vocab, (tokens,), generator=gen)), -1)
    y = choices[torch.arange(tokens), torch.arange(tokens) % 3]
    y[::7] = -100
    return h, w, y


def stock(h, w, y, softcap=0.0):
    """PyTorch's own: the full logits, log-softmax in float32 (float64 for float64 inputs), gather."""
    logits = (h @ w.t()).to(torch.promote_types(h.dtype, torch.float32))
    if softcap:
        logits = softcap * torch.tanh(logits / softcap)
    return logits.log_softmax(-1).gather(1, y.clamp(min=0)[:, None])[:, 0] * (y != -100)


def outputs_and_grads(fn, h, w, y, up, dtype, weight_grad=True):
    """(log-probs, d hidden, d weight) of `fn` on the inputs cast to `dtype`, upstream gradient `up` (no d weight
    for a frozen weight)."""
    h, w = h.to(dtype).requires_grad_(), w.to(dtype).requires_grad_(weight_grad)
    logp = fn(h, w, y)
    return (logp, *torch.autograd.grad((logp * up.to(logp.dtype)).sum(), (h, w) if weight_grad else (h,)))


def verdicts(impl, dtype, tokens, vocab, softcap=0.0, hidden=32, weight_grad=True, device="cpu"):
    """The precision gate's verdict on each of (log-probs, d hidden[, d weight]) of `impl` in `dtype` (strict: no
    fallback), on fresh inputs on `device`; on a GPU the kernel's outputs come from memory poisoned with NaN."""
    h, w, y, up = problem(tokens, vocab, hidden, device=device)
    exact = outputs_and_grads(lambda *a: stock(*a, softcap), h, w, y, up, torch.float64, weight_grad)
    torch_own = outputs_and_grads(lambda *a: stock(*a, softcap), h, w, y, up, dtype, weight_grad)
    if device == "cuda":
        from _gpu_check import poison_allocator

        poison_allocator()
    mine = outputs_and_grads(lambda *a: linear_logprobs(*a, impl, True, softcap)[0], h, w, y, up, dtype, weight_grad)
    return [gate(m, t, e) for m, t, e in zip(mine, torch_own, exact)]


@pytest.fixture(autouse=True)
def ten_token_chunks(monkeypatch):
    monkeypatch.setattr(lce, "CHUNK_BYTES", 4 * 1001 * 10)  # 10 tokens of the largest vocabulary, more of smaller ones


@pytest.mark.parametrize("impl", ["reference", "chunked"])
@pytest.mark.parametrize("softcap", [0.0, 2.0])
def test_matches_log_softmax_in_float64(impl, softcap):
    h, w, y, up = problem(77, 500)
    h *= 3  # with a cap of 2 the cap bends most logits
    want = outputs_and_grads(lambda *a: stock(*a, softcap), h, w, y, up, torch.float64)
    got = outputs_and_grads(lambda *a: linear_logprobs(*a, impl, softcap=softcap)[0], h, w, y, up, torch.float64)
    for mine, theirs in zip(got, want):
        assert torch.allclose(mine, theirs, rtol=1e-10, atol=1e-12)
    assert (got[0][y == -100] == 0).all()


def test_statistics_match_the_full_distribution():
    h, w, y, _ = problem(77, 500)
    _, stats = linear_logprobs(h, w, y, "chunked")
    logits = h @ w.t()
    probs = logits.softmax(-1)
    valid = y != -100
    want = torch.stack((-(probs * probs.log()).sum(-1), logits.mean(-1), (logits.argmax(-1) == y).double()), -1)
    assert not stats.requires_grad and torch.allclose(stats, want * valid[:, None], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("impl", ["reference", "chunked"])
@pytest.mark.parametrize("tokens, vocab", SHAPES)
def test_within_the_precision_gate(impl, dtype, tokens, vocab):
    for name, verdict in zip(("logp", "dhidden", "dweight"), verdicts(impl, dtype, tokens, vocab)):
        assert verdict.passed, (name, verdict)


def test_soft_capped_bf16_within_the_precision_gate():
    assert all(v.passed for v in verdicts("chunked", torch.bfloat16, 77, 500, softcap=2.0))


@pytest.fixture
def off_by_one():
    """The reference gathering the logit after the label's: the mistake the gate must catch."""

    def shifted(y, vocab):
        return torch.where(y == -100, y, (y + 1) % vocab)

    registry.add(registry.Impl(
        "linear_logprobs", "off_by_one",
        lambda h, w, y, softcap: llp.reference_forward(h, w, shifted(y, w.shape[0]), softcap),
        lambda dlogp, h, w, y, log_norm, softcap, wg: llp.reference_backward(dlogp, h, w, shifted(y, w.shape[0]),
                                                                             log_norm, softcap, wg)))  # fmt: skip
    yield "off_by_one"
    registry._impls["linear_logprobs"].pop("off_by_one")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_off_by_one_gather_fails_the_gate(off_by_one, dtype):
    assert not any(v.passed for v in verdicts(off_by_one, dtype, 77, 500))


def test_frozen_weight_gets_no_gradient():
    h, w, y, up = problem(77, 500)
    h.requires_grad_()
    (linear_logprobs(h, w, y, "chunked")[0] * up).sum().backward()
    assert h.grad is not None and w.grad is None


def test_no_binding_and_in_kernels_all():
    from tiletune.patch import parse_kernel_spec

    assert registry.ops()["linear_logprobs"].bindings == ()
    assert {s.op: s.impl for s in parse_kernel_spec("all").ops}["linear_logprobs"] == "chunked"  # until the H200 checks it


def test_tilelang_falls_back_to_the_reference_on_the_cpu():
    h, w, y, _ = problem(37, 633, 72)
    for got, want in zip(torch.ops.tiletune.linear_logprobs(h, w, y, 0.0, "tilelang", False), llp.reference_forward(h, w, y)):
        assert torch.equal(got, want)


# ---- the TileLang kernels' tile walk, emulated in float64 ----------------------------------------------------

AWKWARD = [(37, 633, 72), (5, 37, 8), (64, 256, 64), (130, 1001, 136)]  # vocab and hidden off the tiles; 256: whole tiles
BLOCKS_N = sorted({config[1] for config in llp.CONFIGS.values()})


def emulated_forward(h, w, y, softcap, block_n):
    """The forward kernel's arithmetic in float64 PyTorch, tile by tile as it walks the vocabulary."""
    vocab = w.shape[0]
    logits = h @ w.t()
    if softcap:
        logits = softcap * torch.tanh(logits / softcap)
    row_max = torch.full((h.shape[0],), llp.MASKED, dtype=h.dtype)
    first, sum_exp, sum_exp_z, sum_z, target = (torch.zeros_like(row_max) for _ in range(5))
    for v0 in range(0, vocab, block_n):
        cols = torch.arange(v0, v0 + block_n)
        z = torch.full((h.shape[0], block_n), llp.MASKED, dtype=h.dtype)
        z[:, : min(block_n, vocab - v0)] = logits[:, v0 : v0 + block_n]
        tile_max = z.max(-1).values
        tile_first = torch.where(z == tile_max[:, None], cols.to(z.dtype), vocab).min(-1).values
        first = torch.where(tile_max > row_max, tile_first, first)
        rescale = torch.exp(row_max - torch.maximum(row_max, tile_max))
        row_max = torch.maximum(row_max, tile_max)
        e = torch.exp(z - row_max[:, None])
        sum_exp = sum_exp * rescale + e.sum(-1)
        sum_exp_z = sum_exp_z * rescale + (e * z).sum(-1)
        sum_z += torch.where(cols < vocab, z, 0).sum(-1)
        target += torch.where(cols == y[:, None], z, 0).sum(-1)
    valid = y != -100
    log_norm = row_max + torch.log(sum_exp)
    stats = torch.stack((log_norm - sum_exp_z / sum_exp, sum_z / vocab, (first == y).to(h.dtype)), -1)
    return (target - log_norm) * valid, log_norm, stats * valid[:, None]


def emulated_logit_grad(h, w, y, log_norm, dlogp, softcap, block_n):
    """The backward kernel's output G (tokens, padded vocab) in float64 PyTorch, one tile per program."""
    vocab = w.shape[0]
    g = torch.full((h.shape[0], llp.padded_vocab(vocab)), float("nan"), dtype=h.dtype)
    wide = torch.cat([w, w.new_zeros(block_n, w.shape[1])])  # rows past the vocabulary load as zeros
    for v0 in range(0, vocab, block_n):
        cols = torch.arange(v0, v0 + block_n)
        z = h @ wide[v0 : v0 + block_n].t()
        if softcap:
            z = softcap * torch.tanh(z / softcap)
        grad = dlogp[:, None] * ((cols == y[:, None]).to(z.dtype) - torch.exp(z - log_norm[:, None]))
        if softcap:
            grad *= 1 - (z / softcap).square()
        tile = torch.where((cols < vocab) & (y[:, None] != -100), grad, 0)
        g[:, v0 : v0 + block_n] = tile[:, : g.shape[1] - v0]  # the store stops at the padded width
    return g


@pytest.mark.parametrize("block_n", BLOCKS_N)
@pytest.mark.parametrize("softcap", [0.0, 2.0])
@pytest.mark.parametrize("tokens, vocab, hidden", AWKWARD)
def test_the_kernels_tile_walk_computes_the_reference(tokens, vocab, hidden, softcap, block_n):
    h, w, y, up = problem(tokens, vocab, hidden)
    h *= 3  # with a cap of 2 the cap bends most logits
    want = llp.reference_forward(h, w, y, softcap)
    got = emulated_forward(h, w, y, softcap, block_n)
    for mine, theirs in zip(got, want):
        assert torch.allclose(mine, theirs, rtol=1e-10, atol=1e-12)
    logits, slope = lce.capped_logits(h, w, softcap)
    scale = up * (y != -100)
    g = emulated_logit_grad(h, w, y, want[1], up, softcap, block_n)
    assert torch.allclose(g[:, :vocab], lce.logit_gradient(logits, want[1], y, -scale, slope), rtol=1e-10, atol=1e-12)
    assert (g[:, vocab:] == 0).all()


@pytest.mark.parametrize("block_n", BLOCKS_N)
def test_equal_maxima_count_the_first_as_torch_argmax(block_n):
    h, w, y = tied(200, 633)
    _, _, stats = emulated_forward(h, w, y, 0.0, block_n)
    _, _, want = llp.reference_forward(h, w, y)
    assert torch.equal(stats[:, 2], want[:, 2])
    assert 0 < stats[:, 2].sum() < (y != -100).sum()  # both outcomes occur


@pytest.fixture
def emulated_kernels(monkeypatch):
    """The `tilelang` implementation's wrappers (custom op outputs, chunks, padding) around the emulated kernels
    (block_n 128), as implementation 'emulated': what runs on the GPU but the kernels."""
    def kernel(kind, hidden, weight, softcap):
        def forward(h, w, y, logp, log_norm, stats):
            for out, value in zip((logp, log_norm, stats.t()), emulated_forward(h, w, y, softcap, 128)):
                out.copy_(value)

        def backward(h, w, y, log_norm, dlogp, g):
            g.copy_(emulated_logit_grad(h, w, y, log_norm, dlogp, softcap, 128))

        return forward if kind == "fwd" else backward

    monkeypatch.setattr(llp, "_kernel", kernel)
    registry.add(registry.Impl("linear_logprobs", "emulated", llp.tilelang_forward, llp.tilelang_backward))
    yield "emulated"
    registry._impls["linear_logprobs"].pop("emulated")


@pytest.mark.parametrize("softcap", [0.0, 2.0])
def test_the_tilelang_wrappers_around_the_emulated_kernels_compute_the_reference(emulated_kernels, softcap):
    """Outputs of their own (no two alias, as custom ops require), float32; d hidden over 15-token chunks (d weight
    takes CUDA's float32-output GEMM: the GPU tests check it)."""
    h, w, y, up = problem(37, 633, 72)
    h *= 3
    got = torch.ops.tiletune.linear_logprobs(h, w, y, softcap, emulated_kernels, True)
    for mine, theirs in zip(got, llp.reference_forward(h, w, y, softcap)):
        assert mine.dtype == torch.float32 and torch.allclose(mine.double(), theirs, rtol=1e-6, atol=1e-5)
    mine = outputs_and_grads(lambda *a: linear_logprobs(*a, emulated_kernels, True, softcap)[0], h, w, y, up,
                             torch.float64, weight_grad=False)  # fmt: skip
    want = outputs_and_grads(lambda *a: stock(*a, softcap), h, w, y, up, torch.float64, weight_grad=False)
    assert lce.chunk_tokens(w) == 15 and torch.allclose(mine[1], want[1], rtol=1e-5, atol=1e-6)


# ---- lowering (CPU) and the kernels on the GPU -------------------------------------------------------------


@pytest.mark.parametrize("target, matrix", [("cuda:sm_90", "wgmma"), ("hip:gfx942", "mfma")])
@pytest.mark.parametrize("kind", ["fwd", "bwd"])
def test_the_kernels_lower_at_awkward_shapes_on_the_matrix_units(target, matrix, kind):
    pytest.importorskip("tilelang", reason="TileLang is not installed or cannot be imported: pip install -e '.[test]'")
    from tiletune.kernels import _tilelang

    build = llp.forward_kernel if kind == "fwd" else llp.backward_kernel
    source = _tilelang.lower_source(build(633, 72, 2.0, "bfloat16", llp.config_for(target.partition(":")[2])), target)
    assert matrix in source.lower() and "int m" in source and "tanh" in source
    if kind == "fwd":  # the running values are set once, at the first vocabulary tile (see forward_kernel)
        assert source.index("vt == 0") < source.index("1.000000e+30")


@pytest.fixture
def tilelang_off_by_one():
    """The TileLang kernels gathering the logit after the label's: the mistake the GPU check must catch."""
    registry.add(registry.Impl(
        "linear_logprobs", "tilelang_off_by_one",
        lambda h, w, y, softcap: llp.tilelang_forward(h, w, torch.where(y == -100, y, (y + 1) % w.shape[0]), softcap),
        lambda dlogp, h, w, y, log_norm, softcap, wg: llp.tilelang_backward(
            dlogp, h, w, torch.where(y == -100, y, (y + 1) % w.shape[0]), log_norm, softcap, wg)))  # fmt: skip
    yield "tilelang_off_by_one"
    registry._impls["linear_logprobs"].pop("tilelang_off_by_one")


# (tokens, vocab, hidden, dtype, softcap): awkward shapes in both dtypes with and without the cap, a vocabulary
# smaller than a tile, Llama-3's lm_head; few enough distinct kernels to compile in minutes.
GPU_CASES = [(37, 633, 72, torch.bfloat16, 0.0), (37, 633, 72, torch.bfloat16, 2.0), (37, 633, 72, torch.float16, 0.0),
             (37, 633, 72, torch.float16, 2.0), (5, 37, 8, torch.bfloat16, 0.0), (512, 128256, 4096, torch.bfloat16, 0.0),
             (512, 128256, 4096, torch.float16, 2.0)]


@pytest.mark.gpu
@pytest.mark.parametrize("weight_grad", [True, False])
@pytest.mark.parametrize("tokens, vocab, hidden, dtype, softcap", GPU_CASES)
def test_tilelang_matches_float64(tokens, vocab, hidden, dtype, softcap, weight_grad):
    for name, verdict in zip(("logp", "dhidden", "dweight"),
                             verdicts("tilelang", dtype, tokens, vocab, softcap, hidden, weight_grad, "cuda")):
        assert verdict.passed, (name, verdict)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_tilelang_off_by_one_fails_the_gpu_check(tilelang_off_by_one, dtype):
    assert not any(v.passed for v in verdicts(tilelang_off_by_one, dtype, 37, 633, hidden=72, device="cuda"))


@pytest.mark.gpu
@pytest.mark.parametrize("tokens, vocab, hidden, dtype, softcap", GPU_CASES)
def test_tilelang_log_norm_and_statistics_match_float64(tokens, vocab, hidden, dtype, softcap):
    from _gpu_check import poison_allocator

    h, w, y, _ = problem(tokens, vocab, hidden, device="cuda")
    exact = torch.ops.tiletune.linear_logprobs(h, w, y, softcap, "reference", True)
    torch_own = torch.ops.tiletune.linear_logprobs(h.to(dtype), w.to(dtype), y, softcap, "reference", True)
    poison_allocator()
    mine = torch.ops.tiletune.linear_logprobs(h.to(dtype), w.to(dtype), y, softcap, "tilelang", True)
    for name, m, t, e in zip(("logp", "log_norm", "stats"), mine, torch_own, exact):
        assert gate(m, t, e).passed, (name, gate(m, t, e))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_tilelang_counts_the_first_of_equal_maxima_as_torch_argmax(dtype):
    h, w, y = tied(200, 633)
    _, stats = linear_logprobs(h.to("cuda", dtype), w.to("cuda", dtype), y.cuda(), "tilelang", True)
    assert torch.equal(stats[:, 2].cpu(), llp.reference_forward(h, w, y)[2][:, 2].float())
