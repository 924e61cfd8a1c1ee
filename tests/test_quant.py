"""tiletune.quant: the NF4/FP4/int8 weight formats, against the published tables and against bitsandbytes."""

import json

import pytest
import torch

from tiletune.quant import (
    FP4_CODE,
    NF4_CODE,
    QuantizedWeight,
    dequantize,
    dequantize_rows,
    dynamic_code,
    from_bnb,
    quantize,
    to_bnb,
)

# QLoRA (Dettmers et al. 2023), appendix E: the NormalFloat4 values.
PUBLISHED_NF4 = [
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
    -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
    0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
]  # fmt: skip
# bitsandbytes' fp4 by code: bit 3 the sign; 0, 0.0625, 8, 12, 4, 6, 2, 3 over 12.
PUBLISHED_FP4 = [v / 12 for v in (0, 0.0625, 8, 12, 4, 6, 2, 3)]


def rel_l2(actual, reference):
    return ((actual.double() - reference.double()).norm() / reference.double().norm()).item()


def weight(rows=256, cols=512, seed=0, dtype=torch.float32):
    return torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)).to(dtype)


def codes_of(q):
    """The 4-bit codes, first element in the high nibble."""
    return torch.stack([q.data >> 4, q.data & 15], dim=1).reshape(-1).long()


def table(kind):
    return NF4_CODE if kind == "nf4" else FP4_CODE


def scaled(w, blocksize):
    """w * (1 / absmax) per block in float32, as quantize computes it."""
    blocks = w.float().reshape(-1, blocksize)
    return (blocks * (1.0 / blocks.abs().amax(1).clamp(min=1e-38))[:, None]).reshape(-1)


# --- the tables ---


def test_nf4_code_is_the_published_table():
    assert NF4_CODE.dtype == torch.float32
    assert torch.allclose(NF4_CODE.double(), torch.tensor(PUBLISHED_NF4, dtype=torch.float64), rtol=0, atol=1e-7)
    assert NF4_CODE[7] == 0 and NF4_CODE[15] == 1 and NF4_CODE[0] == -1
    assert bool((NF4_CODE.diff() > 0).all())


def test_nf4_code_is_the_normalfloat_construction():
    # quantiles of N(0, 1) at 8 (positive side) and 7 (negative side) probabilities evenly spaced from
    # delta = 0.9677083 to 1/2, with 0, scaled to [-1, 1]: the table to float32 precision
    delta = 0.9677083
    positive = torch.special.ndtri(torch.linspace(delta, 0.5, 9, dtype=torch.float64)[:-1])
    negative = -torch.special.ndtri(torch.linspace(delta, 0.5, 8, dtype=torch.float64)[:-1])
    values = torch.cat([positive, negative, torch.zeros(1, dtype=torch.float64)]).sort().values
    assert torch.allclose(values / values.max(), NF4_CODE.double(), rtol=0, atol=2e-7)


def test_fp4_code_by_bit_pattern():
    assert FP4_CODE.dtype == torch.float32 and FP4_CODE.numel() == 16
    assert torch.allclose(FP4_CODE[:8].double(), torch.tensor(PUBLISHED_FP4, dtype=torch.float64), rtol=0, atol=1e-7)
    assert torch.equal(FP4_CODE[8:], -FP4_CODE[:8])
    assert FP4_CODE[3] == 1.0 and FP4_CODE[11] == -1.0 and FP4_CODE[0] == 0


def test_dynamic_code():
    code = dynamic_code()
    assert code.dtype == torch.float32 and code.numel() == 256
    assert bool((code.diff() > 0).all())
    assert code[127] == 0 and code[255] == 1 and -1 < code[0] < -0.99
    assert code[128] == pytest.approx(0.55e-6, rel=1e-6)  # the smallest positive value: 10**-6 * (0.1 + 1) / 2


# --- quantisation: nearest code, packing, round trip ---


@pytest.mark.parametrize("kind", ["nf4", "fp4"])
def test_every_code_is_the_nearest_table_value(kind):
    w = weight(8, 96, seed=1)
    w[0, :5] = 0.0
    w[1, :64] = 0.0  # a block of zeros
    q = quantize(w, kind, blocksize=32, double=False)
    x = scaled(w, 32).double()
    distance = (x[:, None] - table(kind).double()[None, :]).abs()
    mine = distance.gather(1, codes_of(q)[:, None]).squeeze(1)
    assert torch.equal(mine, distance.min(1).values)  # exactly: float32 midpoints decide float32 x exactly
    assert torch.equal(q.absmax, w.reshape(-1, 32).abs().amax(1))


def test_ties_and_zeros():
    # a block whose absmax is 1, so x = w exactly: values at the float32 midpoints of the tables
    nf4_mid = (NF4_CODE[:-1] + NF4_CODE[1:]) / 2
    w = torch.cat([torch.ones(1), nf4_mid, torch.zeros(16)]).reshape(1, 32)
    assert codes_of(quantize(w, "nf4", blocksize=32, double=False))[1:16].tolist() == list(range(15))  # the lower

    magnitude, pattern = FP4_CODE[:8].sort()
    fp4_mid = (magnitude[:-1] + magnitude[1:]) / 2
    w = torch.cat([torch.ones(1), fp4_mid, -fp4_mid, torch.tensor([0.0, -0.0, 1e-4, -1e-4]), torch.zeros(13)])
    codes = codes_of(quantize(w.reshape(1, 32), "fp4", blocksize=32, double=False))
    smaller = pattern[:7].tolist()  # ties take the smaller magnitude, on both sides
    assert codes[1:8].tolist() == smaller and codes[8:15].tolist() == [c | 8 for c in smaller]
    assert codes[15:19].tolist() == [0, 0, 0, 8]  # +0, -0 and tiny positive: code 0; tiny negative: 8


def test_scale_is_a_reciprocal_multiply():
    # x = w * (1 / absmax) as bitsandbytes computes it; w / absmax would cross the midpoint of codes 0 and 1
    absmax, w = torch.tensor(0.7654322981834412), torch.tensor(-0.6491603255271912)  # float32
    assert w / absmax > (NF4_CODE[0] + NF4_CODE[1]) / 2 == w * (1 / absmax)  # a tie: the lower code
    block = torch.tensor([absmax, w] + [0.0] * 30).reshape(1, 32)
    assert codes_of(quantize(block, "nf4", blocksize=32, double=False))[1] == 0


def test_zero_block_dequantizes_to_zero():
    w = weight(4, 64)
    w[2] = 0.0
    for kind in ("nf4", "fp4", "int8"):
        out = dequantize(quantize(w, kind, dtype=torch.float32))
        assert torch.isfinite(out).all() and bool((out[2] == 0).all())


@pytest.mark.parametrize(
    "kind, bound",
    [
        # measured on N(0, 1) 256x512 weights, seeds 0..4: NF4 0.0918-0.0924, FP4 0.1219-0.1221, int8
        # 0.0074-0.0075. NF4 is near the ~0.09 of the QLoRA paper's blocksize 64; int8 rounds to steps of
        # absmax/127 with absmax ~3.1 over a row of 512, so ~3.1 / 127 / sqrt(12) = 0.0070 rms.
        ("nf4", 0.095),
        ("fp4", 0.125),
        ("int8", 0.008),
    ],
)
def test_round_trip_error(kind, bound):
    w = weight()
    single = rel_l2(dequantize(quantize(w, kind, double=False, dtype=torch.float32)), w)
    double = rel_l2(dequantize(quantize(w, kind, double=True, dtype=torch.float32)), w)
    assert single < bound and double < bound
    # double quantisation adds ~2e-5 (measured 1e-5..3e-5): the 8-bit scales are 0.3% off at most
    assert abs(double - single) < 1e-4


def test_nf4_beats_fp4_on_normal_weights():
    w = weight(seed=3)
    assert rel_l2(dequantize(quantize(w, "nf4")), w) < rel_l2(dequantize(quantize(w, "fp4")), w) - 0.02


def test_low_nibble_first_packing_fails_the_round_trip():
    w = weight()
    q = quantize(w, "nf4", dtype=torch.float32)
    swapped = QuantizedWeight(q.kind, q.shape, (q.data << 4) | (q.data >> 4), q.absmax, q.blocksize, q.nested, q.dtype)
    assert rel_l2(dequantize(q), w) < 0.095
    assert rel_l2(dequantize(swapped), w) > 1.0  # neighbours exchanged: about sqrt(2)


def test_dequantize_formula():
    w = weight(16, 128, dtype=torch.bfloat16)
    q = quantize(w, "nf4", double=False)
    assert q.dtype == torch.bfloat16 and q.data.dtype == torch.uint8 and q.data.numel() == w.numel() // 2
    exact = (NF4_CODE[codes_of(q)].reshape(-1, 64) * q.absmax[:, None]).reshape(16, 128)
    out = dequantize(q)
    assert out.dtype == torch.bfloat16 and torch.equal(out, exact.to(torch.bfloat16))  # rounded once

    n = quantize(w, "nf4", double=True)
    scales = n.nested.code[n.absmax.long()] * n.nested.absmax[torch.arange(n.absmax.numel()) // 256] + n.nested.offset
    exact = (NF4_CODE[codes_of(n)].reshape(-1, 64) * scales[:, None]).reshape(16, 128)
    assert torch.equal(dequantize(n), exact.to(torch.bfloat16))
    assert n.absmax.dtype == torch.uint8 and n.nested.offset == pytest.approx(q.absmax.mean().item(), rel=1e-6)


def test_double_quantization_layout():
    w = weight(100, 64 * 3)  # 300 absmax values: one full nested block and a partial one
    q = quantize(w, "nf4")
    assert q.absmax.dtype == torch.uint8 and q.absmax.numel() == 300
    assert q.nested.absmax.numel() == 2 and q.nested.blocksize == 256 and torch.equal(q.nested.code, dynamic_code())
    exact = w.reshape(-1, 64).abs().amax(1)
    centred = exact - exact.mean()
    assert torch.equal(q.nested.absmax, torch.stack([centred[:256].abs().max(), centred[256:].abs().max()]))
    # every nested code is the nearest dynamic-table value
    x = torch.cat([centred[:256] / q.nested.absmax[0], centred[256:] / q.nested.absmax[1]]).double()
    distance = (x[:, None] - dynamic_code().double()[None, :]).abs()
    assert torch.equal(distance.gather(1, q.absmax.long()[:, None]).squeeze(1), distance.min(1).values)


def test_int8():
    w = torch.tensor([[127.0, 2.5, 3.5, -2.5, -127.0, 0.4], [0.0] * 6, [-1.0, 0.5, 0.25, 0, 0, 0]])
    q = quantize(w, "int8", dtype=torch.float32)
    assert q.data.dtype == torch.int8 and q.blocksize == 6 and q.nested is None
    assert q.data[0].tolist() == [127, 2, 4, -2, -127, 0]  # round half to even
    assert q.data[1].tolist() == [0] * 6 and q.data[2].tolist() == [-127, 64, 32, 0, 0, 0]  # 63.5 -> 64
    assert torch.equal(q.absmax, torch.tensor([127.0, 0.0, 1.0]))
    assert torch.equal(dequantize(q), q.data.float() * (q.absmax / 127)[:, None])
    q = quantize(weight(64, 256), "int8", dtype=torch.float32)
    assert torch.equal(dequantize(q), q.data.float() * (q.absmax / 127)[:, None])  # the scale first, then one product


def test_dtype_defaults_to_the_weights():
    w = weight(8, 64, dtype=torch.float16)
    assert quantize(w).dtype == torch.float16 and dequantize(quantize(w)).dtype == torch.float16
    assert dequantize(quantize(w, dtype=torch.float32)).dtype == torch.float32


# --- dequantize_rows ---


@pytest.mark.parametrize("kind, double", [("nf4", True), ("nf4", False), ("fp4", True), ("int8", False)])
@pytest.mark.parametrize("shape", [(48, 40), (64, 3), (256, 512)])  # blocks across rows; rows of an odd length
def test_dequantize_rows_equals_slices(kind, double, shape):
    q = quantize(weight(*shape, seed=5), kind, double=double)
    full = dequantize(q)
    rows = shape[0]
    for start, stop in [(0, 0), (0, 1), (1, 2), (3, 4), (5, 17), (7, rows), (rows - 1, rows), (0, rows), (rows, rows)]:
        part = dequantize_rows(q, start, stop)
        assert part.shape == (stop - start, shape[1]) and part.dtype == full.dtype
        assert torch.equal(part, full[start:stop]), (start, stop)


def test_dequantize_rows_range_errors():
    q = quantize(weight(8, 64))
    for start, stop in [(-1, 2), (3, 2), (0, 9)]:
        with pytest.raises(ValueError, match="rows"):
            dequantize_rows(q, start, stop)


# --- validation and size ---


def test_validation_errors():
    with pytest.raises(ValueError, match=r"\(3, 5\)"):
        quantize(torch.randn(3, 5))
    with pytest.raises(ValueError, match=r"\(2, 48\).*blocksize 64"):
        quantize(torch.randn(2, 48))  # 96 elements: even, not whole blocks
    for blocksize in (0, 1, 48, -64):
        with pytest.raises(ValueError, match="power of two"):
            quantize(torch.randn(4, 96), blocksize=blocksize)
    with pytest.raises(ValueError, match="kind"):
        quantize(torch.randn(4, 64), "int4")
    with pytest.raises(ValueError, match=r"\(64,\)"):
        quantize(torch.randn(64))
    with pytest.raises(ValueError, match="floating"):
        quantize(torch.ones(4, 64, dtype=torch.int32))
    assert quantize(torch.randn(2, 48), blocksize=32).absmax.numel() == 3
    assert quantize(torch.randn(3, 5), "int8").data.shape == (3, 5)  # int8 needs no blocks


def test_bits_per_weight():
    n = 4096 * 4096
    q = quantize(torch.randn(4096, 4096), "nf4")
    # 0.5 byte + 1 byte/64 + 4 bytes/(64*256) a weight, and the 1 KiB nested code table
    assert q.nbytes() == n // 2 + n // 64 + 4 * n // (64 * 256) + 256 * 4
    assert q.nbytes() * 8 / n == pytest.approx(4.127, abs=1e-3)
    assert quantize(torch.randn(256, 512), "nf4", double=False).nbytes() * 8 / (256 * 512) == 4.5
    assert quantize(torch.randn(256, 512), "int8").nbytes() == 256 * 512 + 256 * 4


# --- bitsandbytes checkpoints ---


def packed_state(q, prefix="model.layers.0.self_attn.q_proj.weight."):
    """A transformers/bitsandbytes 4-bit quant state for q, built from the documented format."""
    dtype = str(q.dtype).removeprefix("torch.")
    meta = {"quant_type": q.kind, "blocksize": q.blocksize, "dtype": dtype, "shape": list(q.shape)}
    tensors = {"absmax": q.absmax, "quant_map": table(q.kind).clone()}
    if q.nested is not None:
        tensors |= {"nested_absmax": q.nested.absmax, "nested_quant_map": q.nested.code}
        meta |= {"nested_blocksize": q.nested.blocksize, "nested_dtype": "float32", "nested_offset": q.nested.offset}
    state = {prefix + k: v for k, v in tensors.items()}
    packed = torch.tensor(list(json.dumps(meta).encode()), dtype=torch.uint8)  # JSON in uint8
    state[prefix + f"quant_state.bitsandbytes__{q.kind}"] = packed
    return state


@pytest.mark.parametrize("kind", ["nf4", "fp4"])
@pytest.mark.parametrize("double", [True, False])
def test_from_bnb_on_a_hand_built_state(kind, double):
    q = quantize(weight(64, 128, dtype=torch.bfloat16), kind, double=double)
    loaded = from_bnb(q.data.reshape(-1, 1), packed_state(q), (64, 128), torch.bfloat16)
    assert loaded.kind == kind and loaded.shape == (64, 128) and loaded.blocksize == 64
    assert (loaded.nested is None) == (not double)
    assert torch.equal(dequantize(loaded), dequantize(q))
    assert from_bnb(q.data.reshape(-1, 1), packed_state(q), None, None).dtype == torch.bfloat16  # from the JSON
    # another quant_storage (bf16 words holding the same bytes)
    words = q.data.view(torch.bfloat16).reshape(-1, 1)
    assert torch.equal(dequantize(from_bnb(words, packed_state(q), (64, 128), torch.bfloat16)), dequantize(q))


def test_from_bnb_errors():
    q = quantize(weight(64, 128), "nf4")
    state = packed_state(q, prefix="")
    with pytest.raises(ValueError, match="shape"):
        from_bnb(q.data, state, (128, 64), torch.float32)
    with pytest.raises(ValueError, match="unexpected key"):
        from_bnb(q.data, state | {"bias": torch.zeros(64)}, (64, 128), torch.float32)
    with pytest.raises(ValueError, match="not a bitsandbytes"):
        from_bnb(q.data, {"absmax": q.absmax}, (64, 128), torch.float32)
    with pytest.raises(ValueError, match="quant_map"):
        from_bnb(q.data, state | {"quant_map": FP4_CODE}, (64, 128), torch.float32)
    with pytest.raises(ValueError, match="packed bytes"):
        from_bnb(q.data[:-1], state, (64, 128), torch.float32)


@pytest.fixture(scope="module")
def bnb():
    return pytest.importorskip("bitsandbytes.functional", reason="bitsandbytes does not import: pip install bitsandbytes",
                               exc_type=ImportError)


def test_tables_equal_bitsandbytes(bnb):
    assert torch.equal(NF4_CODE, bnb.get_4bit_type("nf4", device="cpu"))
    assert torch.equal(FP4_CODE, bnb.get_4bit_type("fp4", device="cpu"))
    assert torch.equal(dynamic_code(), bnb.create_dynamic_map(signed=True))


@pytest.mark.parametrize("kind", ["nf4", "fp4"])
@pytest.mark.parametrize("double", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_from_bnb_dequantizes_as_bitsandbytes(bnb, kind, double, dtype):
    w = weight(256, 512, seed=7, dtype=dtype)
    packed, state = bnb.quantize_4bit(w, blocksize=64, compress_statistics=double, quant_type=kind)
    tensors = {f"lm.weight.{k}": v for k, v in state.as_dict(packed=True).items()}
    q = from_bnb(packed, tensors, (256, 512), dtype)
    assert (q.nested is not None) == double
    expected = bnb.dequantize_4bit(packed, state)
    assert torch.equal(dequantize(q), expected)  # value for value (-0.0 == 0.0)
    assert torch.equal(dequantize_rows(q, 3, 130), expected[3:130])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_quantize_packs_the_bytes_bitsandbytes_does(bnb, dtype):
    w = weight(256, 512, seed=11, dtype=dtype)
    # NF4: the same bytes and scales
    packed, state = bnb.quantize_4bit(w, blocksize=64, compress_statistics=False, quant_type="nf4")
    q = quantize(w, "nf4", double=False)
    assert torch.equal(q.data, packed.reshape(-1)) and torch.equal(q.absmax, state.absmax)

    # double quantisation: the same offset and nested scales; bitsandbytes' CPU path picks the 8-bit
    # codes through a 65536-entry lookup over [-1, 1], which can take a neighbour of the nearest value
    packed, state = bnb.quantize_4bit(w, blocksize=64, compress_statistics=True, quant_type="nf4")
    q = quantize(w, "nf4", double=True)
    assert torch.equal(q.data, packed.reshape(-1))
    assert q.nested.offset == state.offset.item() and torch.equal(q.nested.absmax, state.state2.absmax)
    differ = q.absmax != state.absmax
    assert differ.float().mean() < 0.01 and bool(((q.absmax.int() - state.absmax.int()).abs() <= 1).all())

    # FP4: codes differ only at ties (bitsandbytes' CPU path takes the lower signed value and swaps the
    # sign of zero): where they differ, both values are equally near
    packed, state = bnb.quantize_4bit(w, blocksize=64, compress_statistics=False, quant_type="fp4")
    q = quantize(w, "fp4", double=False)
    theirs = codes_of(QuantizedWeight("fp4", q.shape, packed.reshape(-1), state.absmax))
    mine = codes_of(q)
    x = scaled(w, 64).double()
    near_mine, near_theirs = (x - FP4_CODE.double()[mine]).abs(), (x - FP4_CODE.double()[theirs]).abs()
    assert bool(((near_mine - near_theirs).abs() <= 1e-7).all())
    assert (mine != theirs).float().mean() < 0.02


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["nf4", "fp4", "int8"])
def test_cuda_equals_cpu(kind):
    w = weight(256, 512, seed=13, dtype=torch.bfloat16)
    on_cpu, on_gpu = quantize(w, kind, double=False), quantize(w.cuda(), kind, double=False)
    assert torch.equal(on_gpu.data.cpu(), on_cpu.data) and torch.equal(on_gpu.absmax.cpu(), on_cpu.absmax)
    assert torch.equal(dequantize(on_gpu).cpu(), dequantize(on_cpu))
    assert torch.equal(dequantize_rows(on_gpu, 5, 77).cpu(), dequantize(on_cpu)[5:77])
    # double quantisation: the offset is a float32 mean, summed in another order on the GPU
    nested_cpu, nested_gpu = quantize(w, kind), quantize(w.cuda(), kind)
    assert torch.equal(nested_gpu.data.cpu(), nested_cpu.data)
    assert rel_l2(dequantize(nested_gpu).cpu(), dequantize(nested_cpu)) < 1e-3


@pytest.mark.parametrize("kind, double", [("nf4", True), ("fp4", False)])
def test_to_bnb_is_what_from_bnb_reads(kind, double):
    q = quantize(weight(64, 128, dtype=torch.bfloat16), kind, double=double)
    tensors = to_bnb(q, "model.layers.0.mlp.up_proj.weight")
    packed = tensors.pop("model.layers.0.mlp.up_proj.weight")
    assert packed.dtype == torch.uint8 and packed.shape == (64 * 128 // 2, 1)
    assert torch.equal(dequantize(from_bnb(packed, tensors)), dequantize(q))
    with pytest.raises(ValueError, match="nf4 or fp4"):
        to_bnb(quantize(weight(64, 128), "int8"))
