"""MoE experts: the routed tokens through their experts' gated MLPs, as transformers 5's fused experts compute it.

Semantics (the reference): for each token t and each of its k routes (expert e = top_k_index[t, j], weight
w = top_k_weights[t, j]): ``y[t] += w · (silu(g) * u) · down[e]ᵀ`` with ``[g, u] = x[t] · gate_up[e]ᵀ``;
``gate_up`` is [experts, 2·intermediate, hidden] (gate rows first), ``down`` [experts, hidden, intermediate]
(Qwen3-MoE, Mixtral, Llama-4's routed experts). Gradients for the hidden states and the routing weights
(the router trains through them); the experts' weights are frozen (LoRA trains attention; a site whose expert
weights train is reported and left alone).

How it runs: the k·tokens routes are sorted by expert (`Routing`: one sort, no host sync), the rows gathered
once, and each expert's block of rows meets its weights in a grouped GEMM: one kernel launch for all experts,
each thread block owning a tile of one expert's rows (the tile schedule, an upper bound of ceil(rows / block_m)
+ experts tiles, is built on the device; surplus tiles exit at once). Forward: two grouped GEMMs (gate_up,
down) with the activation between them; backward: two grouped GEMMs for the input gradient (``nn``: the
weights untransposed) and the activation's derivative. The forward keeps [rows, 2·intermediate] and
[rows, hidden] for the backward (Qwen3-30B-A3B at 8,192 tokens: 192 + 256 MiB per layer).

The reference runs the same steps with one PyTorch GEMM per expert (the "eager" loop), in the input dtype
with float32 accumulation; the TileLang version's GEMMs accumulate in float32 and round once.
"""

# No `from __future__ import annotations` here: TileLang reads the kernel signature's shapes from the closure.

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from tiletune.kernels import _tilelang
from tiletune.kernels.binding import Binding, Site
from tiletune.kernels.customop import Signature, make_custom_op
from tiletune.kernels.registry import Impl, Op, add, define

BLOCK_M = 64  # rows of one expert per tile: small, as experts see few rows each (Qwen3-30B-A3B: 512 on average)


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


def route(top_k_index: Tensor, experts: int, block_m: int = BLOCK_M) -> Routing:
    """Sort the routes by expert and lay out the grouped GEMMs' tiles, all on the device (no host sync)."""
    k = top_k_index.shape[-1]
    flat = top_k_index.reshape(-1)
    _, order = torch.sort(flat, stable=True)
    counts = torch.zeros(experts, dtype=torch.int32, device=flat.device).index_add_(
        0, flat, torch.ones_like(flat, dtype=torch.int32))
    ends = torch.cumsum(counts, 0, dtype=torch.int32)
    starts = ends - counts
    tiles_per_expert = (counts + block_m - 1) // block_m
    tile_ends = torch.cumsum(tiles_per_expert, 0, dtype=torch.int32)
    max_tiles = (flat.numel() + block_m - 1) // block_m + experts
    index = torch.arange(max_tiles, dtype=torch.int32, device=flat.device)
    expert = torch.searchsorted(tile_ends, index, right=True).to(torch.int32)
    active = expert < experts
    safe = expert.clamp(max=experts - 1).long()
    first = starts[safe] + (index - (tile_ends[safe] - tiles_per_expert[safe])) * block_m
    tiles = torch.stack([torch.where(active, expert, -1), first, ends[safe]], dim=1).to(torch.int32)
    offsets = torch.cat([starts, ends[-1:]])
    return Routing(order // k, order, tiles.contiguous(), offsets)


def _silu_gate(h: Tensor) -> Tensor:
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate) * up


def _silu_gate_backward(da: Tensor, h: Tensor) -> Tensor:
    """d[gate, up] of silu(gate)·up, in float32 (float64 for float64), cast to h's dtype."""
    acc = torch.promote_types(h.dtype, torch.float32)
    gate, up = h.to(acc).chunk(2, dim=-1)
    sig = torch.sigmoid(gate)
    da = da.to(acc)
    return torch.cat([da * up * sig * (1 + gate * (1 - sig)), da * gate * sig], dim=-1).to(h.dtype)


def _experts_forward(gemm: Callable, hidden: Tensor, top_k_index: Tensor, top_k_weights: Tensor, gate_up: Tensor,
                     down: Tensor):  # fmt: skip
    """(y, the gate_up rows, the down rows, the routing's order, tiles and offsets): the experts' forward with
    `gemm(kind, rows, weights, routing)`; the backward reuses the routing."""
    routing = route(top_k_index, gate_up.shape[0])
    rows = hidden[routing.token]
    h = gemm("nt", rows, gate_up, routing)
    o = gemm("nt", _silu_gate(h), down, routing)
    weights = top_k_weights.reshape(-1)[routing.order].to(o.dtype)
    y = torch.zeros_like(hidden).index_add_(0, routing.token, (o * weights[:, None]).to(hidden.dtype))
    return y, h, o, routing.order, routing.tiles, routing.offsets


def _experts_backward(gemm: Callable, dy: Tensor, h: Tensor, o: Tensor, order: Tensor, tiles: Tensor, offsets: Tensor,
                      top_k_weights: Tensor, gate_up: Tensor, down: Tensor):  # fmt: skip
    """(d hidden, d top_k_weights) from the forward's kept rows and routing."""
    routing = Routing(order // top_k_weights.shape[-1], order, tiles, offsets)
    weights = top_k_weights.reshape(-1)[routing.order]
    dy_rows = dy[routing.token]
    dweights = torch.empty_like(weights)
    acc = torch.promote_types(o.dtype, torch.float32)
    dweights[routing.order] = (dy_rows.to(acc) * o.to(acc)).sum(-1).to(weights.dtype)
    da = gemm("nn", (dy_rows * weights[:, None].to(dy.dtype)).to(o.dtype), down, routing)
    d_rows = gemm("nn", _silu_gate_backward(da, h), gate_up, routing)
    dhidden = torch.zeros(dy.shape, dtype=dy.dtype, device=dy.device).index_add_(0, routing.token, d_rows.to(dy.dtype))
    return dhidden, dweights.view_as(top_k_weights)


# ---- reference: one PyTorch GEMM per expert --------------------------------------------------------------


def _loop_gemm(kind: str, rows: Tensor, weights: Tensor, routing: Routing) -> Tensor:
    """Each expert's rows times its weights (ᵀ for ``nt``), in float32 (float64 for float64), rounded once."""
    acc = torch.promote_types(rows.dtype, torch.float32)
    out_features = weights.shape[1] if kind == "nt" else weights.shape[2]
    out = rows.new_zeros(rows.shape[0], out_features)
    bounds = routing.offsets.tolist()
    for expert, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
        if end > start:
            w = weights[expert].to(acc)
            out[start:end] = (rows[start:end].to(acc) @ (w.t() if kind == "nt" else w)).to(out.dtype)
    return out


def reference_forward(hidden, top_k_index, top_k_weights, gate_up, down):
    """(y, kept rows and routing) by the expert loop."""
    return _experts_forward(_loop_gemm, hidden, top_k_index, top_k_weights, gate_up, down)


def reference_backward(dy, h, o, order, tiles, offsets, top_k_weights, gate_up, down):
    """(d hidden, d top_k_weights) by the expert loop."""
    return _experts_backward(_loop_gemm, dy, h, o, order, tiles, offsets, top_k_weights, gate_up, down)


# ---- TileLang grouped GEMM --------------------------------------------------------------------------------

# (block_n, block_k, stages, threads); block_m is BLOCK_M (the tile schedule's)
DEFAULT_CONFIG = {"sm_90": (128, 64, 3, 128), "sm_80": (128, 32, 2, 128), "hip": (128, 32, 2, 256)}


def grouped_gemm_kernel(kind: str, experts: int, n: int, k: int, dtype: str, config):
    """PrimFunc of one grouped GEMM over the sorted rows (rows and tiles dynamic), weights [experts, n, k]:

    nt: Y (rows, n) = X (rows, k) · W[e]ᵀ      (the forward: gate_up, down)
    nn: Y (rows, k) = X (rows, n) · W[e]       (the input gradient)

    Tile (e, first, end) computes rows first..first+BLOCK_M of expert e's block, stores those below `end`.
    """
    import tilelang.language as T

    bn, bk, stages, threads = config
    bm = BLOCK_M
    rows, num_tiles = T.dynamic("rows"), T.dynamic("tiles")
    reduction, cols = (k, n) if kind == "nt" else (n, k)

    @T.prim_func
    def grouped_gemm(X: T.Tensor((rows, reduction), dtype), W: T.Tensor((experts, n, k), dtype),
                     tiles: T.Tensor((num_tiles, 3), "int32"), Y: T.Tensor((rows, cols), dtype)):  # fmt: skip
        with T.Kernel(T.ceildiv(cols, bn), num_tiles, threads=threads) as (bx, by):
            a = T.alloc_shared((bm, bk), dtype)
            b = T.alloc_shared((bn, bk) if kind == "nt" else (bk, bn), dtype)
            acc = T.alloc_fragment((bm, bn), "float32")
            # the tile's (expert, first row, end) read where used: a named binding is not visible to the
            # producer warps of sm_90's warp-specialized pipeline
            if tiles[by, 0] >= 0:
                T.clear(acc)
                for ko in T.Pipelined(T.ceildiv(reduction, bk), num_stages=stages):
                    T.copy(X[tiles[by, 1] : tiles[by, 1] + bm, ko * bk : (ko + 1) * bk], a)
                    if kind == "nt":
                        T.copy(W[tiles[by, 0], bx * bn : (bx + 1) * bn, ko * bk : (ko + 1) * bk], b)
                    else:
                        T.copy(W[tiles[by, 0], ko * bk : (ko + 1) * bk, bx * bn : (bx + 1) * bn], b)
                    T.gemm(a, b, acc, transpose_B=kind == "nt")
                for i, j in T.Parallel(bm, bn):
                    if tiles[by, 1] + i < tiles[by, 2]:
                        Y[tiles[by, 1] + i, bx * bn + j] = acc[i, j]

    return grouped_gemm.with_attr("global_symbol", f"grouped_gemm_{kind}")


def config_for(arch: str):
    return DEFAULT_CONFIG.get(arch, DEFAULT_CONFIG["hip" if arch.startswith("gfx") else "sm_80"])


def lowering_kernels(arch: str) -> dict[str, Callable]:
    """Kernel name -> PrimFunc builder at Qwen3-30B-A3B's gate_up shape (128 experts, 1536 x 2048)."""
    return {f"grouped_gemm_{kind}": (lambda kind=kind: grouped_gemm_kernel(kind, 128, 1536, 2048, "bfloat16", config_for(arch)))
            for kind in ("nt", "nn")}


def _tilelang_gemm(kind: str, rows: Tensor, weights: Tensor, routing: Routing) -> Tensor:
    experts, n, k = weights.shape
    dtype, config = _tilelang.DTYPES[rows.dtype], config_for(_tilelang.device_arch(rows.device))
    kernel = _tilelang.compiled(("moe_experts", kind, experts, n, k, dtype, config),
                                lambda: grouped_gemm_kernel(kind, experts, n, k, dtype, config))
    out = rows.new_empty(rows.shape[0], n if kind == "nt" else k)
    if rows.shape[0]:
        kernel(rows.contiguous(), weights.contiguous(), routing.tiles, out)
    return out


def tilelang_forward(hidden, top_k_index, top_k_weights, gate_up, down):
    """(y, kept rows and routing) with the grouped GEMMs in TileLang."""
    return _experts_forward(_tilelang_gemm, hidden, top_k_index, top_k_weights, gate_up, down)


def tilelang_backward(dy, h, o, order, tiles, offsets, top_k_weights, gate_up, down):
    """(d hidden, d top_k_weights) with the grouped GEMMs in TileLang."""
    return _experts_backward(_tilelang_gemm, dy, h, o, order, tiles, offsets, top_k_weights, gate_up, down)


def tilelang_unsupported(hidden, top_k_index, top_k_weights, gate_up, down) -> str | None:
    """Why the grouped GEMMs cannot run these inputs, or None."""
    reason = _tilelang.unsupported_inputs(hidden, gate_up, down)
    bn, bk = config_for(_tilelang.device_arch(hidden.device) or "sm_90")[:2]
    if reason is None and any(d % bn or d % bk for d in (*gate_up.shape[1:], *down.shape[1:])):
        reason = f"expert shapes {tuple(gate_up.shape)}, {tuple(down.shape)} are not multiples of {bn} and {bk}"
    return reason


# ---- custom ops and binding ------------------------------------------------------------------------------

moe_experts_op = make_custom_op(Signature(
    "moe_experts", "Tensor hidden, Tensor top_k_index, Tensor top_k_weights, Tensor gate_up, Tensor down",
    "(Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)",
    backward_inputs="Tensor h, Tensor o, Tensor order, Tensor tiles, Tensor offsets, Tensor top_k_weights, "
                    "Tensor gate_up, Tensor down",
    backward_outputs="(Tensor, Tensor)",
    fake=lambda hidden, top_k_index, top_k_weights, gate_up, down: (
        torch.empty_like(hidden), hidden.new_empty(top_k_index.numel(), gate_up.shape[1]),
        hidden.new_empty(top_k_index.numel(), hidden.shape[-1]), top_k_index.new_empty(top_k_index.numel()),
        torch.empty(-(-top_k_index.numel() // BLOCK_M) + gate_up.shape[0], 3, dtype=torch.int32, device=hidden.device),
        torch.empty(gate_up.shape[0] + 1, dtype=torch.int32, device=hidden.device)),
    backward_fake=lambda dy, h, o, order, tiles, offsets, top_k_weights, gate_up, down: (
        torch.empty_like(dy), torch.empty_like(top_k_weights)),
    save=lambda inputs, outputs, needs: (*outputs[1:], *inputs[2:]),
    judged_on=lambda grads, saved: (grads[0], saved[2], saved[5], saved[6], saved[7]),
    grad_of=(0, None, 1, None, None),
))


def moe_experts(hidden: Tensor, top_k_index: Tensor, top_k_weights: Tensor, gate_up: Tensor, down: Tensor,
                impl: str = "reference", strict: bool = False) -> Tensor:  # fmt: skip
    """The routed experts' output for `hidden` [tokens, hidden] through the custom op."""
    return torch.ops.tiletune.moe_experts(hidden, top_k_index, top_k_weights, gate_up, down, impl, strict)[0]


_LAYOUT = {"has_gate": True, "is_concatenated": True, "is_transposed": False, "has_bias": False,
           "has_post_expert_norm": False, "_is_expert_parallel": False}  # fmt: skip


def _fit(site: Site) -> str | None:
    module = site.module
    for name, value in _LAYOUT.items():
        if getattr(module, name, value) != value:
            return f"{type(module).__name__}.{name} is {getattr(module, name)!r} (the op takes {value!r}): stock experts kept"
    params = [getattr(module, name, None) for name in ("gate_up_proj", "down_proj")]
    if not all(isinstance(p, torch.nn.Parameter) and p.dim() == 3 for p in params):
        return f"{type(module).__name__} has no 3-D gate_up_proj and down_proj: stock experts kept"
    if any(p.requires_grad for p in params):
        return "the expert weights train (the op computes no weight gradient): stock experts kept"
    if getattr(getattr(module, "config", None), "hidden_act", "silu") != "silu":
        return f"activation {module.config.hidden_act!r}: the op computes silu(gate)·up: stock experts kept"
    return None


def unfit_now(module) -> str | None:
    """Why the op cannot stand in right now: expert weights that take gradients (unfrozen after patching, or an
    adapter on them: the op computes no weight gradient, which would leave them untrained silently)."""
    if module.gate_up_proj.requires_grad or module.down_proj.requires_grad:
        return "the expert weights take gradients (the op computes none): stock experts"
    return None


def _experts_forward_binding(site: Site, impl: str, strict: bool, current: Callable) -> Callable:
    def forward(self, hidden_states, top_k_index, top_k_weights):
        if unfit_now(self):
            return current(self, hidden_states, top_k_index, top_k_weights)
        dtype = torch.get_autocast_dtype(hidden_states.device.type) if torch.is_autocast_enabled(hidden_states.device.type) else None
        gate_up, down = self.gate_up_proj, self.down_proj
        if dtype is not None:  # under autocast the GEMMs run in its dtype, as F.linear's would
            hidden_states, gate_up, down = hidden_states.to(dtype), gate_up.to(dtype), down.to(dtype)
        return moe_experts(hidden_states, top_k_index, top_k_weights, gate_up, down, impl, strict)

    return forward


# No compile key yet: `tiletune kernels warmup` leaves the grouped GEMMs to their first call. Opt-in: the grouped
# GEMMs pass their GPU tests (H200, 2026-12-04) but are slower there than torch's grouped_mm, which transformers
# runs by default (experts forward + backward 10.9 ms vs 9.0, benchmarks/results/h200-2026-12-04/moe-b9531ff).
define(Op("moe_experts", (Binding("moe_experts", "experts", _experts_forward_binding, _fit, unfit_now=unfit_now),),
          opt_in=True, profile_pattern=r"grouped_gemm_(nt|nn)", lowering=lowering_kernels))
add(Impl("moe_experts", "reference", reference_forward, reference_backward,
         description="PyTorch: one GEMM per expert (the eager loop)", accumulation="float32"))
add(Impl("moe_experts", "tilelang", tilelang_forward, tilelang_backward, _tilelang.machine_unavailable_reason,
         tilelang_unsupported, "TileLang grouped GEMMs over the expert-sorted rows (forward and input gradient)",
         accumulation="float32"))
