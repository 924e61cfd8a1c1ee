"""Model families: one record per family, matched by `config.model_type`.

A record says where a model's decoder layers are and what is in them: each norm (x·w or Gemma's
x·(1+w), and where it sits), the MLP flavour, attention and its rotary embedding, the MoE experts and
their router, the lm_head and its logit soft-cap. The engine (tiletune.patch) reads it to find the sites each op's bindings may take; a model
whose family has no record trains unpatched, every selected op's fallback saying so. A module of this
package adds records with `register`; so may a user plugin (`kernels: {plugins: [...]}`).
"""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass


@dataclass(frozen=True)
class Norm:
    """A norm inside a decoder layer: its path (a glob), where it sits, and its flavour."""

    path: str
    position: str = "pre"  # pre (before attention / MLP), post (on a sublayer's output), qk (on queries and keys)
    offset: bool = False  # x·(1 + w), Gemma's, instead of x·w
    # x·w in float32, rounded to x's dtype once (GPT-OSS's), instead of Llama's normalised x rounded to x's dtype
    # first and then times w
    round_once: bool = False


@dataclass(frozen=True)
class Mlp:
    """The dense MLP: its path, its activation, whether gate and up are one projection (Phi-3), and whether a later
    op of the layer keeps its output for the backward (Gemma's post-feedforward norm) or the output only joins
    the residual sum (`tiletune.train.tiled_mlp` then spares a recomputation's chunked MLP forward)."""

    path: str = "mlp"
    activation: str = "silu"  # silu (SwiGLU) or gelu_tanh (GeGLU)
    fused_gate_up: bool = False
    output_kept: bool = False


@dataclass(frozen=True)
class Attention:
    """Self-attention: its path and rotary embedding; what the family's attention may add to plain causal GQA."""

    path: str = "self_attn"
    # full, partial (part of head_dim), interleaved (adjacent pairs as complex numbers), half_angles (full, halves
    # layout, cos and sin holding each angle once: GPT-OSS's), latent (MLA's: the rotated slice of each q head and one
    # shared k head, adjacent pairs returned in halves order: DeepSeek's) or none
    rotary: str = "full"
    softcap: bool = False  # attention logit soft-capping
    sinks: bool = False  # attention sinks
    latent: bool = False  # multi-head latent attention (DeepSeek's MLA): q/k heads wider than v heads


@dataclass(frozen=True)
class Experts:
    """MoE experts: their path, the router's (a Linear that routes tokens, not a projection), and a shared expert's
    (a dense MLP of the record's `mlp` kind that every token goes through as well; in a layer whose `mlp` path holds
    the experts, it is the layer's MLP)."""

    path: str = "mlp.experts"
    router: str = "mlp.gate"
    shared: str | None = None
    # what each expert computes: silu (silu(gate)·up, gate and up as the two halves of gate_up_proj) or
    # clamped_swiglu (GPT-OSS's: gate and up interleaved columns, clamped, (up + 1)·gate·sigmoid(alpha·gate))
    activation: str = "silu"
    bias: bool = False  # biases on the gate_up and down projections
    # whether a later op of the layer keeps the experts' output for its backward (as Mlp.output_kept); where it only
    # joins the residual sum, a checkpointed layer's recomputation skips computing it (`moe_experts`)
    output_kept: bool = False


@dataclass(frozen=True)
class LmHead:
    """The output projection: its attribute on the causal LM, the decoder stack feeding it, and the config key
    of a final logit soft-cap."""

    path: str = "lm_head"
    body: str = "model"
    softcap_key: str | None = None


@dataclass(frozen=True)
class Family:
    """One model family."""

    name: str
    model_types: tuple[str, ...]
    layers: str = "model.layers"  # the decoder layers' ModuleList, from the causal LM
    norms: tuple[Norm, ...] = ()
    mlp: Mlp | None = Mlp()
    attention: Attention = Attention()
    experts: Experts | None = None
    lm_head: LmHead = LmHead()
    liger: str | None = None  # Liger-Kernel's patch function for it, for `tiletune bench` (liger_kernel.transformers)


_families: dict[str, Family] = {}


def register(family: Family) -> Family:
    """Add (or replace) a family record under each of its model types."""
    for model_type in family.model_types:
        _families[model_type] = family
    return family


def load_families() -> None:
    """Import every module of this package: each registers its records."""
    for module in pkgutil.iter_modules(__path__, f"{__name__}."):
        importlib.import_module(module.name)


def known() -> dict[str, Family]:
    """Every record by model type."""
    load_families()
    return dict(_families)


def family_of(config) -> Family | None:
    """The record for a transformers config's model_type, or None."""
    return known().get(getattr(config, "model_type", None))
