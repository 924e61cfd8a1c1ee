"""bench --profile: kernel names sorted into categories, and the table a person reads."""

import pytest

from tiletune.bench.profile import category, profile_table, summarise_kernels


@pytest.mark.parametrize("kernel,expected", [
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64", "matmul (cuBLAS)"),
    ("nvjet_hsh_256x128_64x4_1x2_h_bz_coopA_NTN", "matmul (cuBLAS)"),
    ("linear_fwd_kernel", "tiletune linear"),
    ("lora_linear_dgrad_kernel", "tiletune lora_linear"),
    ("void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel_traits>", "attention"),
    ("rms_norm_bwd_kernel", "rms_norm"),
    ("_triton_rope", "rope"),
    ("swiglu_fwd_kernel", "swiglu"),
    ("void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float>", "cross-entropy"),
    ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<FusedAdamMathFunctor>", "optimizer"),
    ("void at::native::unrolled_elementwise_kernel<direct_copy_kernel_cuda>", "copy / cast"),
    ("void at::native::vectorized_elementwise_kernel<4, AUnaryFunctor<float, float, float, MulFunctor>>", "elementwise"),
    ("mystery", "other"),
])  # fmt: skip
def test_kernel_categories(kernel, expected):
    assert category(kernel) == expected


def test_summary_and_table_add_up():
    kernels = {"linear_fwd_kernel": (30.0, 64), "sm90_xmma_gemm_x": (50.0, 10), "rms_norm_fwd_kernel": (5.0, 65), "x": (1.0, 1)}
    summary = summarise_kernels(kernels, top=2)
    assert summary["device_ms"] == 86.0
    assert list(summary["categories"]) == ["matmul (cuBLAS)", "tiletune linear", "rms_norm", "other"]
    assert [k["name"] for k in summary["kernels"]] == ["sm90_xmma_gemm_x", "linear_fwd_kernel"]
    text = profile_table({"baseline": summary, "all": summarise_kernels({"sm90_xmma_gemm_x": (40.0, 10)})})
    assert "| matmul (cuBLAS) | 50.0 | 40.0 |" in text and "| tiletune linear | 30.0 | 0.0 |" in text
    assert "| **total** | **86.0** | **40.0** |" in text and "### all: heaviest kernels" in text
