"""`tiletune env`: arch detection helpers, matrix checks, and the command on this machine."""

import json
import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from tiletune.cli import main
from tiletune.env import (
    EnvReport,
    Gpu,
    check_environment,
    Check,
    arch_supports,
    compat_matrix,
    gfx_from_target_version,
    kfd_gpus,
    known_bad_checks,
    nvidia_smi_gpus,
    package_checks,
    required_minimums,
    requirement_checks,
    tilelang_target,
)


@pytest.mark.parametrize(("arch", "target"), [
    ("sm_90", {"kind": "cuda", "arch": "sm_90a"}),
    ("sm_80", {"kind": "cuda", "arch": "sm_80"}),
    ("gfx942", {"kind": "hip", "mcpu": "gfx942"}),
    ("gfx90a:sramecc+:xnack-", {"kind": "hip", "mcpu": "gfx90a"}),
    ("gfx1100", {"kind": "hip", "mcpu": "gfx1100"}),
    ("cpu", None),
])
def test_tilelang_target_for_an_arch(arch, target):
    assert tilelang_target(arch) == target


@pytest.mark.parametrize(("value", "name"), [(90010, "gfx90a"), (90402, "gfx942"), (110000, "gfx1100"), (90008, "gfx908")])
def test_kfd_target_versions_decode_to_gfx_names(value, name):
    assert gfx_from_target_version(value) == name


def test_kfd_topology_lists_gpus_and_skips_cpus(tmp_path):
    cpu, gpu = tmp_path / "0", tmp_path / "1"
    (gpu / "mem_banks" / "0").mkdir(parents=True)
    cpu.mkdir()
    (cpu / "properties").write_text("cpu_cores_count 64\ngfx_target_version 0\n")
    (gpu / "properties").write_text("simd_count 1216\ngfx_target_version 90402\n")
    (gpu / "mem_banks" / "0" / "properties").write_text(f"heap_type 1\nsize_in_bytes {192 * 2**30}\n")
    gpu_found, = kfd_gpus(tmp_path)
    assert (gpu_found.vendor, gpu_found.arch, gpu_found.memory_gib) == ("amd", "gfx942", 192.0)


def test_nvidia_smi_output_is_parsed(tmp_path, monkeypatch):
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'NVIDIA H200, 143771, 9.0, 570.86.15'\n")
    smi.chmod(smi.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    (gpu,), driver = nvidia_smi_gpus()
    assert (gpu.name, gpu.arch, gpu.memory_gib, driver) == ("NVIDIA H200", "sm_90", 140.4, "570.86.15")


def test_precision_support_by_arch():
    assert arch_supports("sm_90", "bf16") and arch_supports("gfx942", "bf16") and arch_supports("gfx1100", "bf16")
    assert not arch_supports("sm_75", "bf16") and arch_supports("sm_75", "fp16")


def test_matrix_is_well_formed():
    matrix = compat_matrix()
    assert {"torch", "transformers", "peft", "accelerate", "datasets", "deepspeed", "tilelang", "triton",
            "liger-kernel"} <= matrix["packages"].keys()
    for rule in matrix["known_bad"]:
        assert rule["level"] in ("warn", "fail") and rule["message"] and rule["fix"] and rule["when"]


def test_floors_of_tiletunes_own_requirements_come_from_pyproject():
    """One place for a floor: pyproject.toml (read from the installed metadata), no second copy in the matrix."""
    pyproject = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    for name in ("torch", "transformers", "peft", "accelerate", "datasets", "deepspeed", "tilelang"):
        floor = re.search(rf'"{name}(?:>=|==)([0-9.]+)"', pyproject).group(1)
        assert compat_matrix()["packages"][name]["min"] == floor, name
    assert compat_matrix()["packages"]["triton"]["min"] == "3.0"  # not a requirement of tiletune: the matrix's own


def test_required_minimums_read_every_lower_bound():
    requirements = ["torch>=2.4", 'tilelang==0.1.15; extra == "tilelang"', "Foo_Bar~=1.2", "pytest", "x<3"]
    assert required_minimums(requirements) == {"torch": "2.4", "tilelang": "0.1.15", "foo-bar": "1.2"}


@pytest.mark.parametrize(("facts", "fired"), [
    ({"gpu.arch": "sm_120", "torch.cuda": "12.6"}, {"blackwell-needs-cuda-12.8"}),
    ({"gpu.arch": "sm_120", "torch.cuda": "12.8"}, set()),
    ({"gpu.arch": "gfx942", "torch.hip": "5.7.31921-d1770ee1b"}, {"mi300-needs-rocm-6"}),
    ({"gpu.arch": "gfx942", "torch.hip": "6.4.43482-0f2d60242"}, set()),
    ({"tilelang": "0.1.15", "z3-solver": None}, {"tilelang-needs-z3"}),
    ({"tilelang": "0.1.15", "z3-solver": "4.15.4.0"}, set()),
    ({"tilelang": "0.1.15", "z3-solver": "4.15.4.0", "gpu.vendor": "amd", "hipcc": "5.2.21153"},
     {"tilelang-hip-needs-rocm-6", "old-hipcc-compile-check-only"}),
    ({"liger-kernel": "0.6.0", "triton": None}, {"liger-needs-triton"}),
])
def test_known_bad_combinations(facts, fired):
    assert {check.subject for check in known_bad_checks(facts, compat_matrix()["known_bad"])} == fired


def test_package_checks_levels():
    spec = compat_matrix()["packages"]
    versions = {name: None for name in spec} | {"torch": "2.3.1+cu121", "peft": "0.17.0", "tilelang": "0.1.2"}
    levels = {check.subject: check.level for check in package_checks(versions, spec)}
    assert levels["torch"] == "fail" and levels["transformers"] == "fail"  # too old; required and missing
    assert levels["peft"] == "pass" and levels["tilelang"] == "warn" and levels["deepspeed"] == "info"


def test_requirement_conflicts_between_installed_packages():
    versions = {"torch": "2.7.1", "triton": "3.4.0", "peft": "0.17.0"}
    requires = {
        "torch": ['triton==3.3.1; platform_system == "Linux"', 'optree>=0.13; extra == "optree"'],
        "peft": ["torch>=1.13.0", "transformers"],
    }
    conflict, = requirement_checks(versions, requires)
    assert conflict == Check("fail", "torch -> triton", "torch 2.7.1 requires triton==3.3.1, found 3.4.0",
                             "pip install 'triton==3.3.1' (or a torch release that accepts triton 3.4.0)")


def test_env_command_text_and_json():
    runner = CliRunner()
    text = runner.invoke(main, ["env"])
    assert text.exit_code == 0, text.output
    assert "Checks (compat_matrix.yaml):" in text.stdout and "Summary:" in text.stdout
    data = json.loads(runner.invoke(main, ["env", "--json"]).stdout)
    assert data["torch"]["version"] and {"level", "subject", "message", "fix"} <= data["checks"][0].keys()
    assert set(data["packages"]) >= {"transformers", "peft", "tilelang", "liger-kernel"}


def test_env_reads_versions_without_importing_tilelang(tmp_path):
    """A tilelang that explodes on import must not be imported; its metadata is still read."""
    (tmp_path / "tilelang").mkdir()
    (tmp_path / "tilelang" / "__init__.py").write_text("raise RuntimeError('tilelang was imported')\n")
    dist_info = tmp_path / "tilelang-9.9.9.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: tilelang\nVersion: 9.9.9\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))}
    result = subprocess.run([sys.executable, "-m", "tiletune", "env", "--json"], capture_output=True, text=True,
                            env=env, check=False)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["packages"]["tilelang"] == "9.9.9"


def test_help_does_not_import_the_port_or_env_modules():
    code = "import sys; from tiletune.cli import main; print(sorted(m for m in sys.modules if m.startswith(('tiletune.port', 'tiletune.env', 'torch'))))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


def _report(**overrides) -> EnvReport:
    facts = dict(
        python="3.11.7", system="Linux x86_64",
        torch={"version": "2.8.0+cu128", "cuda": "12.8", "hip": None, "arch_list": ["sm_80", "sm_86", "sm_90", "compute_90"]},
        gpus=[Gpu("nvidia", "NVIDIA H200", "sm_90", 139.8, "torch")], driver={"nvidia": "570.86.15"},
        packages={"torch": "2.8.0", "tilelang": "0.1.15"},
        toolchains={"nvcc": {"path": "/usr/local/cuda/bin/nvcc", "version": "12.8"}, "hipcc": {"path": None, "version": None}},
        tilelang_target={"kind": "cuda", "arch": "sm_90a"},
    )
    return EnvReport(**(facts | overrides))


def _levels(report: EnvReport, probed=()) -> dict[str, str]:
    return {check.subject: check.level for check in check_environment(report, list(probed), {})}


def test_a_supported_nvidia_machine_passes_gpu_target_driver_and_nvcc():
    levels = _levels(_report())
    assert levels["GPU NVIDIA H200"] == "pass" and levels["TileLang target"] == "pass"
    assert levels["NVIDIA driver"] == "pass" and levels["nvcc"] == "pass"


def test_gpu_newer_than_the_torch_build_fails():
    gpu = Gpu("nvidia", "RTX 5090", "sm_120", 31.4, "torch")
    report = _report(gpus=[gpu], torch=_report().torch | {"cuda": "12.6", "arch_list": ["sm_80", "sm_86", "sm_90"]})
    checks = check_environment(report, [], {})
    assert {"blackwell-needs-cuda-12.8"} <= {c.subject for c in checks if c.level == "fail"}
    assert any(c.level == "fail" and "not built for sm_120" in c.message for c in checks)


def test_gpu_present_but_cpu_torch_fails_with_the_wheel_to_install():
    report = _report(gpus=[], torch={"version": "2.8.0+cpu", "cuda": None, "hip": None, "arch_list": []}, tilelang_target=None)
    gpu_check, = (c for c in check_environment(report, [Gpu("amd", "AMD GPU", "gfx942", 192.0, "kfd")], {}) if c.subject == "GPU")
    assert gpu_check.level == "fail" and "rocm" in gpu_check.fix


def test_old_driver_nvcc_mismatch_and_no_bf16():
    report = _report(gpus=[Gpu("nvidia", "Tesla T4", "sm_75", 15.0, "torch")], driver={"nvidia": "515.65.01"},
                     toolchains=_report().toolchains | {"nvcc": {"path": "/usr/bin/nvcc", "version": "11.8"}},
                     torch=_report().torch | {"arch_list": ["sm_75", "sm_80"]}, tilelang_target={"kind": "cuda", "arch": "sm_75"})
    checks = {(c.subject, c.level) for c in check_environment(report, [], {})}
    assert {("NVIDIA driver", "fail"), ("nvcc", "warn"), ("GPU Tesla T4", "warn"), ("TileLang target", "warn")} <= checks
