"""bench --profile: kernel names sorted into categories, and the table a person reads."""

import pytest

from tiletune.bench.profile import BACKWARD_ENGINE, BEFORE_STEP, category, profile_table, summarise_kernels, summarise_peak


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


def _event(action, addr, size, file=None, line=0):
    frames = [{"filename": "/x/site-packages/torch/nn/functional.py", "line": 1, "name": "linear"}]
    frames += [{"filename": f"/repo/src/{file}", "line": line, "name": "f"}] if file else []
    return {"action": action, "addr": addr, "size": size, "frames": frames if file else []}


def test_memory_peak_names_what_is_live_at_the_peak():
    mib = 2**20
    events = [
        _event("alloc", 1, 100 * mib, "tiletune/kernels/moe_experts.py", 171),
        _event("alloc", 2, 50 * mib, "transformers/models/x.py", 9),
        _event("free_completed", 2, 50 * mib),
        _event("alloc", 3, 30 * mib),  # from the C++ backward: no Python frame
        _event("free_completed", 9, 20 * mib),  # allocated before the trace: comes off what the step started with
        _event("alloc", 4, 60 * mib, "transformers/models/x.py", 9),  # the peak: 1000 - 20 + 100 + 30 + 60
        _event("free_completed", 1, 100 * mib),
    ]
    summary = summarise_peak(events, before=1000 * mib)
    assert summary["peak_gib"] * 1024 == pytest.approx(1170)
    sites = {site["site"]: site["gib"] * 1024 for site in summary["sites"]}
    assert sites == pytest.approx({BEFORE_STEP: 980, "tiletune/kernels/moe_experts.py:171 f": 100,
                                   "transformers/models/x.py:9 f": 60, BACKWARD_ENGINE: 30})
    text = profile_table({"all": {**summarise_kernels({"x": (1.0, 1)}), "memory": summary}})
    assert "### all: live at the step's peak (1.14 GiB allocated)" in text
    assert "| 0.10 | `tiletune/kernels/moe_experts.py:171 f` |" in text


def test_the_gpus_idle_time_is_the_span_less_the_union_of_its_busy_intervals():
    """Overlapping kernels (two streams) count once; the gaps between them are idle time."""
    from tiletune.bench.profile import host_side

    side = host_side([(0.0, 2.0), (1.0, 3.0), (5.0, 6.0), (5.5, 5.8)], launches=4, waits=1)
    assert side == {"span_ms": 6.0, "idle_ms": 2.0, "launches": 4, "host_waits": 1}
    assert host_side([], 0, 0)["idle_ms"] == 0.0
    summary = {**summarise_kernels({"x": (1.0, 1)}), **side}
    text = profile_table({"baseline": summary})
    assert "| GPU idle within the step, ms | 2.0 |" in text and "| kernel launches | 4 |" in text


def test_the_host_events_are_the_heaviest_by_their_own_cpu_time_and_reach_the_table():
    from tiletune.bench.profile import host_events

    events = host_events([("aten::copy_", 3.0, 40), ("tiletune::rope", 9.5, 24), ("cudaLaunchKernel", 6.0, 2700)], top=2)
    assert events == [{"name": "tiletune::rope", "ms": 9.5, "calls": 24}, {"name": "cudaLaunchKernel", "ms": 6.0, "calls": 2700}]
    text = profile_table({"all": {**summarise_kernels({"x": (1.0, 1)}), "host_events": events}})
    assert "### all: host events by their own CPU time" in text and "| 9.5 | 24 | `tiletune::rope` |" in text
