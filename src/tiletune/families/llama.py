"""Llama and the families built like it: pre-norm RMSNorm, SwiGLU MLP, GQA attention with full rotary; Phi-3
with its gate and up projections fused into one (and q, k, v into one, which the rotary op does not take)."""

from tiletune.families import Family, Mlp, Norm, register

PRE_NORMS = (Norm("input_layernorm"), Norm("post_attention_layernorm"))
QK_NORMS = (Norm("self_attn.q_norm", "qk"), Norm("self_attn.k_norm", "qk"))

register(Family("llama", ("llama",), norms=PRE_NORMS, liger="apply_liger_kernel_to_llama"))
register(Family("mistral", ("mistral",), norms=PRE_NORMS, liger="apply_liger_kernel_to_mistral"))
register(Family("qwen2", ("qwen2",), norms=PRE_NORMS, liger="apply_liger_kernel_to_qwen2"))
register(Family("qwen3", ("qwen3",), norms=PRE_NORMS + QK_NORMS, liger="apply_liger_kernel_to_qwen3"))
register(Family("phi3", ("phi3",), norms=PRE_NORMS, mlp=Mlp(fused_gate_up=True), liger="apply_liger_kernel_to_phi3"))
