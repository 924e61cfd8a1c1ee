"""The held-out evaluation under benchmarks/hipify_eval: ground truth is well formed, the score runs offline."""

import functools
import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest

EVAL = Path(__file__).resolve().parents[2] / "benchmarks" / "hipify_eval"
PORTS = sorted((EVAL / "ports").glob("*.json"))


@functools.cache
def _score_module():
    spec = importlib.util.spec_from_file_location("hipify_eval_score", EVAL / "score.py")
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("path", PORTS, ids=lambda p: p.stem)
def test_ground_truth_names_a_pinned_source_and_known_classes(path):
    score = _score_module()
    port = json.loads(path.read_text())
    assert port["name"] == path.stem
    assert len(port["cuda"]["commit"]) == len(port["hip"]["commit"]) == 40
    # the files hold labels and line numbers, never the source: NVIDIA's source code license (StyleGAN3's
    # filtered_lrelu in mmcv), Hugging Face's HFOIL (text-generation-inference in 2024) and Inria's non-commercial
    # Gaussian-Splatting license (diff-gaussian-rasterization), the LGPL of OpenMM's CUDA platform and GROMACS, LAMMPS'
    # GPL (and Grid's and GPUMD's), Aphrodite's AGPL, QMCPACK's NCSA, Eigen's MPL, BabelStream's own (STREAM's terms
    # with its run rules), Rodinia's (BSD-style, with a citation request), ELPA's LGPL and SiftGPU's non-commercial
    # license (in COLMAP) are named as the repository had them
    assert port["license"] in {"Apache-2.0", "BSD-2-Clause", "BSD-3-Clause", "MIT", "LicenseRef-NVIDIA-Source-Code",
                               "HFOIL-1.0", "LicenseRef-Gaussian-Splatting", "LGPL-3.0-or-later", "NCSA", "LGPL-2.1-or-later",
                               "GPL-2.0-only", "GPL-2.0-or-later", "GPL-3.0-or-later", "Apache-2.0 OR MIT",
                               "BSD-3-Clause-LBNL", "MPL-2.0", "AGPL-3.0-only", "LicenseRef-BabelStream",
                               "LicenseRef-Rodinia", "GPL-3.0-only", "LGPL-3.0-only", "LicenseRef-SiftGPU"}  # fmt: skip
    for change in port["changes"]:
        first, last = change["lines"]
        assert 1 <= first <= last and change["class"] in {*score.CLASSES, *score.EXCLUDED, score.OBSOLETE}
    assert all(label.startswith(("pitfall:", "false:")) for label in port["findings"].values())
    assert all(re.fullmatch(r"[A-Za-z_]\w*", name) for name in port.get("project_macros", ()))


def test_score_runs_offline_on_the_cache(capsys):
    score = _score_module()
    if not all(score.cached(p["repo"], p["cuda"]["commit"], p["cuda"]["path"]).exists() for p in score.load_ports()):
        pytest.skip("the CUDA originals are not cached: run `python benchmarks/hipify_eval/score.py --fetch` online once")
    assert score.main([]) == 0
    table = capsys.readouterr().out
    assert "| **all** |" in table and "Missed, by class:" in table


@pytest.mark.parametrize("runtime_include, lines, note, covered", [
    ("", [3, 3], "", 1),
    ("", [2, 3], "anchor: inserted after the project's include", 1),  # the labelled lines hold the anchor's include
    ("", [2, 3], "", 1),  # an include among the lines, no anchor: the translation puts its include there too
    ("#include <cuda_runtime.h>\n", [4, 4], "", 0),
])  # fmt: skip
def test_an_inserted_runtime_include_counts_where_the_translation_inserts_it_in_a_file_without_one(
        tmp_path, monkeypatch, runtime_include, lines, note, covered):  # fmt: skip
    """The humans added `#include <hip/hip_runtime.h>` after the project's include (line 3, or labelled with its
    anchor, the include at line 2); the torch engine adds it before the first include of a file with kernel syntax.
    Where the file includes the CUDA runtime itself, the translation renames that include in place and the insertion
    is not counted."""
    score = _score_module()
    source = tmp_path / "kernel.cu"
    source.write_text(f'{runtime_include}// a kernel\n#include "project.h"\n\n__global__ void k(float* x) {{ x[threadIdx.x] = 0; }}\n')
    monkeypatch.setattr(score, "cached", lambda repo, commit, path: tmp_path / path)
    port = {"name": "synthetic", "repo": "o/r", "cuda": {"commit": "0" * 40, "path": "kernel.cu"},
            "changes": [{"lines": lines, "class": "runtime-header", "note": note}]}
    missed = score.Counter()
    result = score.score_port(port, score.select_engine("torch"), missed, [])
    assert (result.changes, result.covered) == (1, covered) and missed["runtime-header"] == 1 - covered


@pytest.mark.parametrize("undefined, covered", [(["SIZEOF_CUFLOATCOMPLEX"], 2), ([], 0)])
def test_a_conditionals_else_and_endif_are_covered_with_its_if(tmp_path, monkeypatch, undefined, covered):
    """The humans removed `#if SIZEOF_CUFLOATCOMPLEX == 8` ... `#else` ... `#endif` (one edit, labelled as the #if
    line and its #else / #endif lines): a finding on the #if (the HIP build leaves the size undefined) covers both;
    without it neither is covered: the #else / #endif lines are not covered by themselves."""
    score = _score_module()
    source = tmp_path / "reduce.cu"
    source.write_text("#if SIZEOF_CUFLOATCOMPLEX == 8\n  case 1: run(); break;\n#else\n  case 1: return -1;\n#endif\n"
                      "int unrelated;\n#if SIZEOF_CUDOUBLECOMPLEX == 16\n#endif\n")
    monkeypatch.setattr(score, "cached", lambda repo, commit, path: tmp_path / path)
    port = {"name": "synthetic", "repo": "o/r", "cuda": {"commit": "0" * 40, "path": "reduce.cu"},
            "hip_build": {"undefined": undefined},
            "changes": [{"lines": [1, 1], "class": "build-flag-guard"}, {"lines": [3, 5], "class": "build-flag-guard"}]}
    result = score.score_port(port, score.select_engine("torch"), score.Counter(), [])
    assert (result.changes, result.covered) == (2, covered)


@pytest.mark.parametrize("twins, covered", [(["hipCheckOnDebug", "HipDevice"], 2), (["hipCheckOnDebug"], 1), ([], 0)])
def test_a_project_backend_rename_counts_where_the_projects_twin_is_called(tmp_path, monkeypatch, twins, covered):
    """The humans called the project's HIP twins (`hipCheckOnDebug`, `DataSpace::HipDevice`): the translation covers
    a line where `tiletune hipify --project` finds the twin in the project's index; a line that keeps a CUDA-spelled
    name of the project is not covered, whatever else on it was translated (`cudaMemset` -> `hipMemset`)."""
    score = _score_module()
    (tmp_path / "memory.cu").write_text("void f(char* p) {\n  cudaMemset(p, 0, 8);\n  cudaCheckOnDebug();\n"
                                        "  cudaMemset(p, 0, 8); allocData(DataSpace::CudaDevice, p);\n}\n")
    (tmp_path / score.TWINS_INDEX).write_text(score.json.dumps({"excluded": [], "names": twins, "paths": []}))
    monkeypatch.setattr(score, "cached", lambda repo, commit, path: tmp_path / path)
    port = {"name": "synthetic", "repo": "o/r", "cuda": {"commit": "0" * 40, "path": "memory.cu"},
            "changes": [{"lines": [3, 3], "class": "project-backend-api"}, {"lines": [4, 4], "class": "project-backend-api"}]}
    result = score.score_port(port, score.select_engine("torch"), score.Counter(), [])
    assert (result.changes, result.covered) == (2, covered)
