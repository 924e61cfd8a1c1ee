"""`tiletune env`: what this machine offers (GPU, torch build, libraries, compilers) and whether it fits.

Versions come from package metadata (importlib.metadata): nothing heavy is imported except torch,
which is the only way to know what the torch build sees. The checks compare the facts with
`compat_matrix.yaml` and give pass / warn / fail lines with a fix for each.

`gpu_arch()` and `tilelang_target()` are the small public pieces the kernel library reuses.
"""

from __future__ import annotations

import fnmatch
import importlib.metadata
import importlib.resources
import json
import os
import platform
import re
import shutil
import subprocess
from dataclasses import asdict, dataclass, field
from functools import cache
from pathlib import Path

import yaml
from packaging.requirements import InvalidRequirement, Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

from tiletune.hipcc import find_hipcc, hipcc_version

KFD_TOPOLOGY = Path("/sys/class/kfd/kfd/topology/nodes")
LEVELS = ("pass", "info", "warn", "fail")


@dataclass
class Gpu:
    """One GPU: vendor ("nvidia" / "amd"), marketing name, arch ("sm_90" / "gfx942"), memory."""

    vendor: str
    name: str
    arch: str
    memory_gib: float | None
    found_by: str


@dataclass
class Check:
    """One line of the verdict: level (pass / info / warn / fail), what, and the fix when not passing."""

    level: str
    subject: str
    message: str
    fix: str = ""


@dataclass
class EnvReport:
    """Everything `tiletune env` found, and the checks against the compatibility matrix."""

    python: str
    system: str
    torch: dict
    gpus: list[Gpu]
    driver: dict
    packages: dict[str, str | None]
    toolchains: dict[str, dict]
    tilelang_target: dict | None
    checks: list[Check] = field(default_factory=list)

    @property
    def failed(self) -> bool:
        """True when any check failed."""
        return any(check.level == "fail" for check in self.checks)


# ---- small public helpers ------------------------------------------------------------------------


@cache
def compat_matrix() -> dict:
    """The compatibility matrix shipped with tiletune (compat_matrix.yaml), each package's `min` taken from
    tiletune's own requirement on it where it has one (pyproject.toml, as installed), not from a second copy."""
    text = importlib.resources.files("tiletune").joinpath("compat_matrix.yaml").read_text(encoding="utf-8")
    matrix = yaml.safe_load(text)
    floors = required_minimums(importlib.metadata.requires("tiletune") or [])
    for name, entry in matrix["packages"].items():
        entry["min"] = floors.get(canonicalize_name(name), entry.get("min"))
    return matrix


def required_minimums(requirements: list[str]) -> dict[str, str]:
    """The lowest version each requirement (extras' included) allows, by canonical name: its `>=`, `==` or `~=`."""
    floors = {}
    for text in requirements:
        requirement = Requirement(text)
        for spec in requirement.specifier:
            if spec.operator in (">=", "==", "~="):
                floors[canonicalize_name(requirement.name)] = spec.version
    return floors


def gpu_arch(device: int = 0) -> str | None:
    """Architecture of visible GPU `device` as compilers name it ("sm_90", "gfx942"), or None."""
    import torch

    if not torch.cuda.is_available() or device >= torch.cuda.device_count():
        return None
    props = torch.cuda.get_device_properties(device)
    if torch.version.hip:
        return props.gcnArchName.split(":")[0]
    return f"sm_{props.major}{props.minor}"


def tilelang_target(arch: str | None = None) -> dict | None:
    """The TileLang target dict for `arch` (default: GPU 0), e.g. {"kind": "hip", "mcpu": "gfx942"}.

    sm_90 becomes sm_90a: TileLang's Hopper kernels (wgmma, TMA) need the arch-specific target.
    Returns None when there is no GPU or the arch is neither CUDA (sm_XX) nor AMD (gfxXXX).
    """
    arch = arch if arch is not None else gpu_arch()
    if arch is None:
        return None
    arch = arch.split(":")[0]
    if re.fullmatch(r"sm_\d+[a-z]?", arch):
        return {"kind": "cuda", "arch": "sm_90a" if arch == "sm_90" else arch}
    if re.fullmatch(r"gfx[0-9a-f]{3,4}", arch):
        return {"kind": "hip", "mcpu": arch}
    return None


def leading_version(text: str | None) -> Version | None:
    """The numeric head of a version string ("6.2.41133-dd7f" -> 6.2.41133), or None."""
    match = re.match(r"\d+(?:\.\d+)*", text or "")
    return Version(match.group(0)) if match else None


def gfx_from_target_version(value: int) -> str:
    """Translate KFD's gfx_target_version (90010) into the gfx name (gfx90a)."""
    return f"gfx{value // 10000}{(value // 100) % 100:x}{value % 100:x}"


# ---- probing the machine -------------------------------------------------------------------------


def _run(command: list[str]) -> str:
    if shutil.which(command[0]) is None:
        return ""
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=20, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return result.stdout if result.returncode == 0 else ""


def _torch_facts() -> tuple[dict, list[Gpu]]:
    try:
        import torch
    except ImportError:
        return {"version": None, "cuda": None, "hip": None, "arch_list": []}, []
    facts = {"version": torch.__version__, "cuda": torch.version.cuda, "hip": torch.version.hip,
             "arch_list": torch.cuda.get_arch_list() if torch.cuda.is_available() else []}
    gpus = []
    for index in range(torch.cuda.device_count() if torch.cuda.is_available() else 0):
        props = torch.cuda.get_device_properties(index)
        gpus.append(Gpu("amd" if torch.version.hip else "nvidia", props.name, gpu_arch(index),
                        round(props.total_memory / 2**30, 1), "torch"))
    return facts, gpus


def nvidia_smi_gpus() -> tuple[list[Gpu], str | None]:
    """GPUs and driver version reported by nvidia-smi (empty when it is missing or fails)."""
    output = _run(["nvidia-smi", "--query-gpu=name,memory.total,compute_cap,driver_version",
                   "--format=csv,noheader,nounits"])
    gpus, driver = [], None
    for line in output.strip().splitlines():
        fields = [part.strip() for part in line.split(",")]
        if len(fields) != 4 or not re.fullmatch(r"\d+\.\d+", fields[2]):
            continue  # an old driver without compute_cap, or "[N/A]" fields
        name, memory_mib, capability, driver = fields
        memory = round(float(memory_mib) / 1024, 1) if memory_mib.isdigit() else None
        gpus.append(Gpu("nvidia", name, "sm_" + capability.replace(".", ""), memory, "nvidia-smi"))
    return gpus, driver


def kfd_gpus(topology: Path = KFD_TOPOLOGY) -> list[Gpu]:
    """AMD GPUs the amdgpu kernel driver exposes in /sys/class/kfd (no ROCm userland needed)."""
    gpus = []
    for properties in sorted(topology.glob("*/properties")):
        values = dict(line.split(maxsplit=1) for line in properties.read_text().splitlines() if " " in line)
        target = int(values.get("gfx_target_version", 0))
        if target:
            banks = properties.parent.glob("mem_banks/*/properties")
            memory = sum(int(dict(line.split(maxsplit=1) for line in bank.read_text().splitlines()
                                  if " " in line).get("size_in_bytes", 0)) for bank in banks)
            gpus.append(Gpu("amd", "AMD GPU", gfx_from_target_version(target),
                            round(memory / 2**30, 1) if memory else None, "kfd"))
    return gpus


def _toolchains() -> dict[str, dict]:
    nvcc = shutil.which("nvcc")
    nvcc_release = re.search(r"release (\d+\.\d+)", _run(["nvcc", "--version"])) if nvcc else None
    hipcc = find_hipcc()
    return {
        "nvcc": {"path": nvcc, "version": nvcc_release.group(1) if nvcc_release else None},
        "hipcc": {"path": hipcc, "version": hipcc_version(hipcc) if hipcc else None},
    }


def installed_distribution(dists: list[str]) -> tuple[str, str] | None:
    """(distribution, version) of the first of `dists` that is installed, else None."""
    for dist in dists:
        try:
            return dist, importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def arch_supports(arch: str, precision: str) -> bool:
    """Whether `arch` has native `precision` ("bf16" / "fp16") arithmetic, per the matrix."""
    return any(fnmatch.fnmatchcase(arch, pattern) for pattern in compat_matrix()["gpu"][precision])


# ---- checks against the matrix -------------------------------------------------------------------


def _matches(value: str | None, condition: str) -> bool:
    if condition in ("present", "missing"):
        return (value is not None) == (condition == "present")
    if value is None:
        return False
    if condition[0] in "<>=!~":
        version = leading_version(value)
        return version is not None and SpecifierSet(condition).contains(version, prereleases=True)
    return any(fnmatch.fnmatchcase(value, pattern) for pattern in condition.split("|"))


def known_bad_checks(facts: dict[str, str | None], rules: list[dict]) -> list[Check]:
    """The matrix's known-bad combinations whose every condition holds for `facts`."""
    return [Check(rule["level"], rule["id"], rule["message"], rule["fix"])
            for rule in rules if all(_matches(facts.get(key), cond) for key, cond in rule["when"].items())]


def package_checks(versions: dict[str, str | None], spec: dict[str, dict]) -> list[Check]:
    """One check per package of the matrix: missing, too old, or fine."""
    checks = []
    for name, entry in spec.items():
        version, fix = versions.get(name), entry.get("fix", f"pip install -U '{name}>={entry['min']}'")
        if version is None:
            level = "fail" if entry["required"] else "info"
            checks.append(Check(level, name, f"not installed; used for {entry['purpose']}", fix))
        elif leading_version(version) < Version(entry["min"]):
            level = "fail" if entry["required"] else "warn"
            checks.append(Check(level, name, f"{version} is older than the minimum {entry['min']}", fix))
        else:
            checks.append(Check("pass", name, f"{version} (>= {entry['min']})"))
    return checks


def requirement_checks(versions: dict[str, str | None], requires: dict[str, list[str]],
                       aliases: dict[str, str] | None = None) -> list[Check]:
    """Conflicts between what installed packages declare (Requires-Dist) and what is installed.

    `requires` maps each installed package to its requirement strings; only requirements on
    packages in `versions` (or their `aliases`: distribution -> matrix name) that are installed are
    checked, and requirements that apply only to extras or other platforms are skipped.
    """
    checks = []
    for package, requirements in requires.items():
        for text in requirements:
            try:
                requirement = Requirement(text)
            except InvalidRequirement:
                continue
            name = canonicalize_name(requirement.name)
            installed = versions.get((aliases or {}).get(name, name))
            if installed is None or (requirement.marker and not requirement.marker.evaluate({"extra": ""})):
                continue
            version = leading_version(installed)
            if requirement.specifier and version and not requirement.specifier.contains(version, prereleases=True):
                checks.append(Check("fail", f"{package} -> {requirement.name}",
                                    f"{package} {versions[package]} requires {requirement.name}{requirement.specifier}, "
                                    f"found {installed}",
                                    f"pip install '{requirement.name}{requirement.specifier}' (or a {package} "
                                    f"release that accepts {requirement.name} {installed})"))
    return checks


def _gpu_checks(report: EnvReport, probed: list[Gpu]) -> list[Check]:
    torch = report.torch
    build = f"CUDA {torch['cuda']}" if torch["cuda"] else f"ROCm/HIP {torch['hip']}" if torch["hip"] else "CPU-only"
    if not report.gpus:
        if probed:
            wheel = "cu128" if probed[0].vendor == "nvidia" else "rocm6.4"
            return [Check("fail", "GPU", f"{probed[0].name} ({probed[0].arch}) is present but torch ({build} build) "
                                         "cannot use it", f"pip install torch --index-url https://download.pytorch.org/whl/{wheel}")]
        return [Check("warn", "GPU", f"no GPU found (torch build: {build}); training runs on CPU and kernels fall "
                                     "back to the PyTorch reference", "run on a machine with an NVIDIA or AMD GPU")]
    checks = []
    for gpu in report.gpus:
        subject = f"GPU {gpu.name}"
        checks.append(Check("pass", subject, f"{gpu.arch}, {gpu.memory_gib} GiB, seen by torch ({build} build)"))
        if not arch_supports(gpu.arch, "bf16"):
            checks.append(Check("warn", subject, f"{gpu.arch} has no native bf16", "train in fp16 (`fp16: true`, `bf16: false`)"))
        if torch["arch_list"] and not _arch_in_build(gpu.arch, torch["arch_list"]):
            checks.append(Check("fail", subject, f"torch was not built for {gpu.arch} (it has {', '.join(torch['arch_list'])})",
                                "install a torch wheel built for this GPU (https://pytorch.org/get-started/locally/)"))
    return checks


def _arch_in_build(arch: str, arch_list: list[str]) -> bool:
    """Whether a torch build for `arch_list` runs on `arch` (same-major sm_ binaries, older PTX, exact gfx)."""
    if arch.startswith("gfx"):
        return any(entry.split(":")[0] == arch for entry in arch_list)
    number = int(arch[3:].rstrip("a"))
    for entry in arch_list:
        kind, _, digits = entry.partition("_")
        built = int(re.sub(r"\D", "", digits) or 0)
        if (kind == "sm" and built // 10 == number // 10 and built <= number) or (kind == "compute" and built <= number):
            return True
    return False


def _toolchain_checks(report: EnvReport, driver_min: dict) -> list[Check]:
    checks = []
    torch, nvcc, hipcc = report.torch, report.toolchains["nvcc"], report.toolchains["hipcc"]
    for name, info, runtime in (("nvcc", nvcc, torch["cuda"]), ("hipcc", hipcc, torch["hip"])):
        if not info["path"]:
            checks.append(Check("info", name, "not found (only needed to build CUDA/HIP extensions or check ports)"))
        elif runtime and leading_version(info["version"]) and leading_version(runtime).major != leading_version(info["version"]).major:
            checks.append(Check("warn", name, f"{name} {info['version']} and torch's {runtime} differ in major version: "
                                              "torch.utils.cpp_extension refuses to build extensions",
                                f"put the {name} matching torch's {runtime} first on PATH"))
        else:
            checks.append(Check("pass", name, f"{info['version'] or 'version unknown'} at {info['path']}"))
    driver, cuda = report.driver.get("nvidia"), leading_version(torch["cuda"])
    if driver and cuda and str(cuda.major) in driver_min:
        floor = driver_min[str(cuda.major)]
        level, message = ("pass", f"driver {driver} runs CUDA {cuda.major}.x") if leading_version(driver) >= Version(floor) \
            else ("fail", f"driver {driver} is older than {floor}, the minimum for CUDA {cuda.major}.x")
        checks.append(Check(level, "NVIDIA driver", message, "" if level == "pass" else "update the NVIDIA driver"))
    return checks


def _tilelang_check(report: EnvReport, supported: list[str]) -> Check:
    target = report.tilelang_target
    if target is None:
        return Check("info", "TileLang target", "none: no GPU, kernels fall back to the PyTorch reference")
    arch = report.gpus[0].arch
    if arch not in supported:
        return Check("warn", "TileLang target", f"{arch} is not a tested TileLang target ({', '.join(supported)}); "
                                                "kernels fall back to the PyTorch reference",
                     "run on one of those GPUs to use the TileLang kernels")
    if report.packages.get("tilelang") is None:
        return Check("info", "TileLang target", f"{json.dumps(target)}, but tilelang is not installed",
                     "pip install 'tiletune[tilelang]'")
    return Check("pass", "TileLang target", f"kernels compile for {json.dumps(target)}")


def _facts(report: EnvReport, rules: list[dict]) -> dict[str, str | None]:
    gpu = report.gpus[0] if report.gpus else None
    facts = {
        "python": report.python, "torch.cuda": report.torch["cuda"], "torch.hip": report.torch["hip"],
        "nvcc": report.toolchains["nvcc"]["version"], "hipcc": report.toolchains["hipcc"]["version"],
        "gpu.arch": gpu.arch if gpu else None, "gpu.vendor": gpu.vendor if gpu else None, **report.packages,
    }
    for key in {key for rule in rules for key in rule["when"]} - facts.keys():
        found = installed_distribution([key])
        facts[key] = found[1] if found else None
    return facts


def check_environment(report: EnvReport, probed: list[Gpu], requires: dict[str, list[str]]) -> list[Check]:
    """All checks of `report` against the matrix; `probed` are GPUs found without torch (nvidia-smi,
    KFD), `requires` the Requires-Dist lists of installed matrix packages."""
    matrix = compat_matrix()
    python_ok = Version(report.python) >= Version(matrix["python"])
    checks = [Check("pass" if python_ok else "fail", "python", f"{report.python} (>= {matrix['python']})",
                    "" if python_ok else f"use Python >= {matrix['python']}")]
    checks += package_checks(report.packages, matrix["packages"])
    aliases = {canonicalize_name(dist): name for name, entry in matrix["packages"].items() for dist in entry.get("dists", [])}
    checks += requirement_checks(report.packages, requires, aliases)
    checks += _gpu_checks(report, probed)
    checks.append(_tilelang_check(report, matrix["gpu"]["tilelang"]))
    checks += _toolchain_checks(report, matrix["nvidia_driver_min"])
    checks += known_bad_checks(_facts(report, matrix["known_bad"]), matrix["known_bad"])
    return checks


def library_check(folder: str) -> Check:
    """Whether this machine can load the kernel library in `folder` (target, torch ABI), and what to rebuild."""
    from pathlib import Path

    from tiletune.errors import UserError
    from tiletune.kernels import _tilelang
    from tiletune.kernels.library import Manifest, why_not_loadable

    subject = f"kernel library {folder}"
    try:
        manifest = Manifest.read(Path(folder))
    except UserError as err:
        return Check("fail", subject, str(err), "tiletune kernels build CONFIG --out DIR")
    reason = why_not_loadable(manifest, Path(folder), _tilelang.device_target())
    if reason:
        return Check("fail", subject, reason, f"tiletune kernels build CONFIG --target {_tilelang.device_target() or '<target>'} --out DIR")
    return Check("pass", subject, f"{len(manifest.kernels)} kernels for {manifest.target}, built against torch {manifest.torch}")


def collect_environment(library: str | None = None) -> EnvReport:
    """Probe this machine and check it against the compatibility matrix (and a kernel library when given)."""
    torch_facts, gpus = _torch_facts()
    smi_gpus, driver = nvidia_smi_gpus()
    installed = {name: installed_distribution(entry.get("dists", [name])) for name, entry in compat_matrix()["packages"].items()}
    report = EnvReport(
        python=platform.python_version(), system=f"{platform.system()} {platform.machine()}",
        torch=torch_facts, gpus=gpus, driver={"nvidia": driver},
        packages={name: found[1] if found else None for name, found in installed.items()},
        toolchains=_toolchains(), tilelang_target=tilelang_target(gpus[0].arch) if gpus else None,
    )
    requires = {name: importlib.metadata.requires(found[0]) or [] for name, found in installed.items() if found}
    report.checks = check_environment(report, smi_gpus or kfd_gpus(), requires)
    library = library or os.environ.get("TILETUNE_KERNEL_LIBRARY")
    if library:
        report.checks.append(library_check(library))
    return report


# ---- rendering -----------------------------------------------------------------------------------


def render_text(report: EnvReport) -> str:
    """The report as aligned text: facts first, then one line per check."""
    torch = report.torch
    build = f"CUDA {torch['cuda']}" if torch["cuda"] else f"HIP {torch['hip']}" if torch["hip"] else "CPU only"
    gpus = "; ".join(f"{g.vendor} {g.name}, {g.arch}, {g.memory_gib} GiB" for g in report.gpus) or "none visible to torch"
    precisions = "; ".join(
        f"{g.arch}: bf16 {_yes_no(arch_supports(g.arch, 'bf16'))}, fp16 {_yes_no(arch_supports(g.arch, 'fp16'))}" for g in report.gpus
    ) or "n/a (no GPU)"
    tools = ", ".join(f"{name} {info['version'] or '?'} ({info['path']})" if info["path"] else f"{name} not found"
                      for name, info in report.toolchains.items())
    packages = ", ".join(f"{name} {version or '-'}" for name, version in report.packages.items() if name != "torch")
    rows = [
        ("python", f"{report.python} ({report.system})"),
        ("torch", f"{torch['version'] or 'not installed'}, build: {build}"),
        ("GPU", gpus),
        ("bf16 / fp16", precisions),
        ("driver", f"NVIDIA {report.driver['nvidia']}" if report.driver.get("nvidia") else "no NVIDIA driver found"),
        ("packages", packages),
        ("compilers", tools),
        ("TileLang", json.dumps(report.tilelang_target) if report.tilelang_target else "no target (no GPU)"),
    ]
    lines = ["tiletune env", *(f"  {label:<13}{value}" for label, value in rows), "", "Checks (compat_matrix.yaml):"]
    for check in report.checks:
        lines.append(f"  {check.level.upper():<5} {check.subject}: {check.message}")
        if check.fix and check.level != "pass":
            lines.append(f"        fix: {check.fix}")
    counts = {level: sum(check.level == level for check in report.checks) for level in LEVELS}
    lines.append(f"Summary: {', '.join(f'{count} {level}' for level, count in counts.items())}")
    return "\n".join(lines) + "\n"


def _yes_no(flag: bool) -> str:
    return "yes" if flag else "no"


def render_json(report: EnvReport) -> str:
    """The report as JSON (facts and checks), for scripts and bug reports."""
    data = asdict(report)
    data["failed"] = report.failed
    return json.dumps(data, indent=2) + "\n"


def run_stamp() -> dict:
    """Where and when a measurement ran: device and arch, torch build, versions, UTC date, tiletune commit."""
    import datetime

    import torch
    import transformers

    # The commit of the tiletune source that ran; TILETUNE_COMMIT names it where the tree is a copy whose
    # .git is missing or not the one the tree came from (a lent GPU machine).
    commit = os.environ.get("TILETUNE_COMMIT", "")
    if not commit:
        try:
            commit = subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).parent
            ).stdout.strip()
        except OSError:
            commit = ""
    on_gpu = torch.cuda.is_available()
    return {
        "device": torch.cuda.get_device_name() if on_gpu else f"CPU ({platform.machine()}, {os.cpu_count()} cores)",
        "arch": gpu_arch() if on_gpu else None,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "hip": getattr(torch.version, "hip", None),
        "transformers": transformers.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": commit or "unknown",
    }
