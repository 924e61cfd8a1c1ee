"""MoE experts: the routed tokens through their experts' gated MLPs, as transformers 5's fused experts compute it.

Semantics (the reference): for each token t and each of its k routes (expert e = top_k_index[t, j], weight
w = top_k_weights[t, j]): ``y[t] += w · (silu(g) * u) · down[e]ᵀ`` with ``[g, u] = x[t] · gate_up[e]ᵀ``;
``gate_up`` is [experts, 2·intermediate, hidden] (gate rows first), ``down`` [experts, hidden, intermediate]
(Qwen3-MoE, Mixtral, Llama-4's routed experts). Gradients for the hidden states and the routing weights
(the router trains through them); the experts' weights are frozen (a site whose expert weights train is reported
and left alone).

LoRA on the expert weights (peft's `target_parameters`, tiletune's `lora_target_experts`): peft's ParamWrapper
folds ``W + s·B·A`` into a merged copy of the whole expert stack on every forward (a parametrization), which the
stock experts then read. The op's LoRA form (`moe_experts_lora`) never forms that copy: per expert group,
``[g, u] = x·W_eᵀ + s·(x·A_eᵀ)·B_eᵀ`` and ``o = a·D_eᵀ + s·(a·A'_eᵀ)·B'_eᵀ``, the base parts through the same
grouped GEMMs, the rank-r parts (and the gradients of A and B) through torch's grouped GEMM over the expert groups
where it runs in one kernel without a host sync (bf16 on sm_90/sm_100; the TileLang impl), else one small PyTorch
GEMM per expert; beyond the plain op it keeps only the [rows, r] products x·Aᵀ and a·A'ᵀ for the backward.

How it runs: the k·tokens routes are sorted by expert (`Routing`: one sort, no host sync), and each expert's
block of rows meets its weights in a grouped GEMM, which reads the rows of the gate_up forward (the hidden states)
and of the down projection's input gradient (dy) through the routing's token index: from a copy gathered first
(`index_select`), or, in the `gather_fused` impl, by TileLang's grouped GEMM in its tile loads. One kernel launch
for all experts, each thread block owning a tile of one expert's rows (the tile schedule, an upper bound of
ceil(rows / block_m) + experts tiles, is built on the device; surplus tiles exit at once). The grouped GEMM's tile
shape and scheduling (rows per tile, warp split, rasterised or persistent grid, staged store) is a `GroupedConfig`
row of `VARIANTS`, chosen per architecture and shape (`config_for`: TUNED from a GPU sweep, else DEFAULT_CONFIG;
benchmarks/kernel_bench.py --only moe sweeps CANDIDATES); one kernel source takes them all. Forward: two grouped
GEMMs (gate_up, down) with the activation between them; backward: two grouped GEMMs for the input gradient
(``nn``: the weights untransposed) and the activation's derivative (the routing weight applied there, in float32).
The row-wise kernels around the GEMMs are a `Glue` record: PyTorch in the reference; in the TileLang and
grouped_mm impls swiglu's packed TileLang kernels for the activation (the gate and up halves of a row read in
place, float32 inside, one rounding) and a TileLang merge kernel. The k outputs of a token are merged without
atomics, weighted by its routing weights and summed (the hidden states' gradient likewise, unweighted), in float32
with one rounding, the same bits on every run: the merge kernel reads each token's k expert rows where they lie; the
reference gathers them in chunks and sums them by a batched GEMM. The forward keeps only the [rows, 2·intermediate]
gate_up rows for the backward (Qwen3-30B-A3B at 8,192 tokens: 192 MiB per layer), not the [rows, hidden] expert
outputs (256 MiB) the routing weights' gradient reads: that gradient is dy·(a·Dᵀ) = (dy·D)·a, the down projection's
input gradient (which the backward computes anyway, before the routing weight enters) dotted with the activation a,
summed in float32 by the activation's backward kernel in the same pass. A selective layer keeps the gate_up rows
too, so its backward runs no grouped GEMM of the forward again. A checkpointed layer's recomputation (in the
backward) needs of the op only what its backward reads, the routing and the gate_up rows: where the experts' output
only joins the residual sum (`Experts.output_kept` False: every MoE family so far), the op then runs neither the
activation, the down GEMM nor the merge, a third of the forward's GEMM work, and returns NaN (read by nothing; a read
by mistake would show in the gradients). The LoRA form computes its output in full.

The reference runs the same steps with one PyTorch GEMM per expert (the "eager" loop), in the input dtype
with float32 accumulation; the TileLang version's GEMMs accumulate in float32 and round once.
"""

# No `from __future__ import annotations` here: TileLang reads the kernel signature's shapes from the closure.

import functools
import inspect
import itertools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tiletune.kernels import _tilelang, registry, swiglu
from tiletune.kernels.binding import Binding, Site
from tiletune.kernels.customop import Signature, make_custom_op
from tiletune.kernels.registry import Impl, Op, add, define, note_fallback

# Rows of one expert per tile of the schedule's bound: small, as experts see few rows each (Qwen3-30B-A3B: 512 on
# average). The smallest block_m of any GroupedConfig: the tiles tensor is sized by it whatever the config, so its
# shape (the custom op's fake) does not depend on the config; a larger block_m leaves the surplus slots empty (-1).
BLOCK_M = 64


@dataclass(frozen=True)
class Routing:
    """The routes of a batch sorted by expert.

    token: [rows] the token each sorted row reads; order: [rows] the flat (token, k) index of each sorted row;
    tiles: [max_tiles, 3] int32 (expert or -1, first row, end of the expert's rows) for the grouped GEMMs;
    offsets: [experts + 1] int32, where each expert's rows start (the reference's loop bounds).
    """

    token: Tensor
    order: Tensor
    tiles: Tensor
    offsets: Tensor


def route(top_k_index: Tensor, experts: int, block_m: int = BLOCK_M, slots_block_m: int | None = None,
          tiles: bool = True) -> Routing:
    """Sort the routes by expert and lay out the grouped GEMMs' tiles of `block_m` rows, all on the device (no host
    sync): the active tiles first, then empty ones (-1) up to the bound for tiles of `slots_block_m` (default
    block_m) rows, ceil(rows / slots_block_m) + experts. Without `tiles` (for GEMMs that read the offsets alone:
    torch's grouped GEMM) the tile schedule keeps its shape, for the custom op's schema, but is left unset: 20 fewer
    kernel launches per call."""
    k = top_k_index.shape[-1]
    flat = top_k_index.reshape(-1)
    _, order = torch.sort(flat, stable=True)
    counts = torch.zeros(experts, dtype=torch.int32, device=flat.device).index_add_(
        0, flat, torch.ones_like(flat, dtype=torch.int32))
    ends = torch.cumsum(counts, 0, dtype=torch.int32)
    starts = ends - counts
    slots = block_m if slots_block_m is None else slots_block_m
    assert slots <= block_m, f"tiles of {block_m} rows need the bound of at least that many, not {slots}"
    max_tiles = (flat.numel() + slots - 1) // slots + experts
    offsets = torch.cat([starts, ends[-1:]])
    if not tiles:
        return Routing(order // k, order, torch.empty(max_tiles, 3, dtype=torch.int32, device=flat.device), offsets)
    tiles_per_expert = (counts + block_m - 1) // block_m
    tile_ends = torch.cumsum(tiles_per_expert, 0, dtype=torch.int32)
    index = torch.arange(max_tiles, dtype=torch.int32, device=flat.device)
    expert = torch.searchsorted(tile_ends, index, right=True).to(torch.int32)
    active = expert < experts
    safe = expert.clamp(max=experts - 1).long()
    first = starts[safe] + (index - (tile_ends[safe] - tiles_per_expert[safe])) * block_m
    schedule = torch.stack([torch.where(active, expert, -1), first, ends[safe]], dim=1).to(torch.int32)
    return Routing(order // k, order, schedule.contiguous(), offsets)


_silu_gate = functools.partial(swiglu.reference_packed_forward, swiglu.SILU)  # silu(gate)·up of [gate | up] rows


def _silu_gate_backward(da: Tensor, h: Tensor, row_scale: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """(d[gate, up] of silu(gate)·up for the upstream gradient da times `row_scale` [rows] (if given), in h's dtype;
    [rows]: each row's dot of da (unscaled) with silu(gate)·up), in float32 (float64 for float64)."""
    acc = torch.promote_types(h.dtype, torch.float32)
    gate, up = h.to(acc).chunk(2, dim=-1)
    sig = torch.sigmoid(gate)
    dots = (da.to(acc) * gate * sig * up).sum(-1)
    da = da.to(acc) if row_scale is None else da.to(acc) * row_scale.to(acc)[:, None]
    return torch.cat([da * up * sig * (1 + gate * (1 - sig)), da * gate * sig], dim=-1).to(h.dtype), dots


@dataclass(frozen=True)
class Glue:
    """The experts' row-wise kernels around the grouped GEMMs: the activation on [rows, 2·intermediate] gate_up
    rows ([gate | up]), silu(gate)·up, and its derivative for an upstream gradient with an optional per-row scale
    (the routing weight), with each row's dot of the unscaled upstream gradient and the activation; and the merge of
    each token's k expert rows into its output row, weighted by its routing weights if given."""

    activation: Callable[[Tensor], Tensor]
    activation_backward: Callable[..., tuple[Tensor, Tensor]]  # (da, h, row_scale=None) -> (d h, [rows] float32 dots)
    merge: Callable[..., Tensor]  # (rows, order, like, top_k_weights=None) -> [tokens, hidden] in like's dtype


def _positions(order: Tensor) -> Tensor:
    """The inverse permutation of `order`: where route i of the flat top-k index sits among the rows sorted by
    expert."""
    position = torch.empty_like(order)
    position[order] = torch.arange(order.numel(), device=order.device)
    return position


def _by_route(rows: Tensor, order: Tensor) -> Tensor:
    """Rows sorted by expert put back in (token, k) order: row i of the result is route i of the flat top-k index.
    A gather through the inverse permutation (`index_select`, vectorized rows), not a scatter by `order`
    (`index_copy_`, element by element: 0.42 ms a call in the 8-layer step's profile on an H100, against 0.17 ms
    for `index_select`'s gathers of as many rows; benchmarks/results/h100-2026-12-06/moe-act)."""
    return rows.index_select(0, _positions(order))


MERGE_CHUNK_BYTES = 2**26  # the routes gathered at a time when merging each token's k routes: 64 MiB


def _merge_routes(rows: Tensor, order: Tensor, like: Tensor, top_k_weights: Tensor | None = None) -> Tensor:
    """[tokens, hidden] in like's dtype: each token's k route rows (`rows` sorted by expert) summed, weighted by its
    routing weights if given (rounded to the rows' dtype; one batched GEMM per chunk), float32 accumulation, one
    rounding, no atomics (deterministic). The routes are gathered `MERGE_CHUNK_BYTES` at a time, so no [routes,
    hidden] copy is ever whole: 256 MiB spared at the peak of Qwen3-30B-A3B's experts at 8,192 tokens."""
    tokens, width = like.shape[0], rows.shape[-1]
    k = order.numel() // max(tokens, 1)
    position = _positions(order).view(tokens, k)
    out = torch.empty_like(like)
    chunk = max(1, MERGE_CHUNK_BYTES // max(1, k * width * rows.element_size()))
    for start in range(0, tokens, chunk):
        routes = rows.index_select(0, position[start : start + chunk].reshape(-1)).view(-1, k, width)
        if top_k_weights is None:
            out[start : start + chunk] = routes.sum(1)
        else:
            out[start : start + chunk] = torch.bmm(top_k_weights[start : start + chunk, None].to(rows.dtype), routes)[:, 0]
    return out


REFERENCE_GLUE = Glue(_silu_gate, _silu_gate_backward, _merge_routes)


def _routing_weights_grad(dots: Tensor, order: Tensor, top_k_weights: Tensor) -> Tensor:
    """d top_k_weights [tokens, k] from each sorted row's dot of its token's dy with its expert's output (`dots`,
    float32: the activation backward's), put back in (token, k) order."""
    return _by_route(dots, order).view_as(top_k_weights).to(top_k_weights.dtype)


def _experts_forward(gemm: Callable, hidden: Tensor, top_k_index: Tensor, top_k_weights: Tensor, gate_up: Tensor,
                     down: Tensor, block_m: int = BLOCK_M, glue: Glue = REFERENCE_GLUE,
                     keep_rows: bool = True, output_read: bool = True, tiles: bool = True):  # fmt: skip
    """(y, the gate_up rows, the routing's order, tiles and offsets): the experts' forward with
    `gemm(kind, x, weights, routing, gathered)` on tiles of `block_m` rows (without `tiles`, a `gemm` that reads the
    offsets alone: the schedule is left unset); the backward reuses the routing. Without `keep_rows` the gate_up rows come
    back empty (no rows): the backward computes them again from the hidden states. Without `output_read` (a
    recomputation whose output nothing reads) y is NaN and neither the activation, the down GEMM nor the merge runs:
    the backward needs only the rows and the routing."""
    routing = route(top_k_index, gate_up.shape[0], block_m, BLOCK_M, tiles)
    h = gemm("nt", hidden, gate_up, routing, gathered=True)
    kept = h if keep_rows else h.new_empty(0, h.shape[1])
    if output_read:
        y = glue.merge(gemm("nt", glue.activation(h), down, routing), routing.order, hidden, top_k_weights)
    else:  # NaN, so that a read by mistake shows in the gradients instead of passing on stale memory
        y = torch.full_like(hidden, float("nan"))
    return y, kept, routing.order, routing.tiles, routing.offsets


def _experts_backward(gemm: Callable, dy: Tensor, h: Tensor, order: Tensor, tiles: Tensor, offsets: Tensor,
                      top_k_weights: Tensor, gate_up: Tensor, down: Tensor,
                      glue: Glue = REFERENCE_GLUE, hidden: Tensor | None = None):  # fmt: skip
    """(d hidden, d top_k_weights) from the forward's kept rows and routing; the gate_up rows computed again from
    `hidden` where the forward kept none (one grouped GEMM)."""
    routing = Routing(order // top_k_weights.shape[-1], order, tiles, offsets)
    if hidden is not None:
        h = gemm("nt", hidden, gate_up, routing, gathered=True)
    weights = top_k_weights.reshape(-1)[routing.order]
    # the routing weight enters below, in float32; the unscaled da dotted with the activation is its gradient
    da = gemm("nn", dy.to(h.dtype), down, routing, gathered=True)
    dh, dots = glue.activation_backward(da, h, weights)
    del da  # each [rows, ·] temporary released once read: the backward's peak is the experts' largest
    d_rows = gemm("nn", dh, gate_up, routing)
    del dh
    return glue.merge(d_rows, order, dy), _routing_weights_grad(dots, order, top_k_weights)


# ---- reference: one PyTorch GEMM per expert --------------------------------------------------------------


def _sorted_rows(x: Tensor, routing: Routing, gathered: bool) -> Tensor:
    """The rows a grouped GEMM multiplies: x itself, or (`gathered`) the token of each sorted row of x [tokens, ·],
    gathered into a [rows, ·] copy."""
    return x.index_select(0, routing.token) if gathered else x


def _loop_gemm(kind: str, rows: Tensor, weights: Tensor, routing: Routing | None, gathered: bool = False,
               bounds: list[int] | None = None) -> Tensor:  # fmt: skip
    """Each expert's rows times its weights (ᵀ for ``nt``), in float32 (float64 for float64), rounded once;
    `gathered`: `rows` are the tokens, read through the routing; `bounds`: the routing's offsets on the host, if
    already read (then `routing` is not read)."""
    rows = _sorted_rows(rows, routing, gathered)
    acc = torch.promote_types(rows.dtype, torch.float32)
    out_features = weights.shape[1] if kind == "nt" else weights.shape[2]
    out = rows.new_zeros(rows.shape[0], out_features)
    bounds = routing.offsets.tolist() if bounds is None else bounds
    for expert, (start, end) in enumerate(itertools.pairwise(bounds)):
        if end > start:
            w = weights[expert].to(acc)
            out[start:end] = (rows[start:end].to(acc) @ (w.t() if kind == "nt" else w)).to(out.dtype)
    return out


def reference_forward(hidden, top_k_index, top_k_weights, gate_up, down, keep_rows=True, output_read=True):
    """(y, kept rows and routing) by the expert loop."""
    return _experts_forward(_loop_gemm, hidden, top_k_index, top_k_weights, gate_up, down, keep_rows=keep_rows,
                            output_read=output_read)


def reference_backward(dy, h, order, tiles, offsets, top_k_weights, gate_up, down, hidden=None):
    """(d hidden, d top_k_weights) by the expert loop."""
    return _experts_backward(_loop_gemm, dy, h, order, tiles, offsets, top_k_weights, gate_up, down, hidden=hidden)


# ---- LoRA on the expert weights: the base through `gemm`, the rank-r parts grouped or per expert ------------
#
# The rank-r parts of one projection (A [experts, r, in], B [experts, out, r], scaling s): forward x·A_eᵀ (kept for
# the backward) and (x·A_eᵀ)·B_eᵀ; backward, from dOut: g = s·dOut·B_e, the input's part g·A_e, dA_e = g_eᵀ·x_e and
# dB_e = (s·dOut_e)ᵀ·(x·A_eᵀ)_e. With a row scale w (the routing weights: dOut = w·dOut_u, dOut_u the token's dy),
# the input's part is g_u·A_e for dOut_u and w enters dA and dB through [rows, r] products only: dA_e = (w·g_u)ᵀ·x_e,
# dB_e = (s·dOut_u)ᵀ·(w·x·A_eᵀ). Each product is rounded in the rows' dtype (as peft's LoRA Linear under autocast);
# two ways to run them, the same arithmetic:
#
# - `_GroupedRank`: torch's grouped GEMM (`torch.nn.functional.grouped_mm`, else `torch._grouped_mm`, as
#   transformers 5's grouped_mm experts call it), the groups given by the routing's int32 offsets on the device:
#   the row products in its M-grouped form (rows [R, k] · weights [E, k, n]), dA and dB in its K-grouped form
#   (xᵀ [n, R] · y [R, k] -> [E, n, k]). Run where `grouped_mm_runs`: bf16 on CUDA sm_90 / sm_100, where torch has
#   one CUTLASS kernel per call and reads no offsets on the host. Its operands are laid out as that kernel needs
#   them (`_rows`, `_weights`; the rank padded with zeros to 16 bytes, which changes no product).
# - `_LoopRank`: one PyTorch GEMM per expert after one host read of the offsets, in float32 (float64 for float64),
#   rounded once. Everywhere else: the reference impl, the CPU, float32/float16/float64, other GPUs. torch's own
#   grouped_mm runs this same loop there (aten's fallback reads the offsets on the host too) and takes no float64;
#   a padded batched GEMM would need the largest group's row count on the host as well (or E times the rows).


def _loop_wgrad(x: Tensor, y: Tensor, bounds: list[int], like: Tensor) -> Tensor:
    """[experts, n, k] like `like`: each expert's x_eᵀ·y_e (x [rows, n], y [rows, k] sorted by expert), in float32
    (float64 for float64), in like's dtype (an adapter's gradient)."""
    acc = torch.promote_types(x.dtype, torch.float32)
    out = torch.zeros(like.shape, dtype=acc, device=x.device)
    for expert, (start, end) in enumerate(itertools.pairwise(bounds)):
        if end > start:
            out[expert] = x[start:end].to(acc).t() @ y[start:end].to(acc)
    return out.to(like.dtype)


def _scaled(t: Tensor, row_scale: Tensor | None) -> Tensor:
    """t's rows times `row_scale` [rows] (None: t), in float32 (float64 for float64), rounded to t's dtype."""
    if row_scale is None:
        return t
    acc = torch.promote_types(t.dtype, torch.float32)
    return (t.to(acc) * row_scale.to(acc)[:, None]).to(t.dtype)


class _LoopRank:
    """The rank-r parts per expert: one host read of the offsets, then E small GEMMs per product."""

    def __init__(self, offsets: Tensor):
        self.bounds = offsets.tolist()  # the one host sync

    def forward(self, x: Tensor, a: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
        """(x·A_eᵀ, (x·A_eᵀ)·B_eᵀ) per expert group, each rounded in x's dtype."""
        xa = _loop_gemm("nt", x, a.to(x.dtype), None, bounds=self.bounds)
        return xa, _loop_gemm("nt", xa, b.to(x.dtype), None, bounds=self.bounds)

    def backward(self, d: Tensor, x: Tensor, xa: Tensor, a: Tensor, b: Tensor, s: float,
                 row_scale: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
        """(g·A_e, dA, dB) from dOut `d` (its rows times `row_scale` for dA and dB, not for g·A_e) with g = s·d·B_e;
        dA, dB in the factors' dtypes."""
        g = _loop_gemm("nn", d, b.to(d.dtype), None, bounds=self.bounds) * s
        d_in = _loop_gemm("nn", g, a.to(d.dtype), None, bounds=self.bounds)
        return (d_in, _loop_wgrad(_scaled(g, row_scale), x, self.bounds, a),
                _loop_wgrad(d * s, _scaled(xa, row_scale), self.bounds, b))


def grouped_mm_runs(rows: Tensor, experts: int) -> bool:
    """Whether torch's grouped GEMM runs on `rows`' dtype and device as one kernel reading the offsets on the device:
    bf16 on CUDA sm_90 / sm_100 (its CUTLASS path, up to 1023 groups). Elsewhere aten loops over the groups after
    copying the offsets to the host (float32, float16, other GPUs, the CPU), refuses float64, and on ROCm takes
    another kernel: the per-expert loop there."""
    if getattr(torch.nn.functional, "grouped_mm", None) is None and getattr(torch, "_grouped_mm", None) is None:
        return False
    if rows.dtype != torch.bfloat16 or rows.device.type != "cuda" or torch.version.hip or experts >= 1024:
        return False
    return torch.cuda.get_device_capability(rows.device)[0] in (9, 10)


def _grouped_mm(mat_a: Tensor, mat_b: Tensor, offs: Tensor) -> Tensor:
    """torch.nn.functional.grouped_mm where torch has it, else torch._grouped_mm (transformers 5's order)."""
    fn = getattr(torch.nn.functional, "grouped_mm", None) or torch._grouped_mm
    return fn(mat_a, mat_b, offs=offs)


def _align(t: Tensor) -> int:
    """Elements in 16 bytes: what grouped_mm's strides (and CUTLASS's TMA) must be a multiple of."""
    return 16 // t.element_size()


def _rows(t: Tensor) -> Tensor:
    """`t` row-major with 16-byte aligned start, row stride (and batch stride for 3-D), or copied into such a buffer
    (rows padded past the values, never read): the layout grouped_mm's CUTLASS kernel reads for an M-grouped left
    operand (a column-major one would need every group's row count a multiple of 8) and a K-grouped right one."""
    n = _align(t)
    if (t.stride(-1) == 1 and t.stride(-2) % n == 0 and t.stride(-2) >= max(1, t.shape[-1]) and t.data_ptr() % 16 == 0
            and (t.dim() == 2 or t.stride(0) % n == 0)):
        return t
    k = t.shape[-1]
    return t.new_empty(*t.shape[:-1], -(-k // n) * n)[..., :k].copy_(t)


def _weights(t: Tensor) -> Tensor:
    """A 3-D right operand [E, k, n] as it is if column-major with aligned strides (a transposed [E, n, k] weight),
    else row-major (`_rows`)."""
    n = _align(t)
    if (t.stride(-2) == 1 and t.stride(-1) % n == 0 and t.stride(-1) >= max(1, t.shape[-2]) and t.stride(0) % n == 0
            and t.data_ptr() % 16 == 0):
        return t
    return _rows(t)


def _pad_rank(a: Tensor, b: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """A [E, r, in] and B [E, out, r] in `dtype`, the rank padded with zeros to a multiple of 16 bytes: every rank-r
    GEMM then has aligned sizes, and the zero rows and columns add nothing to any product."""
    a, b = a.to(dtype), b.to(dtype)
    r = a.shape[1]
    pad = -(-r // _align(a)) * _align(a) - r
    if pad:
        a, b = F.pad(a, (0, 0, 0, pad)), F.pad(b, (0, pad))
    return a, b


class _GroupedRank:
    """The rank-r parts through torch's grouped GEMM over the expert groups: no host sync, one launch per product."""

    def __init__(self, offsets: Tensor):
        self.ends = offsets[1:]  # grouped_mm's offs: int32, where each group ends
        self.nonempty = offsets[1:] > offsets[:-1]

    def _mm(self, x: Tensor, w: Tensor) -> Tensor:
        """x [rows, k] times the group's w [E, k, n] (M-grouped)."""
        return _grouped_mm(_rows(x), _weights(w), self.ends)

    def _wgrad(self, x: Tensor, y: Tensor) -> Tensor:
        """[E, n, k]: each group's x_eᵀ·y_e (K-grouped: xᵀ column-major, y row-major, the one layout pair whose
        kernel takes groups of no rows); an expert without rows gets zeros whatever the kernel leaves there."""
        out = _grouped_mm(_rows(x).t(), _rows(y), self.ends)
        return torch.where(self.nonempty[:, None, None], out, 0)

    def forward(self, x: Tensor, a: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
        rank = a.shape[1]
        if rank == 0 or x.shape[0] == 0:
            return x.new_zeros(x.shape[0], rank), x.new_zeros(x.shape[0], b.shape[1])
        a, b = _pad_rank(a, b, x.dtype)
        xa = self._mm(x, a.transpose(-2, -1))  # [rows, padded rank], zero past the rank
        return xa[:, :rank].contiguous(), self._mm(xa, b.transpose(-2, -1))

    def backward(self, d: Tensor, x: Tensor, xa: Tensor, a: Tensor, b: Tensor, s: float,
                 row_scale: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
        rank = a.shape[1]
        if rank == 0 or d.shape[0] == 0:
            return d.new_zeros(d.shape[0], a.shape[2]), torch.zeros_like(a), torch.zeros_like(b)
        ap, bp = _pad_rank(a, b, d.dtype)
        g = self._mm(d, bp) * s  # [rows, padded rank]
        d_in = self._mm(g, ap)
        d_a = self._wgrad(_scaled(g, row_scale), x)[:, :rank]
        xa = _scaled(xa.to(d.dtype), row_scale)
        if ap.shape[1] > rank:
            xa = F.pad(xa, (0, ap.shape[1] - rank))
        d_b = self._wgrad(d * s, xa)[..., :rank]
        return d_in, d_a.to(a.dtype).contiguous(), d_b.to(b.dtype).contiguous()


def _rank_gemms(offsets: Tensor, grouped: bool) -> "_LoopRank | _GroupedRank":
    return _GroupedRank(offsets) if grouped else _LoopRank(offsets)


def _lora_experts_forward(gemm: Callable, hidden: Tensor, top_k_index: Tensor, top_k_weights: Tensor, gate_up: Tensor,
                          down: Tensor, gate_up_a: Tensor, gate_up_b: Tensor, down_a: Tensor, down_b: Tensor,
                          gate_up_scaling: float, down_scaling: float, block_m: int = BLOCK_M,
                          grouped: bool = False, glue: Glue = REFERENCE_GLUE,
                          tiles: bool = True):  # fmt: skip
    """(y, the gate_up rows, x·Aᵀ, a·A'ᵀ, the routing's order, tiles and offsets) with LoRA on both
    projections: A [experts, r, in], B [experts, out, r] (rank 0: no adapter there). The base GEMMs by `gemm`, the
    rank-r ones over the expert groups (`grouped`: torch's grouped GEMM, else per expert) in the rows' dtype (as
    peft's LoRA Linear under autocast), each rounded, then added; `tiles` as in `_experts_forward`."""
    routing = route(top_k_index, gate_up.shape[0], block_m, BLOCK_M, tiles)
    rank = _rank_gemms(routing.offsets, grouped)
    rows = hidden.index_select(0, routing.token)
    xa, up = rank.forward(rows, gate_up_a, gate_up_b)
    h = gemm("nt", rows, gate_up, routing) + up * gate_up_scaling
    a = glue.activation(h)
    aa, lora_o = rank.forward(a, down_a, down_b)
    del rows, up
    o = gemm("nt", a, down, routing) + lora_o * down_scaling
    del a, lora_o
    return glue.merge(o, routing.order, hidden, top_k_weights), h, xa, aa, routing.order, routing.tiles, routing.offsets


def _lora_experts_backward(gemm: Callable, dy: Tensor, hidden: Tensor, h: Tensor, xa: Tensor, aa: Tensor,
                           order: Tensor, tiles: Tensor, offsets: Tensor, top_k_weights: Tensor, gate_up: Tensor,
                           down: Tensor, gate_up_a: Tensor, gate_up_b: Tensor, down_a: Tensor, down_b: Tensor,
                           gate_up_scaling: float, down_scaling: float, grouped: bool = False,
                           glue: Glue = REFERENCE_GLUE):  # fmt: skip
    """(d hidden, d top_k_weights, d gate_up A, d gate_up B, d down A, d down B): with g = s·dOut·B,
    dIn = dOut·W + g·A, dA = gᵀ·In, dB = s·dOutᵀ·(In·Aᵀ) per expert; the activation recomputed from h. The down
    projection's rows are the token's dy unscaled, as the plain op's: the routing weight enters the activation's
    derivative and the rank-r products, and the unscaled da dotted with the activation is its gradient."""
    routing = Routing(order // top_k_weights.shape[-1], order, tiles, offsets)
    rank = _rank_gemms(offsets, grouped)
    weights = top_k_weights.reshape(-1)[routing.order]
    d_out = dy.index_select(0, routing.token).to(h.dtype)
    a = glue.activation(h)
    lora_da, d_down_a, d_down_b = rank.backward(d_out, a, aa, down_a, down_b, down_scaling, weights)
    da = gemm("nn", d_out, down, routing) + lora_da
    dh, dots = glue.activation_backward(da, h, weights)
    del d_out, a, lora_da, da
    rows = hidden.index_select(0, routing.token)
    lora_d_rows, d_gate_up_a, d_gate_up_b = rank.backward(dh, rows, xa, gate_up_a, gate_up_b, gate_up_scaling)
    d_rows = gemm("nn", dh, gate_up, routing) + lora_d_rows
    del dh, rows, lora_d_rows
    return (glue.merge(d_rows, order, dy), _routing_weights_grad(dots, order, top_k_weights), d_gate_up_a,
            d_gate_up_b, d_down_a, d_down_b)


def reference_lora_forward(hidden, top_k_index, top_k_weights, gate_up, down, gate_up_a, gate_up_b, down_a, down_b,
                           gate_up_scaling, down_scaling):  # fmt: skip
    """(y, kept rows, LoRA products and routing) by the expert loop, LoRA on the expert weights."""
    return _lora_experts_forward(_loop_gemm, hidden, top_k_index, top_k_weights, gate_up, down, gate_up_a, gate_up_b,
                                 down_a, down_b, gate_up_scaling, down_scaling)


def reference_lora_backward(dy, hidden, h, xa, aa, order, tiles, offsets, top_k_weights, gate_up, down, gate_up_a,
                            gate_up_b, down_a, down_b, gate_up_scaling, down_scaling):  # fmt: skip
    """(d hidden, d top_k_weights, d A, d B of gate_up and of down) by the expert loop."""
    return _lora_experts_backward(_loop_gemm, dy, hidden, h, xa, aa, order, tiles, offsets, top_k_weights, gate_up,
                                  down, gate_up_a, gate_up_b, down_a, down_b, gate_up_scaling, down_scaling)


# ---- TileLang grouped GEMM --------------------------------------------------------------------------------


@dataclass(frozen=True)
class GroupedConfig:
    """One grouped GEMM variant. block_m is also the tile schedule's (`route`): every GEMM of one op call shares
    the routing, so one config serves all four (forward gate_up and down, their input gradients).

    swizzle: panel size of TileLang's rasterised block order (0: plain order, column blocks of a row tile
    first); persistent: CTAs per SM of a persistent grid walking the (expert tile, column block) work list
    (0: one CTA per work item; in a persistent grid surplus schedule slots cost a load, not a launch); staged: the accumulator goes
    through shared memory for a coalesced, vectorised masked store instead of the fragment's scattered one;
    full_row: each warpgroup (warp) takes whole rows of the tile (TileLang's GemmWarpPolicy.FullRow: on sm_90 a
    128 x 128 tile is one m64n128 wgmma per warpgroup instead of two m64n64, the rows split, not the columns)
    rather than TileLang's default square split."""

    block_m: int
    block_n: int
    block_k: int
    stages: int
    threads: int
    swizzle: int = 0
    persistent: int = 0
    staged: bool = False
    full_row: bool = False


# The variants `benchmarks/kernel_bench.py --only moe` sweeps (each timed against dense cuBLAS over the same
# rows and torch's grouped_mm, reported as % of the dense TFLOP/s) and `test_moe_experts.py -m gpu` checks.
VARIANTS = {
    # what ran on the H200 (2026-12-04): 48% of dense cuBLAS; one warpgroup, wgmma m64n128
    "m64": GroupedConfig(64, 128, 64, 3, 128),
    # two warpgroups on a 128-row tile (linear's sm_90 shape family): half the weight traffic per output row
    "m128": GroupedConfig(128, 128, 64, 3, 256),
    # linear's sm_90 default tile: fewest weight and row re-reads, most work per CTA; gate_up's 1536 = 6 x 256
    "m128n256": GroupedConfig(128, 256, 64, 3, 256),
    # 128 rows, rasterised order: neighbouring CTAs share the expert's weight panel in L2
    "m128_swizzle": GroupedConfig(128, 128, 64, 3, 256, swizzle=8),
    # 128 rows, coalesced epilogue through shared memory (the masked store is the fragment's otherwise)
    "m128_staged": GroupedConfig(128, 128, 64, 3, 256, staged=True),
    # 128 rows, one CTA per SM over the work list: no launch tail of idle CTAs on empty schedule slots, no
    # CTA launch per tile; two per SM (2 x 96 KB of shared memory fit) to overlap one's epilogue with the other's loads
    "m128_persistent": GroupedConfig(128, 128, 64, 3, 256, persistent=1),
    "m128_persistent2": GroupedConfig(128, 128, 64, 3, 256, persistent=2),
    # 128 rows split by rows between the two warpgroups: m64n128 (m64n256) wgmmas, A read by one warpgroup only
    "m128_fullrow": GroupedConfig(128, 128, 64, 3, 256, full_row=True),
    "m128n256_fullrow": GroupedConfig(128, 256, 64, 3, 256, full_row=True),
    # 64 rows (less padding on experts with few rows) but linear's wide tile and the staged store
    "m64n256_staged": GroupedConfig(64, 256, 64, 4, 128, staged=True),
    # the pre-table defaults of sm_80 and hip, kept as rows; 128 rows in the same 32 KB of shared memory (LDS)
    "m64_k32": GroupedConfig(64, 128, 32, 2, 128),
    "m64_k32_t256": GroupedConfig(64, 128, 32, 2, 256),
    "m128_k32": GroupedConfig(128, 128, 32, 2, 256),
}
# What a GPU sweep tries per architecture (sm_90 up to 147 KB of its 227 KB shared memory; sm_80's 100 KB of
# sm_86/89 and gfx9's 64 KB of LDS keep to k32 and 2 stages).
CANDIDATES = {
    "sm_90": ["m64", "m128", "m128n256", "m128_swizzle", "m128_staged", "m128_persistent", "m128_persistent2",
              "m128_fullrow", "m128n256_fullrow", "m64n256_staged"],
    "sm_80": ["m64_k32", "m128_k32"],
    "hip": ["m64_k32_t256", "m128_k32"],
}
# Per architecture. sm_90 stays "m64" (what passed the GPU tests and was timed) until a GPU measures a better
# one: python3 benchmarks/kernel_bench.py --only moe --rounds 3   (it prints the TUNED entry of the fastest; put
# it in TUNED, or here, after python3 -m pytest -q -m gpu tests/kernels/test_moe_experts.py, which checks every
# candidate against float64).
DEFAULT_CONFIG = {"sm_90": "m64", "sm_80": "m64_k32", "hip": "m64_k32_t256"}
# (arch, experts, hidden, intermediate, dtype) -> variant name, from a GPU sweep. Qwen3-30B-A3B's experts on sm_90:
# benchmarks/results/h100-2026-12-05/kernels-moe (H100, every sm_90 candidate passed the GPU tests first): experts
# forward + backward 10.34 ms against m64's 12.04 (torch's grouped_mm 10.18).
TUNED: dict[tuple[str, int, int, int, str], str] = {("sm_90", 128, 2048, 768, "bfloat16"): "m128n256_fullrow"}
# SMs of a persistent grid when the SM count is unknown (lowering without a GPU): the H200's 132.
LOWERING_SMS = 132


def grouped_gemm_kernel(kind: str, experts: int, n: int, k: int, dtype: str, config: GroupedConfig,
                        sms: int = LOWERING_SMS, gathered: bool = False):  # fmt: skip
    """PrimFunc of one grouped GEMM over the sorted rows (rows and tiles dynamic), weights [experts, n, k]:

    nt: Y (rows, n) = X (rows, k) · W[e]ᵀ      (the forward: gate_up, down)
    nn: Y (rows, k) = X (rows, n) · W[e]       (the input gradient)

    `gathered`: X is [tokens, ·] and row r of the product reads X[token[r]] (the routing's token of each sorted
    row), loaded into the tile where the GEMM reads it instead of gathered into a [rows, ·] copy first.
    Tile (e, first, end) computes rows first..first+block_m of expert e's block, stores those below `end`.
    A work item is (tile, column block); a persistent config runs workers = persistent x `sms` CTAs, each walking
    the items pid, pid + workers, ... (column blocks of one tile adjacent: its rows and its expert's weights stay
    in L2).
    """
    import tilelang.language as T

    c = config
    bm, bn, bk = c.block_m, c.block_n, c.block_k
    rows, num_tiles, tokens = T.dynamic("rows"), T.dynamic("tiles"), T.dynamic("tokens")
    reduction, cols = (k, n) if kind == "nt" else (n, k)
    col_blocks = T.ceildiv(cols, bn)
    workers = c.persistent * sms

    @T.macro
    def tile(X, token, W, tiles, Y, t, col, a, b, acc, out):
        # the tile's (expert, first row, end) read where used: a named binding is not visible to the
        # producer warps of sm_90's warp-specialized pipeline
        if tiles[t, 0] >= 0:
            T.clear(acc)
            for ko in T.Pipelined(T.ceildiv(reduction, bk), num_stages=c.stages):
                if gathered:  # the tile's rows past its expert's end read the last row: stored by no one
                    for i, j in T.Parallel(bm, bk):
                        a[i, j] = X[token[T.min(tiles[t, 1] + i, tiles[t, 2] - 1)], ko * bk + j]
                else:
                    T.copy(X[tiles[t, 1] : tiles[t, 1] + bm, ko * bk : (ko + 1) * bk], a)
                if kind == "nt":
                    T.copy(W[tiles[t, 0], col * bn : (col + 1) * bn, ko * bk : (ko + 1) * bk], b)
                else:
                    T.copy(W[tiles[t, 0], ko * bk : (ko + 1) * bk, col * bn : (col + 1) * bn], b)
                T.gemm(a, b, acc, transpose_B=kind == "nt",
                       policy=T.GemmWarpPolicy.FullRow if c.full_row else T.GemmWarpPolicy.Square)
            if c.staged:
                T.copy(acc, out)
                for i, j in T.Parallel(bm, bn):
                    if tiles[t, 1] + i < tiles[t, 2]:
                        Y[tiles[t, 1] + i, col * bn + j] = out[i, j]
            else:
                for i, j in T.Parallel(bm, bn):
                    if tiles[t, 1] + i < tiles[t, 2]:
                        Y[tiles[t, 1] + i, col * bn + j] = acc[i, j]

    def buffers():
        return (T.alloc_shared((bm, bk), dtype), T.alloc_shared((bn, bk) if kind == "nt" else (bk, bn), dtype),
                T.alloc_fragment((bm, bn), "float32"), T.alloc_shared((bm, bn), dtype) if c.staged else None)

    @T.macro
    def grid(X, token, W, tiles, Y):
        if c.persistent:
            with T.Kernel(workers, threads=c.threads) as pid:
                a, b, acc, out = buffers()
                for step in T.serial(T.ceildiv(num_tiles * col_blocks, workers)):
                    if step * workers + pid < num_tiles * col_blocks:
                        tile(X, token, W, tiles, Y, (step * workers + pid) // col_blocks,
                             (step * workers + pid) % col_blocks, a, b, acc, out)
        else:
            with T.Kernel(col_blocks, num_tiles, threads=c.threads) as (bx, by):
                a, b, acc, out = buffers()
                if c.swizzle:
                    T.use_swizzle(panel_size=c.swizzle)
                tile(X, token, W, tiles, Y, by, bx, a, b, acc, out)

    if gathered:
        @T.prim_func
        def grouped_gemm(X: T.Tensor((tokens, reduction), dtype), token: T.Tensor((rows,), "int64"),
                         W: T.Tensor((experts, n, k), dtype), tiles: T.Tensor((num_tiles, 3), "int32"),
                         Y: T.Tensor((rows, cols), dtype)):  # fmt: skip
            grid(X, token, W, tiles, Y)
    else:
        @T.prim_func
        def grouped_gemm(X: T.Tensor((rows, reduction), dtype), W: T.Tensor((experts, n, k), dtype),
                         tiles: T.Tensor((num_tiles, 3), "int32"), Y: T.Tensor((rows, cols), dtype)):  # fmt: skip
            grid(X, None, W, tiles, Y)

    grouped_gemm = grouped_gemm.with_attr("global_symbol", f"grouped_gemm_{kind}{'_gathered' if gathered else ''}")
    # Gathered rows come by cp.async, not TMA, for which sm_90's warp-specialized pipeline makes the producer warpgroup
    # as large as the consumers: 512 threads, 128 registers each, too few for a 128 x 256 float32 accumulator (ptxas
    # refused it, H100): the gathered kernels run TileLang's plain software pipeline.
    return grouped_gemm.with_attr(_tilelang.PASS_CONFIGS_ATTR, {"tl.disable_warp_specialized": True}) if gathered \
        else grouped_gemm


def arch_family(arch: str) -> str:
    """The key of DEFAULT_CONFIG and CANDIDATES for an architecture: sm_90, sm_80 (other CUDA) or hip (gfx)."""
    return "hip" if arch.startswith("gfx") else "sm_90" if arch == "sm_90" else "sm_80"


def config_for(arch: str, experts: int = 128, hidden: int = 2048, inter: int = 768, dtype: str = "bfloat16",
               variant: str | None = None) -> GroupedConfig:
    """The grouped GEMMs' config for this op shape: `variant` if named, else tuned if known, else the arch default."""
    if variant is None:
        variant = TUNED.get((arch, experts, hidden, inter, dtype))
    if variant is None:
        variant = DEFAULT_CONFIG[arch_family(arch)]
    return VARIANTS[variant]


def unmeasured(hidden: Tensor, gate_up: Tensor) -> str | None:
    """Why a model's experts of this shape stay stock although the grouped GEMMs could run them: no config of theirs
    measured on this GPU (TUNED, from a sweep against torch's grouped_mm); None where one was. The arch default is
    not enough: on Mixtral-8x7B's experts it made the 2-layer step 1.55x stock's time (H100,
    benchmarks/results/h100-2026-12-06/mixtral-3a181b2)."""
    experts, inter2, size = gate_up.shape
    arch = _tilelang.device_arch(hidden.device) or "sm_90"
    dtype = _tilelang.DTYPES.get(hidden.dtype, "bfloat16")
    if (arch, experts, size, inter2 // 2, dtype) in TUNED:
        return None
    return (f"no grouped GEMM config measured for {experts} experts of {size} x {inter2 // 2} ({dtype}) on {arch}; "
            "benchmarks/kernel_bench.py --only moe sweeps them, moe_experts.TUNED takes the fastest")


def lowering_kernels(arch: str) -> dict[str, Callable]:
    """Kernel name -> PrimFunc builder at Qwen3-30B-A3B's shapes: the grouped GEMMs at its gate_up shape (128 experts,
    1536 x 2048; each also reading gathered rows), the merge of its 8 routes per token at its hidden size (2048)."""
    config = config_for(arch)
    gemms = {f"grouped_gemm_{kind}{'_gathered' if gathered else ''}":
             functools.partial(grouped_gemm_kernel, kind, 128, 1536, 2048, "bfloat16", config, gathered=gathered)
             for kind in ("nt", "nn") for gathered in (False, True)}
    merges = {f"merge_routes{'_weighted' if weighted else ''}": functools.partial(merge_kernel, 8, 2048, "bfloat16", weighted)
              for weighted in (True, False)}
    return gemms | merges


def kernel_build(kind: str, experts: int, n: int, k: int, dtype: str, config: GroupedConfig,
                 device: torch.device, gathered: bool = False) -> tuple[tuple, Callable]:  # fmt: skip
    """(the compile cache key, the PrimFunc builder) of one grouped GEMM on `device` (benchmarks compile many
    at once with them)."""
    sms = _tilelang.sm_count(device.index or 0) if config.persistent else LOWERING_SMS
    return (("moe_experts", kind, experts, n, k, dtype, config, sms, gathered),
            lambda: grouped_gemm_kernel(kind, experts, n, k, dtype, config, sms, gathered))


def compile_all(configs, experts: int, hidden: int, inter: int, dtype: str, device: torch.device) -> list[tuple]:
    """Compile the op shape's grouped GEMMs for every config at once (TileLang's par_compile, one call per set of pass
    configs) into the kernel cache, for a sweep or a test of many configs: the four over sorted rows, and the gate_up
    forward and the down input gradient over gathered rows (gather_fused's); returns the keys that failed."""
    gemms = [("nt", 2 * inter, hidden), ("nt", hidden, inter), ("nn", hidden, inter), ("nn", 2 * inter, hidden)]
    groups: dict[tuple, dict] = {}  # pass configs -> compile key -> PrimFunc
    for config, (kind, n, k), gathered in itertools.product(configs, gemms, (False, True)):
        if not gathered or (kind, n) in (("nt", 2 * inter), ("nn", hidden)):
            key, build = kernel_build(kind, experts, n, k, dtype, config, device, gathered)
            if key not in _tilelang._compiled:
                func = build()
                groups.setdefault(tuple(sorted(_tilelang.pass_configs(func).items())), {})[key] = func
    failed = []
    for settings, group in groups.items():
        kernels = _tilelang.tilelang().par_compile(list(group.values()),
                                                   target=_tilelang.parse_target(_tilelang.device_target(device)),
                                                   ignore_error=True, pass_configs=dict(settings) or None)
        for key, kernel in zip(group, kernels):
            if kernel is None:
                failed.append(key)
            else:
                _tilelang._compiled[key] = kernel
    return failed


def grouped_gemm(config: GroupedConfig, fuse_gather: bool = False) -> Callable:
    """`gemm(kind, x, weights, routing, gathered=False)` running `config`'s TileLang grouped GEMM (the routing's tiles
    must be of config.block_m rows); `gathered`: x [tokens, ·] read through the routing's token of each row, with
    `fuse_gather` in the GEMM's tile loads (no gathered copy), else from a copy gathered first."""
    def gemm(kind: str, x: Tensor, weights: Tensor, routing: Routing, gathered: bool = False) -> Tensor:
        if gathered and not fuse_gather:
            x, gathered = _sorted_rows(x, routing, True), False
        experts, n, k = weights.shape
        key, build = kernel_build(kind, experts, n, k, _tilelang.DTYPES[x.dtype], config, x.device, gathered)
        kernel = _tilelang.compiled(key, build)
        rows = routing.token.shape[0] if gathered else x.shape[0]
        out = x.new_empty(rows, n if kind == "nt" else k)
        if rows:
            # the active tiles come first: the slots past this bound are empty for tiles of config.block_m rows
            tiles = routing.tiles[: -(-rows // config.block_m) + experts]
            sources = (x.contiguous(), routing.token) if gathered else (x.contiguous(),)
            kernel(*sources, weights.contiguous(), tiles, out)
        return out

    return gemm


MERGE_THREADS = 256
MERGE_VECTOR = 8  # columns per thread: 16 bytes of a bf16 row


def merge_block(width: int) -> tuple[int, int]:
    """(tokens, columns) per thread block of the merge kernel for rows `width` wide: the widest column block of
    up to 512 that divides it (width is a multiple of 8, as both impls' GEMMs need), MERGE_VECTOR columns a
    thread."""
    columns = next(c for c in (512, 256, 128, 64, 32, 16, 8) if width % c == 0)
    return MERGE_THREADS * MERGE_VECTOR // columns, columns


def merge_kernel(k: int, width: int, dtype: str, weighted: bool):
    """PrimFunc OUT [tokens, width] = Σ_j W[t, j] · ROWS[POS[t, j]] over each token's k routes (POS: where route
    (t, j) sits among the expert-sorted rows; W float32; without `weighted` the plain sum), float32 accumulation,
    one rounding, no atomics; tokens and rows dynamic. One pass over the rows: the gather, the weighting and the sum
    that `_merge_routes` runs as an index_select and a batched GEMM per chunk."""
    import tilelang.language as T

    bt, bn = merge_block(width)
    tokens, rows = T.dynamic("tokens"), T.dynamic("rows")

    @T.macro
    def compute(ROWS, POS, W, OUT):
        with T.Kernel(T.ceildiv(width, bn), T.ceildiv(tokens, bt), threads=MERGE_THREADS) as (bx, by):
            acc = T.alloc_fragment((bt, bn), "float32")
            out = T.alloc_fragment((bt, bn), dtype)
            T.clear(acc)
            for j in T.unroll(k):  # the k loads in flight together
                for i, c in T.Parallel(bt, bn):
                    token = T.min(by * bt + i, tokens - 1)  # the tail block's surplus tokens re-read the last one
                    route = T.cast(ROWS[POS[token, j], bx * bn + c], "float32")
                    acc[i, c] += route * W[token, j] if weighted else route
            T.copy(acc, out)
            T.copy(out, OUT[by * bt, bx * bn])

    if weighted:
        @T.prim_func
        def merge_routes(ROWS: T.Tensor((rows, width), dtype), POS: T.Tensor((tokens, k), "int64"),
                         W: T.Tensor((tokens, k), "float32"), OUT: T.Tensor((tokens, width), dtype)):  # fmt: skip
            compute(ROWS, POS, W, OUT)
    else:
        @T.prim_func
        def merge_routes(ROWS: T.Tensor((rows, width), dtype), POS: T.Tensor((tokens, k), "int64"),
                         OUT: T.Tensor((tokens, width), dtype)):  # fmt: skip
            compute(ROWS, POS, None, OUT)

    return merge_routes.with_attr("global_symbol", f"merge_routes{'_weighted' if weighted else ''}")


def tilelang_merge(rows: Tensor, order: Tensor, like: Tensor, top_k_weights: Tensor | None = None) -> Tensor:
    """`_merge_routes` by the TileLang merge kernel: each token's k rows read once where they lie (no gathered
    copy), the routing weights in float32."""
    tokens, width = like.shape[0], rows.shape[-1]
    k = order.numel() // max(tokens, 1)
    dtype = _tilelang.DTYPES[rows.dtype]
    weighted = top_k_weights is not None
    kernel = _tilelang.compiled(("moe_experts", "merge", k, width, dtype, weighted),
                                lambda: merge_kernel(k, width, dtype, weighted))
    out = rows.new_empty(tokens, width)  # row-major whatever like's strides, as the kernel writes it
    if tokens:
        weights = [top_k_weights.reshape(tokens, k).to(torch.float32).contiguous()] if weighted else []
        kernel(rows.contiguous(), _positions(order).view(tokens, k), *weights, out)
    return out.to(like.dtype)


# swiglu's packed TileLang kernels (the halves read in place, float32 inside, one rounding: the reference's math)
# and the merge kernel: the glue of both GPU impls. Against the reference merge on the 12-layer Qwen3-30B-A3B step
# (H100): 0.136 s for 0.155 with every layer recomputed, 0.147 s for 0.176 within 0.55x of stock's peak
# (benchmarks/results/h100-2026-12-07/moe12-tlmerge, moe12-refmerge)
TILELANG_GLUE = Glue(functools.partial(swiglu.tilelang_packed_forward, swiglu.SILU),
                     functools.partial(swiglu.tilelang_packed_backward_dots, swiglu.SILU), tilelang_merge)


def op_config(hidden: Tensor, gate_up: Tensor, variant: str | None = None) -> GroupedConfig:
    """The config of the op's four grouped GEMMs on this device and shape."""
    experts, inter2, size = gate_up.shape
    arch = _tilelang.device_arch(hidden.device) or "sm_90"
    return config_for(arch, experts, size, inter2 // 2, _tilelang.DTYPES.get(hidden.dtype, "bfloat16"), variant)


def tilelang_forward(hidden, top_k_index, top_k_weights, gate_up, down, keep_rows=True, output_read=True,
                     variant: str | None = None, gemm_of: Callable = grouped_gemm):  # fmt: skip
    """(y, kept rows and routing) with the grouped GEMMs in TileLang (config `variant`, else op_config's; `gemm_of`
    makes the `gemm` of a config)."""
    config = op_config(hidden, gate_up, variant)
    return _experts_forward(gemm_of(config), hidden, top_k_index, top_k_weights, gate_up, down, config.block_m,
                            TILELANG_GLUE, keep_rows, output_read)


def tilelang_backward(dy, h, order, tiles, offsets, top_k_weights, gate_up, down, hidden=None,
                      variant: str | None = None, gemm_of: Callable = grouped_gemm):  # fmt: skip
    """(d hidden, d top_k_weights) with the grouped GEMMs in TileLang (the forward's config)."""
    config = op_config(dy, gate_up, variant)
    return _experts_backward(gemm_of(config), dy, h, order, tiles, offsets, top_k_weights, gate_up, down,
                             TILELANG_GLUE, hidden)


def tilelang_unsupported(hidden, top_k_index, top_k_weights, gate_up, down, keep_rows=True, output_read=True) -> str | None:
    """Why the grouped GEMMs cannot run these inputs, or None."""
    reason = _tilelang.unsupported_inputs(hidden, gate_up, down)
    config = op_config(hidden, gate_up)
    bn, bk = config.block_n, config.block_k
    if reason is None and any(d % bn or d % bk for d in (*gate_up.shape[1:], *down.shape[1:])):
        reason = f"expert shapes {tuple(gate_up.shape)}, {tuple(down.shape)} are not multiples of {bn} and {bk}"
    return reason or swiglu.packed_unsupported(gate_up.shape[1] // 2)


def tilelang_lora_forward(hidden, top_k_index, top_k_weights, gate_up, down, gate_up_a, gate_up_b, down_a, down_b,
                          gate_up_scaling, down_scaling, variant: str | None = None, grouped: bool | None = None):  # fmt: skip
    """The LoRA form's forward: the base GEMMs in TileLang (as tilelang_forward), the rank-r ones through torch's
    grouped GEMM where it runs in one kernel (`grouped` None: `grouped_mm_runs`), else per expert."""
    config = op_config(hidden, gate_up, variant)
    grouped = grouped_mm_runs(hidden, gate_up.shape[0]) if grouped is None else grouped
    return _lora_experts_forward(grouped_gemm(config), hidden, top_k_index, top_k_weights, gate_up, down, gate_up_a,
                                 gate_up_b, down_a, down_b, gate_up_scaling, down_scaling, config.block_m, grouped,
                                 TILELANG_GLUE)


def tilelang_lora_backward(dy, hidden, h, xa, aa, order, tiles, offsets, top_k_weights, gate_up, down, gate_up_a,
                           gate_up_b, down_a, down_b, gate_up_scaling, down_scaling, variant: str | None = None,
                           grouped: bool | None = None):  # fmt: skip
    """The LoRA form's backward: the input-gradient GEMMs in TileLang, the rank-r ones and dA, dB as the forward's."""
    config = op_config(dy, gate_up, variant)
    grouped = grouped_mm_runs(h, gate_up.shape[0]) if grouped is None else grouped
    return _lora_experts_backward(grouped_gemm(config), dy, hidden, h, xa, aa, order, tiles, offsets, top_k_weights,
                                  gate_up, down, gate_up_a, gate_up_b, down_a, down_b, gate_up_scaling, down_scaling,
                                  grouped, TILELANG_GLUE)


def _adapters_elsewhere(hidden: Tensor, *factors: Tensor) -> str | None:
    if any(t.device != hidden.device for t in factors):
        return "LoRA on expert weights: adapter weights on another device than the input"
    return None


def tilelang_lora_unsupported(hidden, top_k_index, top_k_weights, gate_up, down, gate_up_a, gate_up_b, down_a, down_b,
                              gate_up_scaling, down_scaling) -> str | None:  # fmt: skip
    """Why the LoRA form's grouped GEMMs cannot run these inputs, or None."""
    return (_adapters_elsewhere(hidden, gate_up_a, gate_up_b, down_a, down_b)
            or tilelang_unsupported(hidden, top_k_index, top_k_weights, gate_up, down))


# ---- torch's grouped GEMM for the four GEMMs, the op's glue and packed activation around it ---------------------
#
# Where torch's grouped GEMM is one CUTLASS kernel (bf16 on sm_90 / sm_100) it runs Mixtral-8x7B's expert GEMMs at 95%
# of a dense GEMM, where no TileLang config passes 80%; with the op's glue and packed activation kernels the experts'
# forward + backward takes 19.7 ms there, 27.1 with the TileLang GEMMs (H100,
# benchmarks/results/h100-2026-12-06/kernels-moe-mixtral). On the training step (H100, the fastest dense set): 0.68x
# stock's time at Mixtral-8x7B's 2 layers (the TileLang GEMMs, ungated, 1.55x), 0.46x at Qwen3-30B-A3B's 8 layers
# (TileLang 0.47x): the op's default (`kernels: all`) since; elsewhere its binding runs the stock experts.


def vendor_gemm(kind: str, rows: Tensor, weights: Tensor, routing: Routing, gathered: bool = False) -> Tensor:
    """`gemm` over the expert groups by torch's grouped GEMM (the routing's offsets read on the device): ``nt``
    rows·W_eᵀ, ``nn`` rows·W_e, in the rows' dtype with float32 accumulation; `gathered` rows gathered first."""
    mat_b = weights.transpose(-2, -1) if kind == "nt" else weights
    return _grouped_mm(_rows(_sorted_rows(rows, routing, gathered)), _weights(mat_b), routing.offsets[1:])


def grouped_mm_forward(hidden, top_k_index, top_k_weights, gate_up, down, keep_rows=True, output_read=True):
    """(y, kept rows and routing) with torch's grouped GEMMs and the packed activation kernels."""
    return _experts_forward(vendor_gemm, hidden, top_k_index, top_k_weights, gate_up, down, BLOCK_M, TILELANG_GLUE,
                            keep_rows, output_read, tiles=False)


def grouped_mm_backward(dy, h, order, tiles, offsets, top_k_weights, gate_up, down, hidden=None):
    """(d hidden, d top_k_weights) with torch's grouped GEMMs and the packed activation kernels."""
    return _experts_backward(vendor_gemm, dy, h, order, tiles, offsets, top_k_weights, gate_up, down, TILELANG_GLUE,
                             hidden)


def grouped_mm_unsupported(hidden, top_k_index, top_k_weights, gate_up, down, keep_rows=True,
                           output_read=True) -> str | None:  # fmt: skip
    """Why torch's grouped GEMM (one kernel) and the packed activation cannot run these inputs, or None."""
    if not grouped_mm_runs(hidden, gate_up.shape[0]):
        return "torch's grouped GEMM is one kernel only for bf16 on CUDA sm_90 / sm_100 (under 1024 experts)"
    if any(d % _align(hidden) for d in gate_up.shape[1:]):
        return f"expert shapes {tuple(gate_up.shape)}: rows not a multiple of 16 bytes, as torch's grouped GEMM needs"
    return _tilelang.unsupported_inputs(hidden, gate_up, down) or swiglu.packed_unsupported(gate_up.shape[1] // 2)


# ---- torch's grouped GEMM where the rows lie sorted, TileLang's where they are gathered ----------------------------
#
# Two of the four GEMMs read rows gathered from the tokens (the gate_up forward from the hidden states, the down
# projection's input gradient from dy): with torch's grouped GEMM those rows are first copied out, [routes, hidden]
# each time (Qwen3-30B-A3B at 8,192 tokens: 256 MiB, 0.16 ms on an H100, three times per layer in a recomputed step).
# TileLang's grouped GEMM reads them through the routing's token index in its tile loads (cp.async, in a software
# pipeline: the gathered kernels compile without sm_90's warp specialization) instead; the other two GEMMs stay torch's.


def gather_fused_gemm(config: GroupedConfig) -> Callable:
    """`gemm`: `config`'s TileLang grouped GEMM for gathered rows, torch's grouped GEMM for rows that lie sorted."""
    gathering = grouped_gemm(config, fuse_gather=True)

    def gemm(kind: str, x: Tensor, weights: Tensor, routing: Routing, gathered: bool = False) -> Tensor:
        return gathering(kind, x, weights, routing, True) if gathered else vendor_gemm(kind, x, weights, routing)

    return gemm


def gather_fused_unsupported(hidden, top_k_index, top_k_weights, gate_up, down, keep_rows=True,
                             output_read=True) -> str | None:  # fmt: skip
    """Why torch's grouped GEMM or TileLang's gathering one cannot run these inputs, or None."""
    return (grouped_mm_unsupported(hidden, top_k_index, top_k_weights, gate_up, down)
            or tilelang_unsupported(hidden, top_k_index, top_k_weights, gate_up, down))


def grouped_mm_lora_forward(hidden, top_k_index, top_k_weights, gate_up, down, gate_up_a, gate_up_b, down_a, down_b,
                            gate_up_scaling, down_scaling):  # fmt: skip
    """The LoRA form's forward, every GEMM (base and rank-r) by torch's grouped GEMM."""
    return _lora_experts_forward(vendor_gemm, hidden, top_k_index, top_k_weights, gate_up, down, gate_up_a, gate_up_b,
                                 down_a, down_b, gate_up_scaling, down_scaling, BLOCK_M, True, TILELANG_GLUE,
                                 tiles=False)


def grouped_mm_lora_backward(dy, hidden, h, xa, aa, order, tiles, offsets, top_k_weights, gate_up, down, gate_up_a,
                             gate_up_b, down_a, down_b, gate_up_scaling, down_scaling):  # fmt: skip
    """The LoRA form's backward, every GEMM by torch's grouped GEMM."""
    return _lora_experts_backward(vendor_gemm, dy, hidden, h, xa, aa, order, tiles, offsets, top_k_weights, gate_up,
                                  down, gate_up_a, gate_up_b, down_a, down_b, gate_up_scaling, down_scaling, True,
                                  TILELANG_GLUE)


def grouped_mm_lora_unsupported(hidden, top_k_index, top_k_weights, gate_up, down, gate_up_a, gate_up_b, down_a, down_b,
                                gate_up_scaling, down_scaling) -> str | None:  # fmt: skip
    """Why the LoRA form cannot run these inputs on torch's grouped GEMM, or None."""
    return (_adapters_elsewhere(hidden, gate_up_a, gate_up_b, down_a, down_b)
            or grouped_mm_unsupported(hidden, top_k_index, top_k_weights, gate_up, down))


# ---- custom ops and binding ------------------------------------------------------------------------------

moe_experts_op = make_custom_op(Signature(
    "moe_experts", "Tensor hidden, Tensor top_k_index, Tensor top_k_weights, Tensor gate_up, Tensor down, bool keep_rows, "
                   "bool output_read",
    "(Tensor, Tensor, Tensor, Tensor, Tensor)",
    backward_inputs="Tensor h, Tensor order, Tensor tiles, Tensor offsets, Tensor top_k_weights, "
                    "Tensor gate_up, Tensor down, Tensor? hidden",
    backward_outputs="(Tensor, Tensor)",
    fake=lambda hidden, top_k_index, top_k_weights, gate_up, down, keep_rows, output_read: (
        torch.empty_like(hidden), hidden.new_empty(top_k_index.numel() if keep_rows else 0, gate_up.shape[1]),
        top_k_index.new_empty(top_k_index.numel()),
        torch.empty(-(-top_k_index.numel() // BLOCK_M) + gate_up.shape[0], 3, dtype=torch.int32, device=hidden.device),
        torch.empty(gate_up.shape[0] + 1, dtype=torch.int32, device=hidden.device)),
    backward_fake=lambda dy, h, order, tiles, offsets, top_k_weights, gate_up, down, hidden: (
        torch.empty_like(dy), torch.empty_like(top_k_weights)),
    # without keep_rows the hidden states wait for the backward instead of the gate_up rows (2·k·intermediate wide)
    save=lambda inputs, outputs, needs: (*outputs[1:], *inputs[2:5], None if inputs[5] else inputs[0]),
    judged_on=lambda grads, saved: (grads[0], saved[1], saved[4], saved[5], saved[6]),
    grad_of=(0, None, 1, None, None, None, None),
))


def moe_experts(hidden: Tensor, top_k_index: Tensor, top_k_weights: Tensor, gate_up: Tensor, down: Tensor,
                impl: str = "reference", strict: bool = False, keep_rows: bool = True,
                output_read: bool = True) -> Tensor:  # fmt: skip
    """The routed experts' output for `hidden` [tokens, hidden] through the custom op; without `keep_rows` the
    backward keeps the hidden states instead of the [routes, 2·intermediate] gate_up rows and computes those again
    (Qwen3-30B-A3B at 8,192 tokens: 32 MiB kept instead of 192 MiB, for one more grouped GEMM in the backward).
    Without `output_read` (a checkpointed layer's recomputation, where nothing reads the output's values) the output
    is NaN and only what the backward needs is computed: the routing and the gate_up rows, not the activation, the
    down GEMM or the merge."""
    return torch.ops.tiletune.moe_experts(hidden, top_k_index, top_k_weights, gate_up, down, keep_rows, output_read,
                                          impl, strict)[0]


# The LoRA form: its own custom-op pair (A and B of both projections take gradients), selected per call like the
# plain op's. It is part of the moe_experts op (the same binding, `kernels: {moe_experts: ...}` selects it) and has
# no Op record of its own: its implementations are registered under "moe_experts_lora" below.
LORA = "moe_experts_lora"
_LORA_INPUTS = ("Tensor gate_up_a, Tensor gate_up_b, Tensor down_a, Tensor down_b, float gate_up_scaling, "
                "float down_scaling")


def _lora_fake(hidden, top_k_index, top_k_weights, gate_up, down, gate_up_a, gate_up_b, down_a, down_b, s1, s2):
    rows = top_k_index.numel()
    return (torch.empty_like(hidden), hidden.new_empty(rows, gate_up.shape[1]), hidden.new_empty(rows, gate_up_a.shape[1]),
            hidden.new_empty(rows, down_a.shape[1]), top_k_index.new_empty(rows),
            torch.empty(-(-rows // BLOCK_M) + gate_up.shape[0], 3, dtype=torch.int32, device=hidden.device),
            torch.empty(gate_up.shape[0] + 1, dtype=torch.int32, device=hidden.device))


registry.define_form(LORA)
moe_experts_lora_op = make_custom_op(Signature(
    LORA, f"Tensor hidden, Tensor top_k_index, Tensor top_k_weights, Tensor gate_up, Tensor down, {_LORA_INPUTS}",
    "(Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)",
    backward_inputs="Tensor hidden, Tensor h, Tensor xa, Tensor aa, Tensor order, Tensor tiles, Tensor offsets, "
                    f"Tensor top_k_weights, Tensor gate_up, Tensor down, {_LORA_INPUTS}",
    backward_outputs="(Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)",
    fake=_lora_fake,
    backward_fake=lambda dy, hidden, h, xa, aa, order, tiles, offsets, top_k_weights, gate_up, down, a1, b1, a2, b2, s1, s2: (
        torch.empty_like(dy), torch.empty_like(top_k_weights), torch.empty_like(a1), torch.empty_like(b1),
        torch.empty_like(a2), torch.empty_like(b2)),
    save=lambda inputs, outputs, needs: (inputs[0], *outputs[1:], *inputs[2:]),
    judged_on=lambda grads, saved: (grads[0], None, *saved[7:]),
    grad_of=(0, None, 1, None, None, 2, 3, 4, 5, None, None),
))


def moe_experts_lora(hidden: Tensor, top_k_index: Tensor, top_k_weights: Tensor, gate_up: Tensor, down: Tensor,
                     gate_up_a: Tensor, gate_up_b: Tensor, down_a: Tensor, down_b: Tensor, gate_up_scaling: float,
                     down_scaling: float, impl: str = "reference", strict: bool = False) -> Tensor:  # fmt: skip
    """The routed experts' output with LoRA on their weights: A [experts, r, in], B [experts, out, r] per projection
    (peft's ParamWrapper factors; rank 0 where a projection has none), ``W_e + s·B_e·A_e`` never formed."""
    return torch.ops.tiletune.moe_experts_lora(hidden, top_k_index, top_k_weights, gate_up, down, gate_up_a, gate_up_b,
                                               down_a, down_b, gate_up_scaling, down_scaling, impl, strict)[0]


_LAYOUT = {"has_gate": True, "is_concatenated": True, "is_transposed": False, "has_bias": False,
           "has_post_expert_norm": False, "_is_expert_parallel": False}  # fmt: skip


def peft_wrappers(module: nn.Module) -> tuple[nn.Module, dict[str, nn.Module]]:
    """(the experts module under any peft ParamWrappers, {parameter name: its wrapper}): LoRA on the experts'
    parameters (`target_parameters`) nests one ParamWrapper per parameter around the experts module."""
    wrappers = {}
    while isinstance(getattr(module, "base_layer", None), nn.Module) and hasattr(module, "parameter_name"):
        wrappers[module.parameter_name] = module
        module = module.base_layer
    return module, wrappers


def _fit(site: Site) -> str | None:
    module, wrappers = peft_wrappers(site.module)
    if site.part.activation != "silu" or site.part.bias:
        return (f"experts computing {site.part.activation}{' with biases' if site.part.bias else ''}: the op computes "
                "silu(gate)·up without biases: stock experts kept")
    for name, value in _LAYOUT.items():
        if getattr(module, name, value) != value:
            return f"{type(module).__name__}.{name} is {getattr(module, name)!r} (the op takes {value!r}): stock experts kept"
    params = [getattr(module, name, None) for name in ("gate_up_proj", "down_proj")]
    if not all(isinstance(p, torch.nn.Parameter) and p.dim() == 3 for p in params):
        return f"{type(module).__name__} has no 3-D gate_up_proj and down_proj: stock experts kept"
    if len(inspect.signature(type(module).forward).parameters) < 4:
        return f"{type(module).__name__}.forward takes no top_k_index and top_k_weights (pre-sorted rows): stock experts kept"
    if any(p.requires_grad for p in params):
        return "the expert weights train (the op computes no weight gradient): stock experts kept"
    if getattr(getattr(module, "config", None), "hidden_act", "silu") != "silu":
        return f"activation {module.config.hidden_act!r}: the op computes silu(gate)·up: stock experts kept"
    for name, wrapper in wrappers.items():
        if name not in ("gate_up_proj", "down_proj"):
            return f"LoRA on expert weights: peft adapts {name}, which the op does not take: stock peft experts kept"
        param = getattr(module, name)
        for adapter, lora_a in wrapper.lora_A.items():
            if lora_a.weight.shape[1] != param.shape[2] or wrapper.lora_B[adapter].weight.shape[0] != param.shape[1]:
                return (f"LoRA on expert weights: adapter {adapter!r} of {name} is not laid out as [experts, out, in]: "
                        "stock peft experts kept")
    return None


def _lora_unfit(wrappers: dict[str, nn.Module]) -> str | None:
    """Why the LoRA form cannot compute the adapted experts right now (peft's own path must), or None."""
    for name, wrapper in wrappers.items():
        adapters = [a for a in wrapper.active_adapters if a in wrapper.lora_A]
        if wrapper.merged:
            return f"adapter merged into {name}"
        if len(adapters) != 1 and not wrapper.disable_adapters:
            return f"{len(adapters)} active adapters on {name}"
        if adapters and not isinstance(wrapper.lora_dropout[adapters[0]], nn.Identity):
            return f"lora_dropout on {name}"
    return None


def unfit_now(module) -> str | None:
    """Why the op cannot stand in right now: an adapter state the LoRA form does not compute (merged, several active),
    or expert weights that take gradients (unfrozen after patching: the op computes no weight gradient, which would
    leave them untrained silently)."""
    experts, wrappers = peft_wrappers(module)
    reason = _lora_unfit(wrappers)
    if reason:
        return f"LoRA on expert weights: {reason}: stock peft experts"
    if experts.gate_up_proj.requires_grad or experts.down_proj.requires_grad:
        return "the expert weights take gradients (the op computes none): stock experts"
    return None


def lora_factors(wrappers: dict[str, nn.Module], experts: nn.Module) -> tuple | None:
    """(gate_up A, gate_up B, down A, down B, gate_up scaling, down scaling) of the active adapters, A [experts, r, in]
    and B [experts, out, r] as peft's ParamWrapper lays them out in lora_A [r·experts, in] (expert-major) and
    lora_B [out, r·experts] (rank-major); rank 0 for a projection without one. None: no adapter active."""
    factors, scalings, active = [], [], False
    for name in ("gate_up_proj", "down_proj"):
        param = getattr(experts, name)
        num, out_features, in_features = param.shape
        wrapper = wrappers.get(name)
        adapter = None if wrapper is None or wrapper.disable_adapters else next(
            (a for a in wrapper.active_adapters if a in wrapper.lora_A), None)
        if adapter is None:
            factors += [param.new_zeros(num, 0, in_features), param.new_zeros(num, out_features, 0)]
            scalings.append(1.0)
            continue
        active = True
        lora_a, lora_b = wrapper.lora_A[adapter].weight, wrapper.lora_B[adapter].weight
        rank = lora_a.shape[0] // num
        factors += [lora_a.view(num, rank, in_features), lora_b.view(out_features, rank, num).permute(2, 0, 1).contiguous()]
        scalings.append(float(wrapper.scaling[adapter]))
    return (*factors, *scalings) if active else None


# The implementations whose TileLang grouped GEMMs run only at shapes with a measured config (`unmeasured`).
TILED_IMPLS = ("tilelang", "gather_fused")


def _experts_forward_binding(site: Site, impl: str, strict: bool, current: Callable) -> Callable:
    def forward(self, hidden_states, top_k_index, top_k_weights):
        reason = unfit_now(self)
        if reason:
            if reason.startswith("LoRA on expert weights"):
                note_fallback("moe_experts", impl, reason)
            return current(self, hidden_states, top_k_index, top_k_weights)
        experts, wrappers = peft_wrappers(self)
        factors = lora_factors(wrappers, experts)
        dtype = torch.get_autocast_dtype(hidden_states.device.type) if torch.is_autocast_enabled(hidden_states.device.type) else None
        gate_up, down = experts.gate_up_proj, experts.down_proj
        if dtype is not None:  # under autocast the GEMMs run in its dtype, as F.linear's would
            hidden_states, gate_up, down = hidden_states.to(dtype), gate_up.to(dtype), down.to(dtype)
        inputs = (hidden_states, top_k_index, top_k_weights, gate_up, down, *(factors or ()))
        # where the implementation cannot run, or its grouped GEMMs were never measured at this shape, the stock experts
        # (transformers' grouped_mm), not the op's reference: the per-expert loop is as slow as transformers' eager
        # experts (8.6x its grouped_mm on the H200)
        reason = None if strict else (registry.unrunnable(LORA if factors else "moe_experts", impl, *inputs)
                                      or (unmeasured(hidden_states, gate_up) if impl in TILED_IMPLS else None))
        if reason:
            note_fallback("moe_experts", impl, f"{reason}: stock experts")
            return current(self, hidden_states, top_k_index, top_k_weights)
        if factors is None:  # no LoRA, or its adapters disabled (a preference stage's reference): the base experts
            # in a selective layer the gate_up rows are computed again in the backward, from the kept input; in a
            # checkpointed layer's recomputation the output's values are read by nothing unless a later op of the
            # layer keeps them (a post-feedforward norm: the family's Experts.output_kept)
            output_read = site.part.output_kept or not (registry.in_backward() and torch.is_grad_enabled())
            return moe_experts(*inputs, impl, strict, keep_rows=not registry.in_selective_layer(),
                               output_read=output_read)
        return moe_experts_lora(*inputs, impl, strict)

    return forward


# No compile key yet: `tiletune kernels warmup` leaves the grouped GEMMs to their first call. In `kernels: all`: on the
# 8-layer Qwen3-30B-A3B step (H100) the fastest dense set runs 0.81x stock without the op and 0.75x with it
# (benchmarks/results/h100-2026-12-06/moe-glue; 0.49x with the packed activation and TileLang loss since).
define(Op("moe_experts", (Binding("moe_experts", "experts", _experts_forward_binding, _fit, unfit_now=unfit_now),),
          keeps_output=True, forms=(LORA,), profile_pattern=r"grouped_gemm_(nt|nn)|merge_routes", lowering=lowering_kernels,
          default="grouped_mm"))
add(Impl("moe_experts", "reference", reference_forward, reference_backward,
         description="PyTorch: one GEMM per expert (the eager loop)", accumulation="float32"))
add(Impl("moe_experts", "tilelang", tilelang_forward, tilelang_backward, _tilelang.machine_unavailable_reason,
         tilelang_unsupported, "TileLang grouped GEMMs over the expert-sorted rows (forward and input gradient)",
         accumulation="float32"))
add(Impl(LORA, "reference", reference_lora_forward, reference_lora_backward,
         description="PyTorch: one GEMM per expert for the base and for each rank-r product", accumulation="float32"))
add(Impl(LORA, "tilelang", tilelang_lora_forward, tilelang_lora_backward, _tilelang.machine_unavailable_reason,
         tilelang_lora_unsupported, "TileLang grouped GEMMs for the base weights, the rank-r products and adapter "
         "gradients through torch's grouped_mm (bf16 on sm_90/sm_100; else one GEMM per expert)", accumulation="float32"))
add(Impl("moe_experts", "grouped_mm", grouped_mm_forward, grouped_mm_backward, _tilelang.machine_unavailable_reason,
         grouped_mm_unsupported, "torch's grouped GEMM (one CUTLASS kernel, bf16 on sm_90/sm_100) for the four GEMMs, "
         "the op's glue and swiglu's packed TileLang activation kernels", accumulation="float32"))
add(Impl(LORA, "grouped_mm", grouped_mm_lora_forward, grouped_mm_lora_backward, _tilelang.machine_unavailable_reason,
         grouped_mm_lora_unsupported, "torch's grouped GEMM for the base and rank-r GEMMs, the packed TileLang "
         "activation", accumulation="float32"))
add(Impl("moe_experts", "gather_fused", functools.partial(tilelang_forward, gemm_of=gather_fused_gemm),
         functools.partial(tilelang_backward, gemm_of=gather_fused_gemm), _tilelang.machine_unavailable_reason,
         gather_fused_unsupported, "torch's grouped GEMM over sorted rows, TileLang's over rows it reads through the "
         "routing (the gate_up forward, the down input gradient: no gathered copy), the packed activation",
         accumulation="float32"))
add(Impl(LORA, "gather_fused", grouped_mm_lora_forward, grouped_mm_lora_backward, _tilelang.machine_unavailable_reason,
         grouped_mm_lora_unsupported, "as grouped_mm: the LoRA form's rank-r products read the gathered rows too, "
         "which it gathers once", accumulation="float32"))
