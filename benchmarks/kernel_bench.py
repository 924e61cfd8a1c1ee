"""Time tiletune's TileLang kernels (forward + backward) against eager PyTorch, Liger-Kernel, cuBLAS and SDPA.

Llama-3-8B shapes: 8192 tokens (batch 4 x 2048), hidden 4096, intermediate 14336, 32 q / 8 kv heads of
128, bf16; `--only quant`: NF4 dequantization (PyTorch, bitsandbytes, TileLang) and the QLoRA Linear; `--only moe`:
Qwen3-30B-A3B's experts (grouped GEMM against a dense GEMM over the same rows and torch's grouped_mm); `--only
lora_rank`: lora_linear's rank-r GEMMs as the op runs them and reformulated; `--only host`: the elementwise ops at 8
tokens, where `launch` is the host's cost of a call. Each
variant is timed two ways: `gpu` replays the forward + backward captured in a CUDA
graph (triton.testing.do_bench_cudagraph), i.e. device time, what a training step pays when the CPU
runs ahead of the GPU; `launch` calls it eagerly between CUDA events (triton.testing.do_bench), so
Python dispatch shows when it exceeds the device time. Attention: causal, batch 4 x 2048, 32 q / 8 kv
heads of 128, TileLang against torch SDPA with the flash and with the cuDNN backend (`kernels: all` will
include attention only if it beats both). Variants are interleaved (A B C A B C ...) over
--rounds rounds; the table shows the median over rounds with min and max. Ratios are baseline time /
variant time from the same run (> 1 is faster).

    python benchmarks/kernel_bench.py [--tune] [--rounds 5] [--out benchmarks/results] [--only attention]
    python benchmarks/kernel_bench.py --only moe [--moe-shape mixtral-8x7b] [--moe-variants m64,m128,...]
                                                              (the grouped GEMM config sweep)

--tune autotunes the linear GEMM tile configuration per shape first (linear.CANDIDATES) and prints
the entries for linear.TUNED. Writes kernels_<gpu>.json and .csv (GPU, date, git commit, medians,
min/max) to --out.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import datetime
import functools
import json
import math
import os
import statistics
import subprocess
import sys

import torch
import torch.nn.functional as F

from tiletune.bench.profile import profile_step, profile_table

TOKENS, HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM = 8192, 4096, 14336, 32, 8, 128
LINEAR_SHAPES = {"q_proj/o_proj": (4096, 4096), "k_proj/v_proj": (1024, 4096), "gate/up_proj": (14336, 4096),
                 "down_proj": (4096, 14336)}


def bench(fn) -> float:
    """Median ms of `fn` launched eagerly between CUDA events."""
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def bench_graph(fn) -> float:
    """Median ms of `fn` replayed from a CUDA graph (device time); NaN if it cannot be captured."""
    from triton.testing import do_bench_cudagraph

    try:
        return do_bench_cudagraph(fn, rep=100, return_mode="median")
    except RuntimeError as err:
        print(f"CUDA graph capture failed: {str(err).splitlines()[0]}", flush=True)
        return float("nan")


def fwd_bwd(forward, leaves, grad_out):
    """Forward then backward to `leaves` (torch.autograd.grad: no accumulation into .grad)."""
    def run():
        torch.autograd.grad(forward(), leaves, grad_out)
    return run


def forward_only(forward):
    """Forward without autograd recording."""
    def run():
        with torch.no_grad():
            forward()
    return run


def elementwise_cases(tokens: int = TOKENS):
    """(op, {variant: callable}) with callables doing forward + backward on Llama-3-8B shapes at `tokens` tokens
    (`--only host`: 8, where the device work is a few microseconds and the `launch` time is the host's cost of a
    call: the custom op's dispatch, the kernel's argument checks, autograd).

    Every variant gets its own copy of the inputs: Liger's swiglu backward writes its gradients into
    the saved inputs, which would change the data the other variants see.
    """
    from liger_kernel.ops.rms_norm import LigerRMSNormFunction
    from liger_kernel.ops.swiglu import LigerSiLUMulFunction
    from liger_kernel.transformers.rope import liger_rotary_pos_emb
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    from tiletune.kernels import rms_norm, rope, swiglu

    dev, dt = "cuda", torch.bfloat16

    def leaves(*tensors):
        return [t.detach().clone().requires_grad_() for t in tensors]

    suffix = "" if tokens == TOKENS else f" ({tokens} tokens)"
    x = torch.randn(tokens, HIDDEN, device=dev, dtype=dt)
    w = (1 + 0.1 * torch.randn(HIDDEN, device=dev)).to(dt)
    dy = torch.randn_like(x)
    fns = {"eager": lambda x, w: rms_norm.reference_forward(x, w, 1e-5),
           "liger": lambda x, w: LigerRMSNormFunction.apply(x, w, 1e-5, 0.0, "llama", False),
           "tilelang": lambda x, w: rms_norm.rms_norm(x, w, 1e-5, "tilelang", True)}
    yield "rms_norm" + suffix, {v: _case(f, leaves(x, w), dy) for v, f in fns.items()}

    g = torch.randn(tokens, INTER, device=dev, dtype=dt)
    u = torch.randn_like(g)
    dy = torch.randn_like(g)
    fns = {"eager": lambda g, u: F.silu(g) * u, "liger": LigerSiLUMulFunction.apply,
           "tilelang": lambda g, u: swiglu.swiglu(g, u, "tilelang", True)}
    yield "swiglu" + suffix, {v: _case(f, leaves(g, u), dy) for v, f in fns.items()}

    b, s = 4, max(1, tokens // 4)
    q = torch.randn(b, s, HEADS, HEAD_DIM, device=dev, dtype=dt).transpose(1, 2)
    k = torch.randn(b, s, KV_HEADS, HEAD_DIM, device=dev, dtype=dt).transpose(1, 2)
    angle = torch.rand(b, s, HEAD_DIM // 2, device=dev) * 100
    cos, sin = (f(torch.cat([angle, angle], -1)).to(dt) for f in (torch.cos, torch.sin))
    dq, dk = torch.randn_like(q), torch.randn_like(k)
    fns = {"eager": apply_rotary_pos_emb, "liger": liger_rotary_pos_emb,
           "tilelang": lambda q, k, c, s: rope.rope(q, k, c, s, "tilelang", True)}
    yield "rope" + suffix, {v: _case(lambda q, k, f=f: f(q, k, cos, sin), [t.detach().transpose(1, 2).clone().transpose(1, 2)
                                                                   .requires_grad_() for t in (q, k)], (dq, dk))
                   for v, f in fns.items()}


def _case(forward, leaves, grad_out):
    return fwd_bwd(lambda: forward(*leaves), leaves, grad_out)


def linear_cases():
    """(shape name, {variant: callable}) for forward and forward + backward (dX and dW)."""
    from tiletune.kernels import linear

    for name, (out_f, in_f) in LINEAR_SHAPES.items():
        x = torch.randn(TOKENS, in_f, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        w = (torch.randn(out_f, in_f, device="cuda") / in_f**0.5).to(torch.bfloat16).requires_grad_()
        dy = torch.randn(TOKENS, out_f, device="cuda", dtype=torch.bfloat16)
        yield f"linear fwd {name}", {
            "cublas": forward_only(lambda x=x, w=w: torch.matmul(x, w.t())),
            "tilelang": forward_only(lambda x=x, w=w: linear.linear(x, w, None, "tilelang", True)),
        }
        yield f"linear fwd+bwd {name}", {
            "cublas": fwd_bwd(lambda x=x, w=w: torch.matmul(x, w.t()), (x, w), dy),
            "tilelang": fwd_bwd(lambda x=x, w=w: linear.linear(x, w, None, "tilelang", True), (x, w), dy),
        }


def attention_cases():
    """(case, {variant: callable}) for causal GQA attention forward and forward + backward, Llama-3-8B shape."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from tiletune.kernels import attention

    b, s = 4, TOKENS // 4
    scale = HEAD_DIM**-0.5
    # (batch, seq, heads, d) tensors seen through transformers' (1, 2) transpose, as the projections make them
    q, k, v = (torch.randn(b, s, h, HEAD_DIM, device="cuda", dtype=torch.bfloat16).transpose(1, 2).requires_grad_()
               for h in (HEADS, KV_HEADS, KV_HEADS))
    dout = torch.randn_like(q)

    def sdpa(backend):
        def run():
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
        return run

    variants = {"flash": sdpa(SDPBackend.FLASH_ATTENTION), "cudnn": sdpa(SDPBackend.CUDNN_ATTENTION),
                "tilelang": lambda: attention.attention(q, k, v, scale, "tilelang", True)}
    try:  # flash is the baseline: if it cannot run, the case fails loudly; cuDNN may be missing from a build
        variants["cudnn"]()
    except RuntimeError as err:
        print(f"attention: SDPA's cuDNN backend cannot run here, left out: {str(err).splitlines()[0]}", flush=True)
        del variants["cudnn"]
    yield "attention fwd", {name: forward_only(fn) for name, fn in variants.items()}
    yield "attention fwd+bwd", {name: fwd_bwd(fn, (q, k, v), dout) for name, fn in variants.items()}


def tune_linear():
    """Pick the fastest candidate tile configuration per (kind, shape); install and print them."""
    from tiletune.kernels import _tilelang, linear

    tl = _tilelang.tilelang()
    arch = _tilelang.device_arch()
    target = _tilelang.parse_target(_tilelang.device_target())
    for name, (out_f, in_f) in LINEAR_SHAPES.items():
        x = torch.randn(TOKENS, in_f, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(out_f, in_f, device="cuda", dtype=torch.bfloat16)
        dy = torch.randn(TOKENS, out_f, device="cuda", dtype=torch.bfloat16)
        operands = {"fwd": (x, w, torch.empty(TOKENS, out_f, device="cuda", dtype=torch.bfloat16)),
                    "dgrad": (dy, w, torch.empty_like(x)), "wgrad": (dy, x, torch.empty_like(w))}
        for kind, args in operands.items():
            funcs = [linear.gemm_kernel(kind, out_f, in_f, "bfloat16", c) for c in linear.CANDIDATES]
            kernels = tl.par_compile(funcs, target=target, ignore_error=True)
            timed = [(bench(lambda k=kernel, a=args: k(*a)), config) for config, kernel in zip(linear.CANDIDATES, kernels)
                     if kernel is not None]
            print(f"    # {kind} {name}: " + ", ".join(f"{c}={ms:.3f}" for ms, c in sorted(timed)), flush=True)
            best_ms, best = min(timed)
            linear.TUNED[(arch, kind, out_f, in_f, "bfloat16")] = best
            print(f"    ({arch!r}, {kind!r}, {out_f}, {in_f}, 'bfloat16'): {best},  # {best_ms:.3f} ms ({name})",
                  flush=True)


def quant_cases():
    """(case, {variant: callable}): NF4 (double-quantized) dequantization of each Llama-3-8B weight, PyTorch
    (tiletune.quant, the reference) against bitsandbytes' CUDA kernel (when installed) and the TileLang kernel;
    then the QLoRA Linear forward + backward (r8) against the same layer with a bf16 weight (lora_linear)."""
    from importlib.util import find_spec

    from tiletune.kernels import lora_linear, quant_linear, quant_lora_linear
    from tiletune.quant import dequantize, quantize, to_bnb

    for name, (out_f, in_f) in LINEAR_SHAPES.items():
        w = (torch.randn(out_f, in_f, device="cuda") / in_f**0.5).to(torch.bfloat16)
        q = quantize(w, "nf4")
        args = quant_linear.weight_args(q)
        variants = {"eager": forward_only(lambda q=q: dequantize(q)),
                    "tilelang": forward_only(lambda args=args: quant_linear.tilelang_weight(*args, dtype=torch.bfloat16))}
        if find_spec("bitsandbytes"):
            import bitsandbytes.functional as bnbf
            from bitsandbytes.functional import QuantState

            tensors = to_bnb(q, "w")
            state = QuantState.from_dict({k[2:]: v for k, v in tensors.items() if k != "w"}, device="cuda")
            variants["bnb"] = forward_only(lambda packed=tensors["w"], state=state: bnbf.dequantize_4bit(packed, state))
        yield f"dequantize nf4 {name}", variants

        x = torch.randn(TOKENS, in_f, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        a = (torch.randn(8, in_f, device="cuda") / in_f**0.5).requires_grad_()
        b = (torch.randn(out_f, 8, device="cuda") / 8**0.5).requires_grad_()
        dy = torch.randn(TOKENS, out_f, device="cuda", dtype=torch.bfloat16)
        layers = {"eager": lambda x, q=q, a=a, b=b: quant_lora_linear.quant_lora_linear(x, q, None, a, b, 2.0),
                  "tilelang": lambda x, q=q, a=a, b=b: quant_lora_linear.quant_lora_linear(x, q, None, a, b, 2.0, "tilelang", True),
                  "bf16": lambda x, w=w, a=a, b=b: lora_linear.lora_linear(x, w, None, a, b, 2.0, "tilelang", True)}
        yield f"qlora fwd+bwd {name}", {v: fwd_bwd(lambda f=f, x=x: f(x), (x, a, b), dy) for v, f in layers.items()}


MOE_SHAPES = {"qwen3-30b-a3b": {"experts": 128, "k": 8, "hidden": 2048, "inter": 768},  # the routed experts
              "mixtral-8x7b": {"experts": 8, "k": 2, "hidden": 4096, "inter": 14336}}
MOE_SHAPE = MOE_SHAPES["qwen3-30b-a3b"]  # --moe-shape
MOE_VARIANTS: list[str] | None = None  # --moe-variants: the grouped GEMM configs swept (default: the arch's candidates)


def moe_candidates() -> list[str]:
    """The grouped GEMM configs to sweep on this GPU, the default first."""
    from tiletune.kernels import _tilelang, moe_experts

    family = moe_experts.arch_family(_tilelang.device_arch())
    names = MOE_VARIANTS or moe_experts.CANDIDATES[family]
    default = moe_experts.DEFAULT_CONFIG[family]
    return sorted(names, key=lambda name: name != default)


def moe_cases():
    """(case, {variant: callable}): MOE_SHAPE's experts (--moe-shape; default Qwen3-30B-A3B's: 128 experts, top 8,
    hidden 2048, intermediate 768) at 8192 tokens. Each of the four grouped GEMMs (forward gate_up and down `nt`, their input gradients `nn`) against
    a dense cuBLAS GEMM over the same rows (the issue's bar: >= 70% of its TFLOP/s; ratio = dense time / grouped
    time = the fraction of the dense rate) and torch's grouped_mm (transformers' default path), the TileLang
    grouped GEMM once per config swept (`tl:<name>`, moe_experts.CANDIDATES); then the whole experts forward +
    backward: the eager per-expert loop, grouped_mm, TileLang per config. `moe_summary` ranks the configs."""
    from tiletune.kernels import moe_experts

    experts, k, hidden, inter = MOE_SHAPE["experts"], MOE_SHAPE["k"], MOE_SHAPE["hidden"], MOE_SHAPE["inter"]
    scores = torch.rand(TOKENS, experts, device="cuda")
    weights, index = scores.topk(k, dim=-1)
    weights = torch.softmax(weights, dim=-1).to(torch.bfloat16).requires_grad_()
    x = torch.randn(TOKENS, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    gate_up = (torch.randn(experts, 2 * inter, hidden, device="cuda") / hidden**0.5).to(torch.bfloat16)
    down = (torch.randn(experts, hidden, inter, device="cuda") / inter**0.5).to(torch.bfloat16)
    names = moe_candidates()
    configs = {name: moe_experts.VARIANTS[name] for name in names}
    routings = {bm: moe_experts.route(index, experts, bm, moe_experts.BLOCK_M) for bm in {c.block_m for c in configs.values()}}
    base = moe_experts.route(index, experts)

    grouped_mm = moe_experts.vendor_gemm  # the op's grouped_mm implementation's GEMMs

    # (case, kind, weights, reduction, output columns, gathered): the two GEMMs whose rows the op gathers from the
    # tokens also as it runs them (grouped_mm: gathered into a copy first, in the time; TileLang: in its tile loads)
    gemms = [("gate_up fwd", "nt", gate_up, hidden, 2 * inter, False), ("gate_up fwd gathered", "nt", gate_up, hidden, 2 * inter, True),
             ("down fwd", "nt", down, inter, hidden, False), ("down dgrad", "nn", down, hidden, inter, False),
             ("down dgrad gathered", "nn", down, hidden, inter, True), ("gate_up dgrad", "nn", gate_up, 2 * inter, hidden, False)]
    fits = {name: c for name, c in configs.items()
            if all(d % c.block_n == 0 and d % c.block_k == 0 for d in (hidden, inter, 2 * inter))}
    for name in sorted(set(configs) - set(fits)):
        print(f"moe: {name} left out: its tile does not divide the expert shapes", flush=True)
    for key in moe_experts.compile_all(fits.values(), experts, hidden, inter, "bfloat16", x.device):
        print(f"moe: {key} did not compile", flush=True)
    for case, kind, w, reduction, cols, gathered in gemms:
        rows = torch.randn(TOKENS * k, reduction, device="cuda", dtype=torch.bfloat16)
        source = torch.randn(TOKENS, reduction, device="cuda", dtype=torch.bfloat16) if gathered else rows
        dense = torch.randn(reduction, cols, device="cuda", dtype=torch.bfloat16)
        variants = {"cublas": forward_only(lambda rows=rows, dense=dense: rows @ dense),
                    "grouped_mm": forward_only(lambda x=source, w=w, kind=kind, g=gathered: grouped_mm(kind, x, w, base, g))}
        for name, config in fits.items():
            gemm = moe_experts.grouped_gemm(config, fuse_gather=True)
            variants[f"tl:{name}"] = forward_only(lambda gemm=gemm, x=source, w=w, kind=kind, r=routings[config.block_m],
                                                  g=gathered: gemm(kind, x, w, r, g))
        yield f"moe {case} grouped", variants
    dy = torch.randn(TOKENS, hidden, device="cuda", dtype=torch.bfloat16)

    def whole(gemm, block_m=moe_experts.BLOCK_M, glue=moe_experts.REFERENCE_GLUE):
        def run():
            _, *kept = moe_experts._experts_forward(gemm, x, index, weights, gate_up, down, block_m, glue)
            moe_experts._experts_backward(gemm, dy, *kept, weights, gate_up, down, glue)
        return run

    # the TileLang rows as the op runs them (the packed activation and merge kernels); grouped_mm with PyTorch's glue,
    # with the packed activation kernels alone (the reference merge) and with both kernels (the op's default), which
    # separates the GEMMs' share from the activation's and the merge's
    activation_only = dataclasses.replace(moe_experts.TILELANG_GLUE, merge=moe_experts.REFERENCE_GLUE.merge)
    impls = {"eager": whole(moe_experts._loop_gemm), "grouped_mm": whole(grouped_mm),
             "grouped_mm+tl_act": whole(grouped_mm, glue=activation_only),
             "grouped_mm+tl_glue": whole(grouped_mm, glue=moe_experts.TILELANG_GLUE)}
    impls.update({f"tl:{name}": whole(moe_experts.grouped_gemm(c), c.block_m, glue=moe_experts.TILELANG_GLUE)
                  for name, c in fits.items()})
    # the gather_fused implementation (grouped_mm's GEMMs, TileLang's where the rows are gathered) per config
    impls.update({f"gather_fused:{name}": whole(moe_experts.gather_fused_gemm(c), c.block_m, glue=moe_experts.TILELANG_GLUE)
                  for name, c in fits.items()})
    yield "moe experts fwd+bwd", impls


def moe_summary(rows: list[dict]) -> dict:
    """Print each TileLang config's % of the dense TFLOP/s per grouped GEMM and its speed against grouped_mm,
    rank the configs by the summed device time of the four GEMMs as the op runs them (the gathered cases where they
    are timed) and by the whole experts forward + backward, print the gather_fused implementation's forward +
    backward per config, and the moe_experts.TUNED entry of the fastest. Returns the ranking for the JSON."""
    from tiletune.kernels import _tilelang, moe_experts

    gemm_cases = [r for r in rows if r["case"].startswith("moe ") and r["case"].endswith(" grouped")]
    if not gemm_cases:
        return {}
    time = {(r["case"], r["variant"]): r["gpu_median_ms"] for r in rows if r["case"].startswith("moe ")}
    cases = list(dict.fromkeys(r["case"] for r in gemm_cases))
    names = list(dict.fromkeys(r["variant"] for r in gemm_cases if r["variant"].startswith("tl:")))
    shape = MOE_SHAPE
    print(f"\nmoe grouped GEMMs ({shape['experts']} experts of {shape['hidden']} x {shape['inter']}, {TOKENS} tokens x "
          f"top-{shape['k']}; gpu ms, % of dense cuBLAS TFLOP/s over the same rows, x = grouped_mm time / this)")
    print(f"{'config':20s} " + " ".join(f"{c.removeprefix('moe ').removesuffix(' grouped'):>24s}" for c in cases)
          + f" {'sum ms':>8s} {'fwd+bwd ms':>10s}")
    ranking = {}
    as_run = [c for c in cases if c.replace(" grouped", " gathered grouped") not in cases]
    for name in ["grouped_mm", *names]:
        cells, total = [], 0.0
        for c in cases:
            ms = time[(c, name)]
            total += ms if c in as_run else 0.0
            cells.append(f"{ms:6.3f} {100 * time[(c, 'cublas')] / ms:5.1f}% x{time[(c, 'grouped_mm')] / ms:4.2f}")
        whole = time.get(("moe experts fwd+bwd", name), float("nan"))
        print(f"{name:20s} " + " ".join(f"{cell:>24s}" for cell in cells) + f" {total:8.3f} {whole:10.3f}")
        ranking[name] = {"gemm_sum_ms": total, "fwd_bwd_ms": whole,
                         "pct_of_dense": {c: 100 * time[(c, "cublas")] / time[(c, name)] for c in cases}}
    for name in names:
        fused = time.get(("moe experts fwd+bwd", name.replace("tl:", "gather_fused:")), float("nan"))
        print(f"gather_fused with {name.removeprefix('tl:')}: experts fwd+bwd {fused:.3f} ms")
        ranking[name]["gather_fused_fwd_bwd_ms"] = fused
    if not names:
        return ranking
    key = (lambda n: ranking[n]["fwd_bwd_ms"]) if all(ranking[n]["fwd_bwd_ms"] == ranking[n]["fwd_bwd_ms"] for n in names) \
        else (lambda n: ranking[n]["gemm_sum_ms"])
    best = min(names, key=key).removeprefix("tl:")
    arch = _tilelang.device_arch()
    default = moe_experts.DEFAULT_CONFIG[moe_experts.arch_family(arch)]
    gate_up_pct = ranking[f"tl:{best}"]["pct_of_dense"].get("moe gate_up fwd grouped", float("nan"))
    print(f"fastest config: {best} (default {default}); gate_up fwd at {gate_up_pct:.0f}% of dense (bar: 70%). "
          f"After the GPU tests pass (pytest -m gpu tests/kernels/test_moe_experts.py), moe_experts.TUNED:\n"
          f"    ({arch!r}, {MOE_SHAPE['experts']}, {MOE_SHAPE['hidden']}, {MOE_SHAPE['inter']}, 'bfloat16'): {best!r},")
    return {"best": best, "default": default, "configs": ranking}


LORA_RANK_SHAPES = {"llama3-8b q_proj": (4096, 4096), "qwen3-30b-a3b q_proj": (4096, 2048),
                    "qwen3-30b-a3b v_proj": (512, 2048)}  # (out, in)


def _split_k(left_t: torch.Tensor, right: torch.Tensor, splits: int = 8) -> torch.Tensor:
    """left_tᵀ right, its 8,192-token reduction cut into `splits` batched GEMMs summed in float32: a skinny output
    ([rank, in] or [out, rank]) gets `splits` times the thread blocks."""
    m = left_t.shape[0]
    parts = torch.bmm(left_t.view(splits, m // splits, -1).transpose(1, 2), right.view(splits, m // splits, -1),
                      out_dtype=torch.float32)
    return parts.sum(0).to(left_t.dtype)


def lora_rank_cases():
    """(case, {variant: callable}) for lora_linear's four rank-r GEMMs at 8,192 tokens, rank 8 padded to 16, as the op
    runs them (`cublas`: x Aᵀ, dY (s·B), gᵀ x, dYᵀ xa by torch.matmul) and reformulated (the product transposed, the
    reduction split): the candidates for the skinny GEMMs the MoE step's profile shows at 86 us a call (H100)."""
    for name, (out_f, in_f) in LORA_RANK_SHAPES.items():
        x = torch.randn(TOKENS, in_f, device="cuda", dtype=torch.bfloat16)
        dy = torch.randn(TOKENS, out_f, device="cuda", dtype=torch.bfloat16)
        a = torch.randn(16, in_f, device="cuda", dtype=torch.bfloat16)
        bs = torch.randn(out_f, 16, device="cuda", dtype=torch.bfloat16)
        g, xa = dy @ bs, x @ a.t()
        yield f"lora xA {name}", {"cublas": forward_only(lambda x=x, a=a: x @ a.t()),
                                  "transposed": forward_only(lambda x=x, a=a: (a @ x.t()).t())}
        yield f"lora dY(sB) {name}", {"cublas": forward_only(lambda dy=dy, bs=bs: dy @ bs),
                                      "transposed": forward_only(lambda dy=dy, bs=bs: (bs.t() @ dy.t()).t())}
        yield f"lora dA {name}", {"cublas": forward_only(lambda g=g, x=x: g[:, :8].t() @ x),
                                  "transposed": forward_only(lambda g=g, x=x: (x.t() @ g[:, :8]).t()),
                                  "splitk": forward_only(lambda g=g, x=x: _split_k(g[:, :8], x))}
        yield f"lora dB {name}", {"cublas": forward_only(lambda dy=dy, xa=xa: dy.t() @ xa[:, :8]),
                                  "transposed": forward_only(lambda dy=dy, xa=xa: (xa[:, :8].t() @ dy).t()),
                                  "splitk": forward_only(lambda dy=dy, xa=xa: _split_k(dy, xa[:, :8]))}


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return os.environ.get("TILETUNE_COMMIT", "unknown")


GROUPS = {"elementwise": elementwise_cases, "host": functools.partial(elementwise_cases, 8), "linear": linear_cases,
          "attention": attention_cases, "quant": quant_cases,
          "moe": moe_cases, "lora_rank": lora_rank_cases}
BASELINES = ("eager", "cublas", "flash")  # the baseline of a case: the first of these among its variants


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tune", action="store_true", help="autotune linear tile configs per shape first")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--only", choices=list(GROUPS), help="run one group")
    parser.add_argument("--moe-variants", help="comma-separated grouped GEMM configs to sweep (moe_experts.VARIANTS; "
                                               "default: the GPU's moe_experts.CANDIDATES)")
    parser.add_argument("--moe-shape", choices=list(MOE_SHAPES), default="qwen3-30b-a3b",
                        help="the experts shape `--only moe` times (default: qwen3-30b-a3b)")
    parser.add_argument("--profile", action="store_true",
                        help="after timing, profile each variant once: device ms per kernel category (profile_<gpu>.md)")
    args = parser.parse_args()
    global MOE_VARIANTS, MOE_SHAPE
    MOE_VARIANTS = args.moe_variants.split(",") if args.moe_variants else None
    MOE_SHAPE = MOE_SHAPES[args.moe_shape]
    if not torch.cuda.is_available():
        sys.exit("benchmarks/kernel_bench.py needs a GPU")
    if args.tune:
        print("tuned linear configs (paste into linear.TUNED):")
        tune_linear()
    rows, profiles = [], []
    for group, cases in GROUPS.items():
        if args.only and args.only != group:
            continue
        for case, variants in cases():
            times = {(v, how): [] for v in variants for how in ("gpu", "launch")}
            for fn in variants.values():
                fn()  # compile and warm up outside the timed rounds
            for _ in range(args.rounds):
                for v, fn in variants.items():
                    times[(v, "gpu")].append(bench_graph(fn))
                    times[(v, "launch")].append(bench(fn))
            base = next(b for b in BASELINES if b in variants)
            for v in variants:
                row = {"case": case, "variant": v}
                for how in ("gpu", "launch"):
                    ts = times[(v, how)]
                    med = statistics.median(ts)
                    row.update({f"{how}_median_ms": med, f"{how}_min_ms": min(ts), f"{how}_max_ms": max(ts),
                                f"{how}_vs_{base}": statistics.median(times[(base, how)]) / med,
                                f"{how}_vs_cudnn": statistics.median(times[("cudnn", how)]) / med if "cudnn" in variants else None,
                                f"{how}_vs_liger": statistics.median(times[("liger", how)]) / med if "liger" in variants else None})
                rows.append(row)
            if args.profile:
                profiles.append(f"## {case}\n\n" + profile_table({v: profile_step(fn) for v, fn in variants.items()}))
            print(f"done {case}", flush=True)
    geo = {}
    for kind in ("fwd", "fwd+bwd"):
        for how in ("gpu", "launch"):
            ratios = [r[f"{how}_vs_cublas"] for r in rows if r["variant"] == "tilelang" and r["case"].startswith(f"linear {kind} ")]
            if ratios:
                geo[f"linear {kind} {how} geomean vs cublas"] = math.exp(sum(map(math.log, ratios)) / len(ratios))
    moe = moe_summary(rows)
    meta = {"gpu": torch.cuda.get_device_name(), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "commit": git_commit(), "torch": torch.__version__, "tokens": TOKENS, "dtype": "bfloat16",
            "rounds": args.rounds, "tuned": args.tune}
    os.makedirs(args.out, exist_ok=True)
    gpu_name = meta["gpu"].replace(" ", "_").lower()
    stem = os.path.join(args.out, "kernels_" + gpu_name)
    with open(stem + ".json", "w") as f:
        json.dump({"meta": meta, "rows": rows, "geomean": geo, "moe": moe}, f, indent=1)
    if profiles:
        with open(os.path.join(args.out, f"profile_{gpu_name}.md"), "w") as f:
            f.write("\n\n".join(profiles) + "\n")
        print("\n\n".join(profiles))
    with open(stem + ".csv", "w", newline="") as f:
        fields = list(dict.fromkeys(k for r in rows for k in r))
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)
    print(f"\n{meta['gpu']}  {meta['date']}  commit {meta['commit'][:10]}  (median of {args.rounds} rounds, ms; "
          "ratio = baseline / variant)")
    print(f"{'case':30s} {'variant':20s} {'gpu':>7s} {'min':>7s} {'max':>7s} {'vs base':>7s} {'vs other':>8s}"
          f" | {'launch':>7s} {'vs base':>7s} {'vs other':>8s}")
    print("(base: eager, cuBLAS or SDPA flash; other: Liger, or SDPA cuDNN for attention)")
    for r in rows:
        cells = []
        for how in ("gpu", "launch"):
            base = next(r[f"{how}_vs_{b}"] for b in BASELINES if r.get(f"{how}_vs_{b}"))
            liger = r[f"{how}_vs_liger"] or r.get(f"{how}_vs_cudnn")
            cells.append((r[f"{how}_median_ms"], r[f"{how}_min_ms"], r[f"{how}_max_ms"], base,
                          f"{liger:8.2f}" if liger else " " * 8))
        g, la = cells
        print(f"{r['case']:30s} {r['variant']:20s} {g[0]:7.3f} {g[1]:7.3f} {g[2]:7.3f} {g[3]:7.2f} {g[4]}"
              f" | {la[0]:7.3f} {la[3]:7.2f} {la[4]}")
    for k, v in geo.items():
        print(f"{k}: {v:.3f}")


if __name__ == "__main__":
    main()
