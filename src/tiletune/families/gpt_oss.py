"""GPT-OSS: Llama's pre-norms (RMSNorm rounding once: x·w in float32, then to x's dtype), GQA attention with biases,
attention sinks (a learned logit per head in the softmax, which no attention kernel takes yet) and a sliding window
on every other layer, YaRN rotary in the halves layout with cos and sin holding each angle once (the rope op takes
them doubled: the same products and sums, so the same numbers), and MoE layers only: a biased router (a module of
its own, named so that neither `linear` nor LoRA takes it) and fused experts with biases and a clamped SwiGLU on
interleaved gate/up columns, which the moe_experts op does not compute (it refuses them)."""

from tiletune.families import Attention, Experts, Family, Norm, register

register(Family("gpt_oss", ("gpt_oss",),
                norms=(Norm("input_layernorm", round_once=True), Norm("post_attention_layernorm", round_once=True)),
                mlp=None, attention=Attention(rotary="half_angles", sinks=True),
                experts=Experts("mlp.experts", router="mlp.router", activation="clamped_swiglu", bias=True)))
