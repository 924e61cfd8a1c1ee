"""linear_logprobs: exact against PyTorch's log-softmax in float64, chunked at awkward sizes; float32 and bf16
log-probabilities and gradients within the precision gate of PyTorch's own; an off-by-one gather fails that gate."""

import pytest
import torch

import tiletune.kernels.linear_cross_entropy as lce
import tiletune.kernels.linear_logprobs as llp
from tiletune.kernels import registry
from tiletune.kernels.linear_logprobs import linear_logprobs
from tiletune.numerics import gate

SHAPES = [(77, 500), (5, 37), (130, 1001)]  # tokens not a multiple of the chunk, vocabularies not a power of 2


def problem(tokens, vocab, hidden=32, seed=0):
    """Fresh float64 inputs: hidden states, weight, labels with every fifth ignored, an upstream gradient."""
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(tokens, hidden, generator=gen, dtype=torch.float64)
    w = torch.randn(vocab, hidden, generator=gen, dtype=torch.float64) / hidden**0.5
    y = torch.randint(0, vocab, (tokens,), generator=gen)
    y[::5] = -100
    return h, w, y, torch.randn(tokens, generator=gen, dtype=torch.float64)


def stock(h, w, y, softcap=0.0):
    """PyTorch's own: the full logits, log-softmax in float32 (float64 for float64 inputs), gather."""
    logits = (h @ w.t()).to(torch.promote_types(h.dtype, torch.float32))
    if softcap:
        logits = softcap * torch.tanh(logits / softcap)
    return logits.log_softmax(-1).gather(1, y.clamp(min=0)[:, None])[:, 0] * (y != -100)


def outputs_and_grads(fn, h, w, y, up, dtype):
    """(log-probs, d hidden, d weight) of `fn` on the inputs cast to `dtype`, upstream gradient `up`."""
    h, w = (t.to(dtype).requires_grad_() for t in (h, w))
    logp = fn(h, w, y)
    return (logp, *torch.autograd.grad((logp * up.to(logp.dtype)).sum(), (h, w)))


def verdicts(impl, dtype, tokens, vocab, softcap=0.0):
    """The precision gate's verdict on each of (log-probs, d hidden, d weight) of `impl` in `dtype`."""
    h, w, y, up = problem(tokens, vocab)
    exact = outputs_and_grads(lambda *a: stock(*a, softcap), h, w, y, up, torch.float64)
    torch_own = outputs_and_grads(lambda *a: stock(*a, softcap), h, w, y, up, dtype)
    mine = outputs_and_grads(lambda *a: linear_logprobs(*a, impl, softcap=softcap)[0], h, w, y, up, dtype)
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
    assert {s.op: s.impl for s in parse_kernel_spec("all").ops}["linear_logprobs"] == "chunked"
