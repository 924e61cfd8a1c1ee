"""DeepSeek-V3 (and the models built on it: Moonlight, Kimi-K2): Llama's pre-norms, multi-head latent attention
(MLA) and DeepSeekMoE.

- MLA: q through a low-rank pair (q_a_proj, an RMSNorm q_a_layernorm, q_b_proj; or one q_proj without q_lora_rank),
  k and v from one compressed latent (kv_a_proj_with_mqa, an RMSNorm kv_a_layernorm, kv_b_proj). The two latent
  norms are Llama's RMSNorm (rms_norm takes them); every projection is a plain Linear. q/k heads are
  qk_nope_head_dim + qk_rope_head_dim wide, v heads v_head_dim: the attention op (one head_dim) refuses it. The
  rotary embedding turns only the qk_rope_head_dim slice of each q head and one k head shared by all heads, on
  adjacent pairs returned in halves order (rope_interleave, the default): the rope op refuses it (`latent`).
- MoE: the first `first_k_dense_replace` layers have a dense SwiGLU MLP, the others routed experts (fused 3-D,
  silu(gate)·up) behind a sigmoid router with grouped top-k and a score-correction bias (named: no dense op or LoRA
  takes it), plus shared experts, a SwiGLU MLP, at mlp.shared_experts."""

from tiletune.families import Attention, Experts, Family, Mlp, Norm, register
from tiletune.families.llama import PRE_NORMS

LATENT_NORMS = (Norm("self_attn.q_a_layernorm", "qk"), Norm("self_attn.kv_a_layernorm", "qk"))

register(Family("deepseek_v3", ("deepseek_v3",), norms=PRE_NORMS + LATENT_NORMS, mlp=Mlp("mlp"),
                attention=Attention(rotary="latent", latent=True),
                experts=Experts("mlp.experts", router="mlp.gate", shared="mlp.shared_experts")))
