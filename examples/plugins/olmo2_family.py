"""A complete model family in one record: OLMo-2 (post-norms after attention and MLP, q/k norms over all
heads, SwiGLU MLP, GQA attention with full rotary). `kernels: {all: true, plugins: [olmo2_family]}` (with
this folder on PYTHONPATH) binds every op to an OLMo-2 model; everything not said here is Llama's default.
"""

from tiletune.families import Family, Norm, register

register(Family("olmo2", ("olmo2",), norms=(Norm("post_*", "post"), Norm("self_attn.[qk]_norm", "qk"))))
