"""Gemma 2 and Gemma 3 (text): x·(1 + w) RMSNorms in a sandwich around attention and the MLP, GeGLU (tanh)
MLP, embeddings scaled inside the model, and Gemma 2's soft-capped attention logits and final logits (a
Gemma 3 config may set the latter too: the lm_head binding reads the key)."""

from tiletune.families import Attention, Family, LmHead, Mlp, Norm, register

SANDWICH_NORMS = (Norm("input_layernorm", "pre", True), Norm("post_attention_layernorm", "post", True),
                  Norm("pre_feedforward_layernorm", "pre", True), Norm("post_feedforward_layernorm", "post", True))
GEGLU = Mlp(activation="gelu_tanh", output_kept=True)  # the post-feedforward norm keeps the MLP output
SOFTCAPPED_HEAD = LmHead(softcap_key="final_logit_softcapping")

register(Family("gemma2", ("gemma2",), norms=SANDWICH_NORMS, mlp=GEGLU, attention=Attention(softcap=True),
                lm_head=SOFTCAPPED_HEAD, liger="apply_liger_kernel_to_gemma2"))
register(Family("gemma3_text", ("gemma3_text",),
                norms=SANDWICH_NORMS + (Norm("self_attn.q_norm", "qk", True), Norm("self_attn.k_norm", "qk", True)),
                mlp=GEGLU, lm_head=SOFTCAPPED_HEAD, liger="apply_liger_kernel_to_gemma3_text"))
