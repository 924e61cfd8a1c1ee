"""Known model shapes for `--model-preset`: randomly initialised, so speed is measured without a download."""

from __future__ import annotations

from tiletune.errors import UserError

PRESETS: dict[str, dict] = {
    "llama3-8b": dict(
        model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192, rope_theta=500000.0,
        rms_norm_eps=1e-5, tie_word_embeddings=False,
    ),
    "llama3-70b": dict(
        model_type="llama", vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
        num_attention_heads=64, num_key_value_heads=8, max_position_embeddings=8192, rope_theta=500000.0,
        rms_norm_eps=1e-5, tie_word_embeddings=False,
    ),
    "llama3-1b": dict(
        model_type="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192, rope_theta=500000.0,
        rms_norm_eps=1e-5, tie_word_embeddings=True, head_dim=64,
        rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192},
    ),
    "qwen3-4b": dict(
        model_type="qwen3", vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=32768,
        rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
    ),
    "qwen3-8b": dict(
        model_type="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
        rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
    ),
    "mistral-7b": dict(
        model_type="mistral", vocab_size=32768, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=32768,
        rope_theta=1000000.0, rms_norm_eps=1e-5, sliding_window=None, tie_word_embeddings=False,
    ),
    "gemma3-12b": dict(  # the text model of Gemma-3-12B
        model_type="gemma3_text", vocab_size=262208, hidden_size=3840, intermediate_size=15360, num_hidden_layers=48,
        num_attention_heads=16, num_key_value_heads=8, head_dim=256, query_pre_attn_scalar=256, sliding_window=1024,
        max_position_embeddings=131072, rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
    ),
    "phi3-mini": dict(
        model_type="phi3", vocab_size=32064, hidden_size=3072, intermediate_size=8192, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096, rope_theta=10000.0,
        rms_norm_eps=1e-5, tie_word_embeddings=False, pad_token_id=32000,
    ),
    "qwen3-30b-a3b": dict(
        model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
        num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
        num_experts_per_tok=8, max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    ),
    "mixtral-8x7b": dict(
        model_type="mixtral", vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2,
        max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-5, sliding_window=None,
        tie_word_embeddings=False,
    ),
    "phi4-mini": dict(  # Phi-4-mini-instruct: fused qkv and gate_up, rotary on 3/4 of each head
        model_type="phi3", vocab_size=200064, hidden_size=3072, intermediate_size=8192, num_hidden_layers=32,
        num_attention_heads=24, num_key_value_heads=8, max_position_embeddings=131072, rope_theta=10000.0,
        partial_rotary_factor=0.75, rms_norm_eps=1e-5, tie_word_embeddings=True, pad_token_id=199999,
    ),
    "gpt-oss-20b": dict(  # openai/gpt-oss-20b: 32 experts (top-4) with biases, sinks, every other layer a 128 window
        model_type="gpt_oss", vocab_size=201088, hidden_size=2880, intermediate_size=2880, num_hidden_layers=24,
        num_attention_heads=64, num_key_value_heads=8, head_dim=64, num_local_experts=32, num_experts_per_tok=4,
        sliding_window=128, layer_types=["sliding_attention", "full_attention"] * 12, max_position_embeddings=131072,
        rope_theta=150000.0, rope_scaling={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                           "truncate": False, "original_max_position_embeddings": 4096},
        attention_bias=True, swiglu_limit=7.0, rms_norm_eps=1e-5, tie_word_embeddings=False, pad_token_id=199999,
        eos_token_id=200002,
    ),
    "deepseek-v3": dict(  # deepseek-ai/DeepSeek-V3 (671B; its multi-token-prediction layer is not built, as in transformers)
        model_type="deepseek_v3", vocab_size=129280, hidden_size=7168, intermediate_size=18432,
        moe_intermediate_size=2048, num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128,
        n_shared_experts=1, n_routed_experts=256, num_experts_per_tok=8, n_group=8, topk_group=4,
        first_k_dense_replace=3, routed_scaling_factor=2.5, norm_topk_prob=True, q_lora_rank=1536, kv_lora_rank=512,
        qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, max_position_embeddings=163840, rope_theta=10000.0,
        rope_scaling={"rope_type": "yarn", "factor": 40.0, "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0,
                      "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096},
        rms_norm_eps=1e-6, tie_word_embeddings=False,
    ),
    "moonlight-16b-a3b": dict(  # moonshotai/Moonlight-16B-A3B: DeepSeek-V3's architecture at 16B, q without low rank
        model_type="deepseek_v3", vocab_size=163840, hidden_size=2048, intermediate_size=11264,
        moe_intermediate_size=1408, num_hidden_layers=27, num_attention_heads=16, num_key_value_heads=16,
        n_shared_experts=2, n_routed_experts=64, num_experts_per_tok=6, n_group=1, topk_group=1,
        first_k_dense_replace=1, routed_scaling_factor=2.446, norm_topk_prob=True, q_lora_rank=None, kv_lora_rank=512,
        qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, max_position_embeddings=8192, rope_theta=50000.0,
        rms_norm_eps=1e-5, tie_word_embeddings=False,
    ),
    "tiny": dict(
        model_type="llama", vocab_size=1024, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048, rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    ),
}  # fmt: skip


def preset_config(name: str, layers: int | None = None):
    """The transformers config of preset `name`, with only its first `layers` decoder layers if given."""
    from transformers import AutoConfig

    if name not in PRESETS:
        raise UserError(f"model preset {name!r} is unknown; available: {', '.join(PRESETS)}")
    shape = dict(PRESETS[name])
    config = AutoConfig.for_model(shape.pop("model_type"), **shape)
    if layers:
        config.num_hidden_layers = layers
        if getattr(config, "layer_types", None):  # each layer's attention (Gemma 3's sliding windows): the first ones
            config.layer_types = config.layer_types[:layers]
    return config


def preset_model(cfg, name: str, device, layers: int | None = None, seed: int = 0):
    """A random-init model of preset `name` (only its first `layers` decoder layers if given) in cfg's compute
    dtype on `device`; with quantization_bit, its Linears quantized as they are built, tensor by tensor, so a
    preset loads where its quantized size fits (the 70B shape on one GPU)."""
    import torch
    from transformers import AutoModelForCausalLM

    from tiletune.train.model import compute_dtype

    shape = preset_config(name, layers)
    dtype = compute_dtype(cfg)
    if cfg.quantization_bit:
        from tiletune.train.quantized import quantized_kind, random_quantized

        return random_quantized(shape, dtype, quantized_kind(cfg.quantization_bit, cfg.quantization_type),
                                cfg.double_quantization, torch.device(device), seed)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(shape, dtype=dtype)
