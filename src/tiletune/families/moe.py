"""Mixture-of-experts families built like Llama around their experts: the attention side binds as Llama's;
the experts (fused 3-D parameters in transformers 5) and their router are named, so no dense op takes them."""

from tiletune.families import Experts, Family, register
from tiletune.families.llama import PRE_NORMS, QK_NORMS

register(Family("qwen3_moe", ("qwen3_moe",), norms=PRE_NORMS + QK_NORMS, mlp=None, experts=Experts(),
                liger="apply_liger_kernel_to_qwen3_moe"))
register(Family("mixtral", ("mixtral",), norms=PRE_NORMS, mlp=None, experts=Experts(), liger="apply_liger_kernel_to_mixtral"))
