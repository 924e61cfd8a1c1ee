"""`tiletune hipify` end to end: output tree, untouched input, in-place backups, statistics, CLI."""

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from tiletune.cli import main
from tiletune.errors import UserError
from tiletune.port.hipify import run_hipify
from tiletune.port.report import to_text

from port_corpus import CLEAN_SAMPLE, CORPUS, SAMPLES, expected_findings


def _digest(tree: Path) -> dict[str, str]:
    return {str(p.relative_to(tree)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(tree.rglob("*")) if p.is_file()}


@pytest.fixture
def tree(tmp_path) -> Path:
    """A copy of the corpus with a nested directory, as a user's csrc/ would look."""
    root = tmp_path / "csrc"
    shutil.copytree(CORPUS, root)
    (root / "ops").mkdir()
    shutil.move(root / "softmax_ballot.cu", root / "ops" / "softmax_ballot.cu")
    (root / "ops" / "softmax_ballot.cu").write_text(
        (root / "ops" / "softmax_ballot.cu").read_text().replace('"common.cuh"', '"../common.cuh"'))
    return root


def test_out_mirrors_the_tree_and_leaves_the_input_untouched(tree, tmp_path):
    before = _digest(tree)
    report = run_hipify([str(tree)], str(tmp_path / "hip"), engine="torch")
    assert _digest(tree) == before
    out = tmp_path / "hip"
    assert (out / "ops" / "softmax_ballot.hip").is_file() and (out / "common.cuh").is_file()
    assert not list(out.rglob("*.cu"))
    assert "hipGetErrorString" in (out / "common.cuh").read_text()
    assert len(report.files) == len(before)


def test_statistics_count_translated_and_untranslated_cuda_names(tree, tmp_path):
    report = run_hipify([str(tree)], str(tmp_path / "hip"), engine="torch")
    files = {Path(f.source).name: f for f in report.files}
    clean = files["clean_silu_mul.cu"]
    assert clean.translated >= 8 and clean.left == {}  # CUDA_CHECK is the sample's own macro, not CUDA API
    assert files["wmma_gemm.cu"].left["wmma::fragment"] == 3
    assert "cutlass::half_t" in files["cutlass_gemm.cu"].left
    assert report.rule_counts()["wmma"] == 10


def test_cuda_names_the_translator_leaves_are_reported_never_nothing_left(tmp_path, monkeypatch):
    tools = tmp_path / "bin"
    tools.mkdir()
    (tools / "hipify-perl").write_text('#!/bin/sh\nfor f; do :; done; cat "$f"\n')  # translates nothing
    (tools / "hipify-perl").chmod(0o755)
    monkeypatch.setenv("PATH", f"{tools}{os.pathsep}{os.environ['PATH']}")
    source = tmp_path / "src" / "load.cu"
    source.parent.mkdir()
    source.write_text("#include <hipcub/hipcub.hpp>\n"
                      "using Load = cub::BlockLoad<float, 128, 4, cub::BLOCK_LOAD_WARP_TRANSPOSE>;\n"
                      "constexpr int kArch = CUB_PTX_ARCH;\n")
    report = run_hipify([str(source)], str(tmp_path / "hip"), engine="perl")
    assert report.findings == []
    assert report.files[0].left == {"cub::BlockLoad": 1, "cub::BLOCK_LOAD_WARP_TRANSPOSE": 1, "CUB_PTX_ARCH": 1}
    assert report.strict_failures() == ["3 CUDA-only name(s) left untranslated"]
    assert "nothing that needs a human" not in to_text(report)


def test_inplace_rewrites_with_backups_and_never_overwrites_a_backup(tmp_path):
    source = tmp_path / "silu.cu"
    shutil.copy(CLEAN_SAMPLE, source)
    shutil.copy(CLEAN_SAMPLE.parent / "common.cuh", tmp_path)
    original = source.read_text()
    report = run_hipify([str(tmp_path)], inplace=True, engine="torch")
    assert "hipMalloc" in source.read_text()
    assert (tmp_path / "silu.cu.prehip").read_text() == original
    assert report.destination == "in place"
    run_hipify([str(tmp_path)], inplace=True, engine="torch")
    assert (tmp_path / "silu.cu.prehip").read_text() == original
    assert not list(tmp_path.glob("*.prehip.prehip"))


def test_inplace_findings_point_at_the_rewritten_lines(tmp_path):
    for name in ("softmax_ballot.cu", "common.cuh"):
        shutil.copy(CORPUS / name, tmp_path)
    report = run_hipify([str(tmp_path)], inplace=True, engine="torch")
    rewritten = (tmp_path / "softmax_ballot.cu").read_text().splitlines()
    assert rewritten[2] == '#include "hip/hip_runtime.h"'  # the torch engine added a line before the first include
    assert [f.line for f in report.findings if f.rule == "warp-lane-loop"] == [34]
    assert all(finding.code in rewritten[finding.line - 1] for finding in report.findings)


def test_lint_only_translates_nothing(tree):
    before = _digest(tree)
    report = run_hipify([str(tree)], lint_only=True)
    assert report.files == [] and len(report.findings) > 40 and _digest(tree) == before


@pytest.mark.parametrize(("paths", "kwargs", "message"), [
    (["missing/dir"], {"out": "x"}, "no such file or directory"),
    ([str(CORPUS)], {}, "exactly one of --out DIR, --inplace"),
    ([str(CORPUS)], {"out": "x", "inplace": True}, "exactly one of"),
    ([str(CORPUS)], {"out": str(CORPUS / "hip")}, "inside the input directory"),
    ([str(CORPUS)], {"out": str(CORPUS)}, "inside the input directory"),
    ([str(CORPUS / "common.cuh")], {"out": str(CORPUS)}, "would overwrite the input"),
    ([str(CORPUS)], {"lint_only": True, "compile_check": True}, "--compile-check compiles the translation"),
    ([str(CORPUS)], {"out": "x", "offload_arch": "sm_90"}, "not an AMD GPU target"),
    ([__file__], {"out": "x"}, "not a CUDA/C\\+\\+ source"),
])
def test_user_mistakes_are_user_errors(paths, kwargs, message):
    with pytest.raises(UserError, match=message):
        run_hipify(paths, **kwargs)


def test_cli_text_report_and_report_files(tree, tmp_path):
    result = CliRunner().invoke(main, ["hipify", str(tree), "--out", str(tmp_path / "hip"), "--engine", "torch"])
    assert result.exit_code == 0, result.output
    assert "Findings by rule:" in result.stdout and "[warp-lane-loop]" in result.stdout
    assert "CUDA references translated" in result.stdout
    sarif = json.loads((tmp_path / "hip" / "hipify-report.sarif").read_text())
    assert sarif["version"] == "2.1.0"


def test_cli_strict_fails_on_errors_and_passes_on_clean_code(tree):
    runner = CliRunner()
    assert runner.invoke(main, ["hipify", str(tree), "--lint-only", "--strict"]).exit_code == 1
    clean = runner.invoke(main, ["hipify", str(CLEAN_SAMPLE), str(CORPUS / "common.cuh"), "--lint-only", "--strict"])
    assert clean.exit_code == 0 and "nothing that needs a human was found" in clean.stdout


def test_cli_takes_the_hip_builds_macros(tmp_path):
    """`-U FLAG` leaves code under `#ifdef FLAG` out of the lint (a flag the HIP build keeps off); `-D` and `-U` of one
    name is one line and exit 2."""
    source = tmp_path / "k.cu"
    source.write_text("#ifdef KERNEL_USE_FP8\n#include <cuda_fp8.h>\n#endif\n__global__ void k(float* x) { x[0] = 1.f; }\n")
    runner = CliRunner()
    flagged = runner.invoke(main, ["hipify", str(source), "--lint-only", "--format", "json"])
    assert flagged.exit_code == 0 and "fp8-type" in flagged.output
    off = runner.invoke(main, ["hipify", str(source), "--lint-only", "--format", "json", "-U", "KERNEL_USE_FP8"])
    assert off.exit_code == 0 and "fp8-type" not in off.output
    both = runner.invoke(main, ["hipify", str(source), "--lint-only", "-D", "KERNEL_USE_FP8", "-U", "KERNEL_USE_FP8"])
    assert both.exit_code == 2 and "KERNEL_USE_FP8 given to both --define and --undef" in both.output


def test_cli_takes_the_hip_builds_cxx_standard(tmp_path):
    """`--std c++11` (the HIP build's -std): `register`, an error under hipcc's default C++17, is not flagged."""
    source = tmp_path / "k.cu"
    source.write_text("__global__ void k(float* x) { register float v = x[0]; x[1] = v; }\n")
    runner = CliRunner()
    assert "register-storage" in runner.invoke(main, ["hipify", str(source), "--lint-only", "--format", "json"]).output
    older = runner.invoke(main, ["hipify", str(source), "--lint-only", "--format", "json", "--std", "c++11"])
    assert older.exit_code == 0 and "register-storage" not in older.output


def test_cli_json_on_stdout_is_parseable(tree):
    result = CliRunner().invoke(main, ["hipify", str(tree), "--lint-only", "--format", "json"])
    data = json.loads(result.stdout)
    marked = sum(rule == "mask-32bit" for sample in SAMPLES for _, rule in expected_findings(sample))
    assert data["stats"]["findings_by_rule"]["mask-32bit"] == marked


def test_cli_user_error_is_one_line_and_exit_2(tmp_path):
    result = CliRunner().invoke(main, ["hipify", str(tmp_path / "nope.cu"), "--out", str(tmp_path / "o")])
    assert result.exit_code == 2
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("tiletune: error:")


def test_explain_on_the_command_line_and_paths_required_otherwise():
    shown = CliRunner().invoke(main, ["hipify", "--explain", "block-32-threads"])
    assert shown.exit_code == 0 and "before (CUDA):" in shown.output and "after (HIP):" in shown.output
    unknown = CliRunner().invoke(main, ["hipify", "--explain", "no-such-rule"])
    assert unknown.exit_code == 2 and "no rule 'no-such-rule'" in unknown.output
    bare = CliRunner().invoke(main, ["hipify"])
    assert bare.exit_code == 2 and "needs PATHS" in bare.output
