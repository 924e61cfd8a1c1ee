"""`tiletune kernels lower` for every target without a GPU: sm_90 GEMMs use wgmma, gfx942 MFMA."""

import re

import pytest
from click.testing import CliRunner

from tiletune.cli import main
from tiletune.kernels import _tilelang

pytest.importorskip("tilelang", reason="TileLang is not installed or cannot be imported: pip install -e '.[test]'")

KERNELS = ["rms_norm_fwd", "rms_norm_bwd", "swiglu_fwd", "swiglu_bwd", "rope_fwd", "rope_bwd", "rope_pairs_fwd", "rope_pairs_bwd",
           "linear_fwd", "linear_dgrad", "linear_wgrad", "lora_linear_fwd", "lora_linear_dgrad",
           "attention_fwd", "attention_bwd_preprocess", "attention_bwd", "attention_fwd_varlen", "attention_bwd_varlen",
           "dequantize_nf4", "geglu_fwd", "geglu_bwd", "swiglu_fwd_packed", "swiglu_bwd_packed", "geglu_fwd_packed",
           "geglu_bwd_packed", "swiglu_bwd_packed_dots", "geglu_bwd_packed_dots",
           "grouped_gemm_nt", "grouped_gemm_nn", "grouped_gemm_nt_gathered", "grouped_gemm_nn_gathered",
           "merge_routes_weighted", "merge_routes", "linear_logprobs_fwd", "linear_logprobs_bwd", "cross_entropy_grad"]


# The packed (varlen) attention kernels are the plain kernels' source with segment bounds (the same per-arch configs
# and matrix-unit code), the gathered grouped GEMMs the plain ones with an indexed tile load: lowered on one CUDA and
# one HIP target, the plain ones on sm_80 and gfx1100 too. gfx90a (MI200) shares gfx942's wave64 and MFMA paths: a
# wave reduction, a GEMM and attention stand for them there.
PRIMARY_TARGETS = ("cuda:sm_90", "hip:gfx942")
PRIMARY_ONLY = ("attention_fwd_varlen", "attention_bwd_varlen", "grouped_gemm_nt_gathered", "grouped_gemm_nn_gathered")
SAMPLED = {"hip:gfx90a": ("rms_norm_fwd", "linear_fwd", "attention_fwd", "attention_bwd")}


def kernels_for(target: str) -> list[str]:
    if target in SAMPLED:
        return list(SAMPLED[target])
    return KERNELS if target in PRIMARY_TARGETS else [k for k in KERNELS if k not in PRIMARY_ONLY]


@pytest.fixture(scope="module")  # lowered once: the README's `--dist loadfile` keeps this module on one worker
def lowered(tmp_path_factory):
    out = tmp_path_factory.mktemp("lowered")
    groups: dict[tuple[str, ...], list[str]] = {}  # one `kernels lower` per list of kernels
    for target in _tilelang.KNOWN_TARGETS:
        groups.setdefault(tuple(kernels_for(target)), []).append(target)
    for kernels, targets in groups.items():
        args = ["kernels", "lower", "--out", str(out)]
        for target in targets:
            args += ["--target", target]
        for kernel in kernels if kernels != tuple(KERNELS) else ():
            args += ["--kernel", kernel]
        result = CliRunner().invoke(main, args)
        assert result.exit_code == 0, result.output
    return out


def test_the_kernel_list_is_what_lower_writes():
    from tiletune.kernels.lowering import kernel_names

    assert sorted(kernel_names()) == sorted(KERNELS)


@pytest.mark.parametrize("target", _tilelang.KNOWN_TARGETS)
def test_every_kernel_lowers_for_every_target(lowered, target):
    """Each target's kernels (kernels_for) lowered to a source with a __global__ function."""
    folder = lowered / target.replace(":", "-")
    suffix = ".cu" if target.startswith("cuda") else ".hip"
    assert sorted(p.name for p in folder.iterdir()) == sorted(k + suffix for k in kernels_for(target))
    for name in kernels_for(target):
        assert "__global__" in (folder / f"{name}{suffix}").read_text()


@pytest.mark.parametrize("target", PRIMARY_TARGETS)
def test_packed_attention_reads_segment_bounds_and_the_plain_kernels_do_not(lowered, target):
    """The varlen forward and backward take the packed sequences' bounds; the plain kernels of the same source none."""
    suffix = ".cu" if target.startswith("cuda") else ".hip"
    folder = lowered / target.replace(":", "-")
    fwd, bwd = ((folder / f"attention_{kind}_varlen{suffix}").read_text() for kind in ("fwd", "bwd"))
    assert "attention_fwd_varlen_kernel" in fwd and "int* __restrict__ Starts" in fwd and "bfloat16_t* __restrict__ O" in fwd
    assert "attention_bwd_varlen_kernel" in bwd and "int* __restrict__ Ends" in bwd and "float* __restrict__ dQ" in bwd
    assert "LSE_desc" not in bwd and "Delta_desc" not in bwd  # float32 rows of any length: no TMA descriptor
    plain = (folder / f"attention_fwd{suffix}").read_text()
    assert "attention_fwd_kernel" in plain and "Starts" not in plain


def test_an_unknown_kernel_name_is_a_user_error(tmp_path):
    result = CliRunner().invoke(main, ["kernels", "lower", "--kernel", "attention_fwd2", "--out", str(tmp_path)])
    assert result.exit_code == 2 and "unknown kernel 'attention_fwd2'" in result.output


@pytest.mark.parametrize("name", ["linear_fwd", "linear_dgrad", "linear_wgrad", "lora_linear_fwd", "lora_linear_dgrad",
                                  "grouped_gemm_nt", "grouped_gemm_nn", "grouped_gemm_nt_gathered",
                                  "grouped_gemm_nn_gathered", "linear_logprobs_fwd", "linear_logprobs_bwd"])
def test_sm90_gemms_use_wgmma_and_gfx942_mfma(lowered, name):
    assert "wgmma" in (lowered / "cuda-sm_90" / f"{name}.cu").read_text()
    assert "mfma" in (lowered / "hip-gfx942" / f"{name}.hip").read_text().lower()


def test_lora_epilogue_adds_the_low_rank_operands_to_the_gemm(lowered):
    """The lora kernels take the low-rank operands L and R; the plain linear kernels are unchanged by them."""
    for target, suffix in (("cuda-sm_90", ".cu"), ("hip-gfx942", ".hip")):
        for kind in ("fwd", "dgrad"):
            lora = (lowered / target / f"lora_linear_{kind}{suffix}").read_text()
            plain = (lowered / target / f"linear_{kind}{suffix}").read_text()
            assert "__restrict__ L" in lora and "__restrict__ R" in lora
            assert "__restrict__ L" not in plain
    # one more wgmma block than the plain forward: the rank-16 epilogue into the same accumulator
    fwd = (lowered / "cuda-sm_90" / "lora_linear_fwd.cu").read_text()
    assert fwd.count("wgmma_ss<") == (lowered / "cuda-sm_90" / "linear_fwd.cu").read_text().count("wgmma_ss<") + 1


@pytest.mark.parametrize("target,suffix,matrix", [("cuda-sm_90", ".cu", "wgmma"), ("cuda-sm_80", ".cu", "mma_sync"),
                                                  ("hip-gfx942", ".hip", "mfma"), ("hip-gfx90a", ".hip", "mfma"),
                                                  ("hip-gfx1100", ".hip", "wmma")])
def test_attention_kernels_use_the_matrix_units_and_a_dynamic_sequence(lowered, target, suffix, matrix):
    """Both attention GEMM kernels on the matrix units; seq a kernel argument; dQ added atomically."""
    fwd = (lowered / target / f"attention_fwd{suffix}").read_text()
    bwd = (lowered / target / f"attention_bwd{suffix}").read_text()
    for source in (fwd, bwd):
        assert matrix in source.lower() and "int seq" in source and "int batch" in source
    assert "exp2" in fwd and "atomicadd" in bwd.lower().replace("_", "")
    if suffix == ".hip":  # loads past the sequence end are zero-filled, which the kernels rely on
        assert "< seq)" in fwd and "make_uint4(" in fwd


def test_rope_pairs_reads_float32_angles_per_pair(lowered):
    """Llama 4's layout: cos and sin stay float32 (its freqs_cis precision), one per pair of head dimensions;
    the halves layout reads them in the input dtype."""
    for target, suffix in (("cuda-sm_90", ".cu"), ("hip-gfx942", ".hip")):
        for kind in ("fwd", "bwd"):
            assert "float* __restrict__ C" in (lowered / target / f"rope_pairs_{kind}{suffix}").read_text()
            assert "float* __restrict__ C" not in (lowered / target / f"rope_{kind}{suffix}").read_text()


def test_unknown_target_is_a_user_error(tmp_path):
    result = CliRunner().invoke(main, ["kernels", "lower", "--target", "cuda:90", "--out", str(tmp_path)])
    assert result.exit_code == 2 and "unknown target 'cuda:90'" in result.output


def test_kernels_list_says_what_runs_here():
    result = CliRunner().invoke(main, ["kernels"])
    assert result.exit_code == 0
    for text in ("rms_norm", "swiglu", "rope", "linear", "lora_linear", "reference", "tilelang", "kernel cache", "target here"):
        assert text in result.output


def test_grouped_gemm_reads_its_tile_schedule_and_stores_only_its_experts_rows(lowered):
    """Each tile's expert, first row and end come from the schedule; the store is bounded by the expert's end."""
    for target, suffix in (("cuda-sm_90", ".cu"), ("hip-gfx942", ".hip")):
        for kind in ("nt", "nn"):
            source = (lowered / target / f"grouped_gemm_{kind}{suffix}").read_text()
            assert "tiles[" in source and "int rows" in source
            assert "(int64_t)2)]" in source  # the tile's end row bounds the store


def test_the_gathered_grouped_gemm_loads_its_rows_through_the_token_index(lowered):
    """The gathered kernels take the token of each row and read the input through it, asynchronously on sm_90 (cp.async,
    in a software pipeline of the config's 256 threads: the kernel's own pass configs turn warp specialization off,
    whose producer warpgroup left too few registers); the plain kernels take no index and keep it (TMA loads, 384)."""
    for target, suffix in (("cuda-sm_90", ".cu"), ("hip-gfx942", ".hip")):
        for kind in ("nt", "nn"):
            gathered = (lowered / target / f"grouped_gemm_{kind}_gathered{suffix}").read_text()
            assert "token[min(" in gathered and "int tokens" in gathered  # each row's token, the tile's rows clamped
            assert "token" not in (lowered / target / f"grouped_gemm_{kind}{suffix}").read_text()
    sm90 = (lowered / "cuda-sm_90" / "grouped_gemm_nt_gathered.cu").read_text()
    assert re.search(r"cp_async\w*<16>\(.*X\[\(*token\[", sm90) and "__launch_bounds__(256" in sm90
    assert "__launch_bounds__(384" in (lowered / "cuda-sm_90" / "grouped_gemm_nt.cu").read_text()
