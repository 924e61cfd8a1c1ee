"""linear_cross_entropy: exact against PyTorch's cross-entropy in float64, chunked at awkward sizes,
the bf16 error within 2x of PyTorch's own, and patched into a causal LM with the same loss and gradients."""

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

import tiletune.kernels.linear_cross_entropy as lce
from tiletune.errors import UserError
from tiletune.kernels.linear_cross_entropy import linear_cross_entropy
from tiletune.patch import apply_kernels


def problem(tokens=77, hidden=32, vocab=500, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(tokens, hidden, generator=gen, dtype=torch.float64).to(dtype).requires_grad_()
    w = (torch.randn(vocab, hidden, generator=gen, dtype=torch.float64) / hidden**0.5).to(dtype).requires_grad_()
    y = torch.randint(0, vocab, (tokens,), generator=gen)
    y[::5] = -100
    return h, w, y


@pytest.mark.parametrize("impl, chunk_tokens", [("reference", None), ("chunked", 10), ("chunked", 1), ("chunked", 1000)])
def test_matches_cross_entropy_in_float64(monkeypatch, impl, chunk_tokens):
    h, w, y = problem()
    if chunk_tokens:
        monkeypatch.setattr(lce, "CHUNK_BYTES", 8 * w.shape[0] * chunk_tokens)
    want = F.cross_entropy(h @ w.t(), y, ignore_index=-100, reduction="sum") / 50.0
    grads = torch.autograd.grad(want * 3, (h, w))
    got = linear_cross_entropy(h, w, y, 50.0, impl)
    got_grads = torch.autograd.grad(got * 3, (h, w))
    assert float(got) == pytest.approx(float(want), rel=1e-12)
    for mine, theirs in zip(got_grads, grads):
        assert torch.allclose(mine, theirs, rtol=1e-10, atol=1e-13)


@pytest.mark.parametrize("impl", ["reference", "chunked"])
def test_soft_capped_logits_match_float64(monkeypatch, impl):
    """Gemma 2's final logit soft-cap c·tanh(z / c) (c = 30 there; 2 here, so the cap bends most logits)."""
    monkeypatch.setattr(lce, "CHUNK_BYTES", 8 * 500 * 10)
    h, w, y = problem()
    h.data *= 3
    want = F.cross_entropy(2.0 * torch.tanh(h @ w.t() / 2.0), y, ignore_index=-100, reduction="sum") / 50.0
    grads = torch.autograd.grad(want, (h, w))
    got = linear_cross_entropy(h, w, y, 50.0, impl, softcap=2.0)
    assert float(got) == pytest.approx(float(want), rel=1e-12)
    for mine, theirs in zip(torch.autograd.grad(got, (h, w)), grads):
        assert torch.allclose(mine, theirs, rtol=1e-10, atol=1e-13)
    uncapped = linear_cross_entropy(h, w, y, 50.0, impl)
    assert float(uncapped) != pytest.approx(float(want), rel=1e-3)  # the cap matters here: the check can fail


@pytest.mark.parametrize("token_block, vocab_slice", [(10, 37), (1, 500), (77, 1), (1000, 1000)])
@pytest.mark.parametrize("softcap", [0.0, 2.0])
def test_streamed_slices_match_cross_entropy_in_float64(token_block, vocab_slice, softcap):
    """A frozen weight read a vocabulary slice at a time, once per block of tokens (a head in host memory): the
    online log-normaliser and softmax-weighted rows give the exact loss and d hidden at awkward block sizes."""
    h, w, y = problem()
    w.requires_grad_(False)
    h.data *= 3  # logits big enough that the running maximum moves between slices
    logits = h @ w.t()
    want = F.cross_entropy(softcap * torch.tanh(logits / softcap) if softcap else logits, y, ignore_index=-100,
                           reduction="sum") / 50.0  # fmt: skip
    (grad,) = torch.autograd.grad(want, h)
    loss, dhidden, dweight = lce.streamed_forward(h.detach(), w, y, 50.0, softcap, token_block, vocab_slice)
    assert float(loss) == pytest.approx(float(want), rel=1e-12) and dweight.numel() == 0
    assert torch.allclose(dhidden, grad, rtol=1e-10, atol=1e-13)
    assert not torch.allclose(dhidden, grad * 1.001, rtol=1e-6, atol=1e-13)  # the comparison can fail


@pytest.mark.gpu
def test_on_the_gpu_a_head_in_host_memory_is_streamed_a_slice_at_a_time(monkeypatch):
    """`chunked` with the frozen weight in pinned host memory: the on-device result (loss to float32 rounding,
    d hidden to bf16's), while the GPU never holds half the weight (64 slices of 4 MiB of a 256 MiB head, two in
    flight, beside the block's float32 working set)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU: run on a CUDA machine (pytest -m gpu)")
    monkeypatch.setattr(lce, "CHUNK_BYTES", 2**24)
    gen = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(2048, 1024, device="cuda", dtype=torch.bfloat16, generator=gen)
    w = (torch.randn(131072, 1024, device="cuda", generator=gen) / 32).bfloat16()
    y = torch.randint(0, 131072, (2048,), device="cuda", generator=gen)
    y[::7] = -100
    on_device = lce.chunked_forward(h, w, y, 1000.0, False)
    host = w.cpu().pin_memory()
    del w
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    streamed = lce.chunked_forward(h, host, y, 1000.0, False)
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() - before < host.numel() * host.element_size() / 2
    torch.testing.assert_close(streamed[0], on_device[0], rtol=1e-5, atol=0)
    error = (streamed[1].float() - on_device[1].float()).norm() / on_device[1].float().norm()
    assert error < 1e-2, error  # both round d hidden to bf16, in another order
    assert streamed[2].numel() == 0 and streamed[2].device.type == "cuda"
    whole = lce.reference_forward(h, host, y, 1000.0, False)  # the reference copies a head in host memory whole
    torch.testing.assert_close(whole[0], on_device[0], rtol=1e-5, atol=0)


def _stock_loss(softcap: float):
    """transformers' loss over the head's logits in the input dtype, upcast (soft-capped first, as Gemma 2's)."""
    def loss(h, w, y, divisor):
        logits = (h @ w.t()).float() if h.dtype != torch.float64 else h @ w.t()
        if softcap:
            logits = softcap * torch.tanh(logits / softcap)
        return F.cross_entropy(logits, y, ignore_index=-100, reduction="sum") / divisor
    return loss


def _gpu_problem(tokens, vocab, hidden, weight_grad, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    h = torch.randn(tokens, hidden, device="cuda", generator=gen).bfloat16().requires_grad_()
    w = (torch.randn(vocab, hidden, device="cuda", generator=gen) * 2 / hidden**0.5).bfloat16()
    y = torch.randint(0, vocab, (tokens,), device="cuda", generator=gen)
    y[::7] = -100
    y[1] = vocab - 1  # the last column, in the vocabulary's ragged tail
    return [h, w.requires_grad_(weight_grad)], y, float((y != -100).sum())


@pytest.mark.gpu
@pytest.mark.parametrize("tokens, vocab, hidden, chunk_tokens, softcap, weight_grad", [
    (77, 1000, 64, None, 0.0, False),  # one chunk, the vocabulary shorter than one step of the row's lanes
    (513, 32003, 128, 100, 0.0, False),  # an odd vocabulary (no vector loads), a partial last chunk
    (1000, 151936, 256, 441, 0.0, True),  # Qwen3's vocabulary, the weight trained too
    (300, 256000, 128, 128, 30.0, False),  # Gemma's vocabulary and final soft-cap
])  # fmt: skip
def test_tilelang_gradient_kernel_matches_float64(monkeypatch, tokens, vocab, hidden, chunk_tokens, softcap,
                                                  weight_grad):  # fmt: skip
    """The TileLang chunk gradient (in place over the bf16 logits) against float64 and against transformers' own bf16
    loss, loss and gradients through tiletune.numerics.gate, at awkward chunk and vocabulary sizes."""
    from _gpu_check import check

    if chunk_tokens:
        monkeypatch.setattr(lce, "CHUNK_BYTES", 4 * vocab * chunk_tokens)
    inputs, y, divisor = _gpu_problem(tokens, vocab, hidden, weight_grad)
    stock = _stock_loss(softcap)
    check("lce", f"{tokens}x{vocab} cap{softcap:g}", torch.bfloat16, inputs, lambda h, w: stock(h, w, y, divisor),
          lambda h, w: linear_cross_entropy(h, w, y, divisor, "tilelang", strict=True, softcap=softcap),
          ["loss", "d hidden"] + (["d weight"] if weight_grad else []))


@pytest.mark.gpu
def test_a_wrong_gradient_kernel_fails_the_gate(monkeypatch):
    """The same check on a kernel built with a soft-cap the model does not have: the gate catches it."""
    from _gpu_check import check

    build = lce.gradient_kernel
    monkeypatch.setattr(lce, "gradient_kernel", lambda vocab, softcap, dtype: build(vocab, 5.0, dtype))
    inputs, y, divisor = _gpu_problem(64, 1016, 64, False)  # a vocabulary no other test compiles: no cached kernel
    stock = _stock_loss(0.0)
    with pytest.raises(AssertionError, match="FAIL"):
        check("lce", "wrong kernel", torch.bfloat16, inputs, lambda h, w: stock(h, w, y, divisor),
              lambda h, w: linear_cross_entropy(h, w, y, divisor, "tilelang", strict=True), ["loss", "d hidden"])


def test_without_the_kernel_the_chunked_loop_runs_not_the_whole_logits():
    """Where TileLang cannot run (here: on the CPU) `tilelang` falls back to the chunked loop, with its reason
    counted, and gives the chunked result."""
    from tiletune.kernels import registry

    h, w, y = problem()
    chosen = registry.select("linear_cross_entropy", "tilelang", False, h, w, y, 50.0, True, 0.0)
    assert chosen.name == "chunked"
    assert any(op == "linear_cross_entropy" and impl == "tilelang" for op, impl, _ in registry.runtime_fallbacks)
    assert registry.select("rms_norm", "tilelang", False, torch.ones(2, 4), torch.ones(4), 1e-6, 0.0).name == "reference"
    got = linear_cross_entropy(h, w, y, 50.0, "tilelang")
    assert float(got) == pytest.approx(float(linear_cross_entropy(h, w, y, 50.0, "chunked")), rel=1e-12)


def test_a_kernel_missing_from_the_library_falls_back_to_the_chunked_loop(monkeypatch):
    """A kernel library without the gradient kernel (and no TileLang to compile it) sends the call to the op's
    fallback, the chunked loop, with the reason counted: never to the whole-logits reference."""
    from tiletune.kernels import registry
    from tiletune.kernels.library import KernelMissing

    def missing(*inputs):
        raise KernelMissing("the kernel library has no kernel (cross_entropy_grad, 500, 0.0, bfloat16)")

    ran = []
    chunked = registry.get("linear_cross_entropy", "chunked")
    monkeypatch.setitem(registry._impls["linear_cross_entropy"], "chunked",
                        registry.Impl("linear_cross_entropy", "chunked", lambda *a: ran.append(1) or chunked.forward(*a)))
    monkeypatch.setitem(registry._impls["linear_cross_entropy"], "library_only",
                        registry.Impl("linear_cross_entropy", "library_only", missing))
    h, w, y = problem()
    got = linear_cross_entropy(h, w, y, 50.0, "library_only")
    assert ran and float(got) == pytest.approx(float(linear_cross_entropy(h, w, y, 50.0, "reference")), rel=1e-12)
    assert any(impl == "library_only" and "no kernel" in reason for _, impl, reason in registry.runtime_fallbacks)


def test_frozen_weight_gets_no_gradient():
    h, w, y = problem()
    w.requires_grad_(False)
    linear_cross_entropy(h, w, y, 10.0, "chunked").backward()
    assert h.grad is not None and w.grad is None


def test_bf16_error_is_within_twice_pytorchs_own(monkeypatch):
    monkeypatch.setattr(lce, "CHUNK_BYTES", 4 * 500 * 16)
    h, w, y = problem(tokens=300)
    exact = torch.autograd.grad(F.cross_entropy(h @ w.t(), y, ignore_index=-100), h)[0]
    hb, wb = h.detach().bfloat16().requires_grad_(), w.detach().bfloat16()
    torch_grad = torch.autograd.grad(F.cross_entropy((hb @ wb.t()).float(), y, ignore_index=-100), hb)[0]
    mine = torch.autograd.grad(linear_cross_entropy(hb, wb, y, float((y != -100).sum()), "chunked"), hb)[0]

    def err(g):
        return float((g.double() - exact).norm() / exact.norm())

    assert torch.isfinite(mine).all() and err(mine) <= 2 * err(torch_grad) + 1e-3


def tiny_llama():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2)  # fmt: skip
    return LlamaForCausalLM(cfg)


@pytest.mark.parametrize("num_items", [None, 40])
def test_patched_causal_lm_gives_the_stock_loss_and_gradients(num_items):
    model = tiny_llama()
    ids = torch.randint(0, 300, (2, 21))
    labels = ids.clone()
    labels[0, :7] = -100
    extra = {} if num_items is None else {"num_items_in_batch": torch.tensor(num_items)}
    stock = model(input_ids=ids, labels=labels, **extra).loss
    stock_grads = torch.autograd.grad(stock, list(model.parameters()))
    report = apply_kernels(model, {"linear_cross_entropy": "chunked"})
    out = model(input_ids=ids, labels=labels, **extra)
    fused_grads = torch.autograd.grad(out.loss, list(model.parameters()))
    assert out.logits is None and float(out.loss) == pytest.approx(float(stock), rel=1e-6)
    for mine, theirs in zip(fused_grads, stock_grads):
        assert torch.allclose(mine, theirs, rtol=1e-4, atol=1e-6)
    with torch.no_grad():  # evaluation and generation still get logits
        assert model(input_ids=ids, labels=labels).logits.shape == (2, 21, 300)
    report.revert()
    assert "forward" not in model.__dict__


def test_all_includes_it_and_layer_selectors_are_refused():
    model = tiny_llama()
    from tiletune.kernels import registry

    report = apply_kernels(model, "all")
    unavailable = registry.get("linear_cross_entropy", "tilelang").unavailable()  # on a CPU machine: no GPU
    assert report.to_dict()["ops"]["linear_cross_entropy"] == {
        "impl": "tilelang", "patched": 1, "layers": "model", "modules": ["lm_head"], "fallback": unavailable}  # fmt: skip
    if unavailable:
        assert f"falls back to chunked: {unavailable}" in report.summary()
    report.revert()
    with pytest.raises(UserError, match="takes no layers or modules"):
        apply_kernels(model, {"linear_cross_entropy": {"impl": "chunked", "layers": "0"}})


def test_gemma2s_soft_capped_head_gives_the_stock_loss_and_gradients():
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(0)
    model = Gemma2ForCausalLM(Gemma2Config(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                           num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                           final_logit_softcapping=0.5)).float()  # fmt: skip
    ids = torch.randint(0, 300, (2, 21))
    stock = model(input_ids=ids, labels=ids).loss
    stock_grads = torch.autograd.grad(stock, list(model.parameters()))
    report = apply_kernels(model, {"linear_cross_entropy": "chunked"})
    assert report.to_dict()["ops"]["linear_cross_entropy"]["patched"] == 1
    fused = model(input_ids=ids, labels=ids).loss
    assert float(fused) == pytest.approx(float(stock), rel=1e-6)
    for mine, theirs in zip(torch.autograd.grad(fused, list(model.parameters())), stock_grads):
        assert torch.allclose(mine, theirs, rtol=1e-4, atol=1e-6)
