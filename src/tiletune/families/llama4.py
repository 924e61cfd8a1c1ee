"""Llama 4 (text): Llama's pre-norms, SwiGLU MLPs and GQA attention, with
- rotary embeddings on adjacent pairs of head dimensions taken as complex numbers (`interleaved`: the rope op's
  pairs layout takes its `apply_rotary_emb`), none on every 4th layer (NoPE: it scales its queries by position
  instead; rope reports the layer as such), and a q/k norm without a weight after the rotation (no op takes it);
- MoE layers (every one in Scout, every 2nd in Maverick): a router that is a Linear subclass returning sigmoid
  top-k scores and logits (named, so that neither `linear` nor LoRA takes it), fused 3-D experts, and a shared
  expert, a SwiGLU MLP; the other layers' `feed_forward` is a dense SwiGLU MLP."""

from tiletune.families import Attention, Experts, Family, Mlp, register
from tiletune.families.llama import PRE_NORMS

register(Family("llama4", ("llama4_text",), norms=PRE_NORMS, mlp=Mlp("feed_forward"),
                attention=Attention(rotary="interleaved"),
                experts=Experts("feed_forward.experts", router="feed_forward.router",
                                shared="feed_forward.shared_expert"),
                liger="apply_liger_kernel_to_llama4"))
