"""Ahead-of-time kernel library: TileLang kernels compiled once per GPU target into one shared library.

`tiletune kernels build` records which kernels a model needs (each op run once on this machine's GPU, as
`kernels warmup` does), lowers each for every requested target, and compiles them with the target's own
compiler (nvcc, or hipcc from ROCm >= 6) into ``libtiletune_aot.so`` beside a manifest (`Manifest`). The
library registers one op per kernel, ``torch.ops.tiletune_aot.<name>(Tensor(a!) a0, ..., int stream) -> ()``:
its tensors (and scalars) in the kernel's parameter order, checked against the kernel's dtypes, static dimensions and
layout before launch, the dynamic (token) dimensions read from their shapes, and the CUDA/HIP stream to
launch on. Nothing of TileLang is needed to load or call it: ``torch.ops.load_library(path)`` alone serves
people who call the kernels directly.

When a library is active (`kernels: {library: DIR}` or TILETUNE_KERNEL_LIBRARY=DIR), `_tilelang.compiled`
takes each kernel from it; a kernel it lacks (another shape, dtype or configuration) is compiled just in
time when TileLang is installed, and otherwise the op runs its PyTorch reference with that reason
(`KernelMissing`, counted per call like every fallback). `activate` refuses, in one line each, a library
built for another GPU architecture or against another torch (the C++ ABI of its ops).

How a kernel becomes library code: TileLang lowers it and writes its host launcher (``init`` sets the
dynamic shared memory limit, ``call`` launches) exactly as its own JIT does; the kernel's global symbol and
the launcher's functions get the kernel's name as prefix so that many kernels share one library. Each
kernel compiles to its own object (cached by source hash, so a rebuild recompiles only what changed), whose
symbols are made weak: TileLang's headers define a few non-inline helpers that every kernel's object
carries.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from tiletune.errors import UserError
from tiletune.kernels import _tilelang
from tiletune.kernels.registry import KernelUnavailable

NAMESPACE = "tiletune_aot"
LIBRARY_ENV = "TILETUNE_KERNEL_LIBRARY"
MANIFEST = "manifest.json"
LIBRARY_FILE = f"lib{NAMESPACE}.so"
FORMAT = 1


class KernelMissing(KernelUnavailable):
    """A kernel the active library lacks while TileLang cannot compile it: the op runs its reference."""


# ---- the manifest -----------------------------------------------------------------------------------


@dataclass
class Param:
    """One parameter of a kernel: its name, dtype and, for a tensor, its shape (an int: static, a str: a dynamic
    dimension); a scalar has no shape."""

    name: str
    dtype: str
    shape: list[int | str] | None = None


@dataclass
class Kernel:
    """One compiled kernel: the key `_tilelang.compiled` looks it up by (repr of the tuple), its op name in
    the library, its parameters and dynamic dimensions in launch order, and the hash of its source."""

    key: str
    name: str
    params: list[Param]
    dims: list[str]
    source_sha256: str


@dataclass
class Manifest:
    """What a library holds and what it was built for and against."""

    target: str  # "cuda:sm_90", "hip:gfx942"
    torch: str  # torch.__version__ the ops were compiled against
    cxx11_abi: bool
    tilelang: str | None
    compiler: str  # the compiler's version line
    library: str | None  # the shared library's file name; None for a source package (not compiled here)
    kernels: list[Kernel] = field(default_factory=list)
    left_out: dict[str, str] = field(default_factory=dict)  # repr(key) -> why that kernel is not in the library
    format: int = FORMAT
    why_not_compiled: str | None = None

    def write(self, folder: Path) -> None:
        """Write manifest.json into `folder` atomically."""
        scratch = folder / f".{MANIFEST}.tmp"
        scratch.write_text(json.dumps(asdict(self), indent=1))
        os.replace(scratch, folder / MANIFEST)

    @classmethod
    def read(cls, folder: Path) -> Manifest:
        """The manifest of the library in `folder`; UserError when there is none or it is damaged."""
        path = folder / MANIFEST
        try:
            data = json.loads(path.read_text())
            kernels = [Kernel(**{**k, "params": [Param(**p) for p in k["params"]]}) for k in data.pop("kernels")]
            return cls(**data, kernels=kernels)
        except FileNotFoundError:
            raise UserError(f"kernel library {folder}: no {MANIFEST}; build one with `tiletune kernels build`") from None
        except (ValueError, TypeError, KeyError) as err:
            raise UserError(f"kernel library {folder}: {MANIFEST} is damaged ({err}); rebuild it") from None


def kernel_name(key: tuple) -> str:
    """The kernel's op name in the library: its first key part and a hash of the whole key."""
    digest = hashlib.sha1(repr(key).encode()).hexdigest()[:12]
    return re.sub(r"\W", "_", f"{key[0]}_{digest}")


# ---- building ------------------------------------------------------------------------------------------


def prefix_launcher_symbols(source: str, name: str) -> str:
    """The launcher's exported functions (init, call, get_last_error) renamed `<name>_...` so that many kernels
    share one library; members of the same name (`mbarrier[i].init(...)`, `Barrier::init`) keep theirs."""
    for symbol in ("get_last_error", "init", "call"):
        source = re.sub(rf"(?<![.>:])\b{symbol}\b(?=\s*[\[(])", f"{name}_{symbol}", source)
    return source


def _launcher_source(key: tuple, func, target: str) -> tuple[str, Kernel]:
    """The kernel's device code and host launcher for `target`, symbols prefixed with its name."""
    from tilelang.jit.adapter.wrapper import TLWrapper

    tl = _tilelang.tilelang()
    tvm = tl.tvm
    name = kernel_name(key)
    func = func.with_attr("global_symbol", name)
    parsed = _tilelang.parse_target(target)
    configs = _tilelang.pass_configs(func)
    with tvm.target.Target(parsed), tvm.transform.PassContext(opt_level=3, config=configs):
        artifact = tl.lower(func, target=parsed)
    wrapper = TLWrapper(tvm.target.Target(parsed))
    wrapper.assign_optimized_module(tvm.IRModule({name: func}))
    wrapper.assign_pass_configs(configs)
    wrapper.assign_host_module(artifact.host_mod)
    wrapper.assign_device_module(artifact.device_mod)
    source = prefix_launcher_symbols(wrapper.wrap(artifact.kernel_source), name)
    params = [Param(str(func.buffer_map[p].name), str(func.buffer_map[p].dtype), [_dimension(n) for n in func.buffer_map[p].shape])
              if p in func.buffer_map else Param(str(p.name), str(p.dtype)) for p in func.params]  # fmt: skip
    unknown = [p.dtype for p in params if p.shape is None and p.dtype not in _SCALARS]
    if unknown:
        raise RuntimeError(f"a scalar parameter of type {unknown[0]}: the library passes {', '.join(_SCALARS)}")
    launch = re.search(rf"int {name}_call\((.*?)\)\s*{{", source, re.DOTALL)
    if launch is None:
        raise RuntimeError(f"{name}: TileLang's launcher has no call function (TileLang {_tilelang.version()})")
    scalars = {p.name for p in params if p.shape is None}  # an int scalar parameter is no dynamic dimension
    ints = [arg.split()[-1] for arg in launch.group(1).split(",") if arg.split()[0] in ("int", "int64_t")]
    dims = [arg for arg in ints if arg not in scalars]
    return source, Kernel(repr(key), name, params, dims, hashlib.sha256(source.encode()).hexdigest())


def _dimension(size) -> int | str:
    """A buffer dimension as the manifest keeps it: an int when static, the variable's name when dynamic."""
    if type(size).__name__ == "IntImm":
        return int(size)
    if type(size).__name__ == "Var":
        return size.name  # a plain str (str() of TVM objects gives TVM strings, which crash when freed)
    raise RuntimeError(f"dimension {size} is an expression: the library takes static or plain dynamic dimensions")


def _lowered(kernels: list[tuple[tuple, Callable]], target: str) -> list[tuple]:
    """`_launcher_source` of each kernel, or (key, why it cannot be in a library), computed in a forked child
    process: TileLang 0.1.15's runtime crashes when a lowered module whose launcher was generated outside its
    JIT is freed, so the child never frees it."""
    import multiprocessing

    context = multiprocessing.get_context("fork")
    reader, writer = context.Pipe(duplex=False)

    def child() -> None:
        results = []
        for key, builder in kernels:
            try:
                results.append(_launcher_source(key, builder(), target))
            except Exception as err:  # noqa: BLE001 - the kernel is left out, with the reason
                results.append((key, f"{type(err).__name__}: {(str(err).strip().splitlines() or [''])[-1]}"))
        writer.send(results)
        os._exit(0)

    process = context.Process(target=child)
    process.start()
    writer.close()
    try:
        results = reader.recv()
    except EOFError:
        process.join()
        raise UserError(f"kernels build: lowering for {target} failed: the lowering process died (exit code "
                        f"{process.exitcode})") from None  # fmt: skip
    process.join()
    return results


_SCALARS = {"float32": ("float", "float"), "float64": ("double", "float"), "int32": ("int", "int"),
            "int64": ("int64_t", "int")}  # fmt: skip  # scalar dtype -> (C type, schema type)
_DTYPES = {"bfloat16": "at::kBFloat16", "float16": "at::kHalf", "float32": "at::kFloat", "int32": "at::kInt",
           "int64": "at::kLong", "uint8": "at::kByte", "int8": "at::kChar", "bool": "at::kBool"}  # fmt: skip


def _registration_source(kernels: list[Kernel]) -> str:
    """C++ registering one torch op per kernel: checks, dynamic dimensions from shapes, launch on the given stream."""
    lines = ["// Generated by tiletune.kernels.library: one torch op per TileLang kernel.",
             "#include <torch/library.h>", "#include <ATen/core/Tensor.h>", ""]  # fmt: skip
    for kernel in kernels:
        c_types = ["void*" if p.shape is not None else _SCALARS[p.dtype][0] for p in kernel.params]
        args = ", ".join([*c_types, *["int"] * len(kernel.dims), "void*"])
        lines += [f'extern "C" int {kernel.name}_init();', f'extern "C" const char* {kernel.name}_get_last_error();',
                  f'extern "C" int {kernel.name}_call({args});', ""]  # fmt: skip
        arguments = [f"at::Tensor a{i}" if p.shape is not None else f"{'double' if _SCALARS[p.dtype][1] == 'float' else 'int64_t'} a{i}"
                     for i, p in enumerate(kernel.params)]  # fmt: skip
        lines.append(f"static void {kernel.name}({', '.join([*arguments, 'int64_t stream'])}) {{")
        first_seen: dict[str, str] = {}
        for i, param in enumerate(kernel.params):
            if param.shape is None:
                continue
            where = f'"{kernel.name}: tensor {i} ({param.name})'
            lines += [f"  TORCH_CHECK(a{i}.is_cuda() && a{i}.is_contiguous(), {where} must be a contiguous GPU tensor\");",
                      f"  TORCH_CHECK(a{i}.scalar_type() == {_DTYPES[param.dtype]}, {where} must be {param.dtype}\");",
                      f"  TORCH_CHECK(a{i}.dim() == {len(param.shape)}, {where} must have {len(param.shape)} dimensions\");"]  # fmt: skip
            for d, size in enumerate(param.shape):
                if isinstance(size, int):
                    lines.append(f"  TORCH_CHECK(a{i}.size({d}) == {size}, {where} dimension {d} must be {size}\");")
                elif size in first_seen:
                    lines.append(f"  TORCH_CHECK(a{i}.size({d}) == {first_seen[size]}, {where}: {size} differs between tensors\");")
                else:
                    first_seen[size] = f"a{i}.size({d})"
        missing = [dim for dim in kernel.dims if dim not in first_seen]
        if missing:
            raise RuntimeError(f"{kernel.name}: dynamic dimension {missing[0]} is not the size of any tensor")
        values = [f"a{i}.data_ptr()" if p.shape is not None else f"static_cast<{c_types[i]}>(a{i})" for i, p in enumerate(kernel.params)]
        call = ", ".join([*values, *(f"static_cast<int>({first_seen[dim]})" for dim in kernel.dims), "reinterpret_cast<void*>(stream)"])
        lines += [f"  static const int ready = {kernel.name}_init();  // once: the kernel's shared memory limit",
                  f'  TORCH_CHECK(ready == 0, "{kernel.name}: ", {kernel.name}_get_last_error());',
                  f"  TORCH_CHECK({kernel.name}_call({call}) == 0, \"{kernel.name}: \", {kernel.name}_get_last_error());",
                  "}", ""]  # fmt: skip
    lines.append(f"TORCH_LIBRARY({NAMESPACE}, m) {{")
    for kernel in kernels:
        schema = ", ".join(f"Tensor(a{i}!) a{i}" if p.shape is not None else f"{_SCALARS[p.dtype][1]} a{i}"
                           for i, p in enumerate(kernel.params))  # fmt: skip
        lines.append(f'  m.def("{kernel.name}({schema}, int stream) -> ()", &{kernel.name});')
    lines.append("}")
    return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class Toolchain:
    """How to compile one target's kernels, registration and library."""

    kind: str  # "cuda" or "hip"
    compiler: str
    kernel_flags: list[str]
    link_flags: list[str]
    env: dict[str, str]

    def version(self) -> str:
        result = subprocess.run([self.compiler, "--version"], capture_output=True, text=True, env=self.env, check=False)
        lines = [line for line in (result.stdout + result.stderr).splitlines() if line.strip()]
        return next((line for line in lines if "release" in line or "HIP version" in line), lines[-1] if lines else "?")


def toolchain(target: str) -> Toolchain | str:
    """The compiler for `target` on this machine, or why there is none (one line)."""
    if shutil.which("objcopy") is None:
        return "objcopy (binutils) is not installed; the build weakens each kernel object's symbols with it"
    tl_root = Path(_tilelang.tilelang().__file__).parent
    includes = [f"-I{tl_root / 'src'}"]
    kind, _, arch = target.partition(":")
    if kind == "cuda":
        nvcc = _nvcc()
        if nvcc is None:
            return "nvcc (the CUDA toolkit) is not on PATH; install it or set CUDA_HOME"
        code = _tilelang.parse_target(target)["arch"].removeprefix("sm_")
        flags = ["-std=c++20", "-w", "-Xcudafe", "--diag_suppress=177", "-lineinfo", f"-gencode=arch=compute_{code},code=sm_{code}",
                 "-Xcompiler", "-fPIC", f"-I{tl_root / '3rdparty' / 'cutlass' / 'include'}", *includes]  # fmt: skip
        return Toolchain("cuda", nvcc, flags, ["-shared", "-Xcompiler", "-fPIC"], dict(os.environ))
    from tiletune.hipcc import find_hipcc, hipcc_version

    hipcc = find_hipcc()
    if hipcc is None:
        return "hipcc (ROCm) is not installed; install ROCm >= 6 or set HIPCC"
    version = hipcc_version(hipcc) or "unknown"
    if not version[0].isdigit() or int(version.split(".")[0]) < 6:
        return f"hipcc {version} is older than ROCm 6, whose headers (hip/hip_bf16.h) TileLang's HIP kernels need"
    flags = ["-x", "hip", f"--offload-arch={arch}", "-std=c++17", "-w", "-fPIC", *includes]
    return Toolchain("hip", hipcc, flags, ["-shared", "-fPIC"], {**os.environ, "HIP_PLATFORM": "amd"})


def _nvcc() -> str | None:
    """The nvcc TileLang's own JIT uses (its CUDA home), else the one on PATH."""
    try:
        from tilelang.contrib.nvcc import get_nvcc_compiler

        found = get_nvcc_compiler()
    except Exception:  # noqa: BLE001 - TileLang finds no CUDA home: look on PATH
        found = None
    return found if found and os.access(found, os.X_OK) else shutil.which("nvcc")


def _torch_flags() -> tuple[list[str], list[str]]:
    from torch.utils.cpp_extension import include_paths, library_paths

    compile_flags = [f"-I{p}" for p in include_paths()] + [f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"]
    link = [f"-L{p}" for p in library_paths()] + ["-lc10", "-ltorch", "-ltorch_cpu"]
    return compile_flags, link


def _run(command: list[str], env: dict[str, str], what: str) -> None:
    result = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
    if result.returncode:
        tail = "\n".join((result.stdout + result.stderr).strip().splitlines()[-15:])
        raise UserError(f"kernels build: compiling {what} failed:\n{tail}\ncommand: {' '.join(command)}")


def _run_parallel(commands: list[list[str]], env: dict[str, str], jobs: int) -> list[str | None]:
    """Run the compiler commands, `jobs` at a time (processes, not threads: TileLang's runtime does not survive
    Python threads ending); per command None or the tail of its output when it failed."""
    results: list[str | None] = [None] * len(commands)
    running: list[tuple[int, subprocess.Popen]] = []
    for index, command in [*enumerate(commands), *[(None, None)] * jobs]:
        while running and (len(running) >= jobs or index is None):
            done, process = running.pop(0)
            output = process.communicate()[0]
            if process.returncode:
                results[done] = "\n".join(output.strip().splitlines()[-15:]) + f"\ncommand: {' '.join(commands[done])}"
        if index is not None:
            running.append((index, subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)))
    return results


def build(kernels: Iterable[tuple[tuple, Callable]], target: str, out_dir: str | Path,
          progress: Callable[[str], None] = lambda _: None, jobs: int | None = None) -> Manifest:  # fmt: skip
    """Lower each (key, PrimFunc builder) for `target` and compile them into OUT/<target>/ (library + manifest).

    Without the target's compiler (nvcc; hipcc from ROCm >= 6) the folder is a source package instead: the
    sources, the registration, build.sh and a manifest saying why nothing was compiled. Objects whose source
    is unchanged are reused from an earlier build in the same folder.
    """
    folder = Path(out_dir) / target.replace(":", "-")
    (folder / "objects").mkdir(parents=True, exist_ok=True)
    suffix = "cu" if target.startswith("cuda") else "hip"
    entries: list[Kernel] = []
    left_out: dict[str, str] = {}
    for source, entry in _lowered(list(kernels), target):
        if isinstance(entry, str):  # (key, why it cannot be in the library)
            left_out[repr(source)] = entry
            progress(f"left out {source[0]}: {entry}")
        elif entry.name not in {e.name for e in entries}:
            entries.append(entry)
            (folder / "objects" / f"{entry.name}.{suffix}").write_text(source)
        progress(f"lowered {entry.name}")
    (folder / "registration.cpp").write_text(_registration_source(entries))
    tools = toolchain(target)
    compiler = tools.version() if isinstance(tools, Toolchain) else "none"
    manifest = Manifest(target, torch.__version__, bool(torch._C._GLIBCXX_USE_CXX11_ABI), _tilelang.version(),
                        compiler, None, entries, left_out=left_out)  # fmt: skip
    _write_build_script(folder, entries, target)
    if isinstance(tools, str):
        manifest.why_not_compiled = tools
        manifest.write(folder)
        progress(f"{target}: source package only ({tools}); run {folder / 'build.sh'} where the compiler is")
        return manifest
    torch_compile, torch_link = _torch_flags()
    objects = [folder / "objects" / f"{entry.name}-{entry.source_sha256[:16]}.o" for entry in entries]
    stale = [(entry, obj) for entry, obj in zip(entries, objects, strict=True) if not obj.exists()]
    for entry, obj in zip(entries, objects, strict=True):
        if obj.exists():
            progress(f"reused {entry.name} (its source is unchanged)")
    commands = [[tools.compiler, *tools.kernel_flags, "-c", str(folder / "objects" / f"{entry.name}.{suffix}"),
                 "-o", str(obj.with_suffix(".o.tmp"))] for entry, obj in stale]  # fmt: skip
    for (entry, obj), failure in zip(stale, _run_parallel(commands, tools.env, jobs or _tilelang.compile_jobs()), strict=True):
        if failure:
            raise UserError(f"kernels build: compiling {entry.name} failed:\n{failure}")
        _run(["objcopy", "--weaken", str(obj.with_suffix(".o.tmp"))], tools.env, f"{entry.name} (weakening its symbols)")
        os.replace(obj.with_suffix(".o.tmp"), obj)
        progress(f"compiled {entry.name}")
    registration = folder / "objects" / "registration.o"
    _run([os.environ.get("CXX", "c++"), "-std=c++17", "-O2", "-fPIC", *torch_compile, "-c", str(folder / "registration.cpp"),
          "-o", str(registration)], tools.env, "the registration")  # fmt: skip
    scratch = folder / f".{LIBRARY_FILE}.tmp"
    _run([tools.compiler, *tools.link_flags, *map(str, objects), str(registration), *torch_link, "-o", str(scratch)],
         tools.env, "the library")  # fmt: skip
    os.replace(scratch, folder / LIBRARY_FILE)
    manifest.library = LIBRARY_FILE
    manifest.write(folder)
    progress(f"{target}: {folder / LIBRARY_FILE} ({len(entries)} kernels)")
    return manifest


def _write_build_script(folder: Path, kernels: list[Kernel], target: str) -> None:
    """build.sh: the same compile and link, for a machine with the target's compiler (a source package's way in)."""
    kind, _, arch = target.partition(":")
    if kind == "cuda":
        code = _tilelang.parse_target(target)["arch"].removeprefix("sm_")
        compile_kernel = f'nvcc -std=c++20 -w -gencode=arch=compute_{code},code=sm_{code} -Xcompiler -fPIC -I"$TL/src" -I"$TL/3rdparty/cutlass/include" -c'
        link, suffix = "nvcc -shared", "cu"
    else:
        compile_kernel = f'HIP_PLATFORM=amd hipcc -x hip --offload-arch={arch} -std=c++17 -w -fPIC -I"$TL/src" -c'
        link, suffix = "HIP_PLATFORM=amd hipcc -shared -fPIC", "hip"
    lines = ["#!/bin/bash", f"# Builds {LIBRARY_FILE} for {target} from these sources (generated by tiletune kernels build).",
             "# Needs TileLang's headers (TL=<tilelang package folder>) and torch's (from the Python that will load it).",
             "set -euo pipefail", 'cd "$(dirname "$0")"',
             'TL=${TL:-$(python3 -c "import tilelang, os; print(os.path.dirname(tilelang.__file__))")}',
             ("TORCH_FLAGS=$(python3 -c \"import torch; from torch.utils.cpp_extension import include_paths as i; "
              "print(' '.join('-I'+p for p in i()), '-D_GLIBCXX_USE_CXX11_ABI=%d' % torch._C._GLIBCXX_USE_CXX11_ABI)\")"),
             "TORCH_LIBS=$(python3 -c \"from torch.utils.cpp_extension import library_paths as l; print(' '.join('-L'+p for p in l()))\")"]  # fmt: skip
    for kernel in kernels:
        lines += [f"{compile_kernel} objects/{kernel.name}.{suffix} -o objects/{kernel.name}.o",
                  f"objcopy --weaken objects/{kernel.name}.o"]  # fmt: skip
    objects = " ".join(f"objects/{k.name}.o" for k in kernels)
    lines += ["${CXX:-c++} -std=c++17 -O2 -fPIC $TORCH_FLAGS -c registration.cpp -o objects/registration.o",
              f"{link} {objects} objects/registration.o $TORCH_LIBS -lc10 -ltorch -ltorch_cpu -o {LIBRARY_FILE}",
              f'echo "built $(pwd)/{LIBRARY_FILE}"']  # fmt: skip
    script = folder / "build.sh"
    script.write_text("\n".join(lines) + "\n")
    script.chmod(0o755)


# ---- loading -------------------------------------------------------------------------------------------


@dataclass
class Library:
    """A loaded kernel library: its folder, manifest and kernels by key."""

    folder: Path
    manifest: Manifest
    by_key: dict[str, Kernel]
    used: set[str] = field(default_factory=set)  # kernel names taken from the library
    not_in_it: set[str] = field(default_factory=set)  # keys asked for that it lacks (compiled here, or the reference)

    def kernel(self, key: tuple) -> Callable | None:
        """A callable launching the library's kernel for `key` as its TileLang JIT kernel is called, or None."""
        entry = self.by_key.get(repr(key))
        if entry is None:
            self.not_in_it.add(repr(key))
            return None
        self.used.add(entry.name)
        op = getattr(getattr(torch.ops, NAMESPACE), entry.name)

        def launch(*args) -> None:  # tensors and scalars in the kernel's order, as its TileLang JIT takes them
            device = next(a.device for a in args if isinstance(a, torch.Tensor))
            op(*args, torch.cuda.current_stream(device).cuda_stream)

        return launch


_active: Library | None = None


def why_not_loadable(manifest: Manifest, folder: Path, target: str | None) -> str | None:
    """Why this machine cannot use the library in `folder` (one line, with what to do), or None."""
    if manifest.format != FORMAT:
        return f"kernel library {folder} has format {manifest.format}, this tiletune reads {FORMAT}: rebuild it"
    if manifest.library is None:
        return (f"kernel library {folder} is a source package ({manifest.why_not_compiled}): run its build.sh where "
                f"the {manifest.target} compiler is, or `tiletune kernels build --target {manifest.target}` there")  # fmt: skip
    if target != manifest.target:
        return (f"kernel library {folder} was built for {manifest.target}; this machine is {target or 'without a GPU'}: "
                f"`tiletune kernels build --target {target or '<target>'}`")  # fmt: skip
    if manifest.torch != torch.__version__ or manifest.cxx11_abi != bool(torch._C._GLIBCXX_USE_CXX11_ABI):
        return (f"kernel library {folder} was built against torch {manifest.torch}; this is torch {torch.__version__} "
                "(the ops' C++ ABI differs): rebuild it with this torch")  # fmt: skip
    return None


def activate(folder: str | Path) -> Library:
    """Load the library in `folder` for this process; UserError (one line) when this machine cannot use it."""
    global _active
    folder = Path(folder).expanduser().resolve()
    if _active is not None and _active.folder == folder:
        return _active
    if _active is not None:
        raise UserError(f"kernel library {_active.folder} is loaded already; one library per process ({folder} asked)")
    manifest = Manifest.read(folder)
    reason = why_not_loadable(manifest, folder, _tilelang.device_target())
    if reason:
        raise UserError(reason)
    torch.ops.load_library(str(folder / manifest.library))
    _active = Library(folder, manifest, {k.key: k for k in manifest.kernels})
    _tilelang.machine_unavailable_reason.cache_clear()
    return _active


def active() -> Library | None:
    """The library this process uses: the one activated, else TILETUNE_KERNEL_LIBRARY's when set."""
    if _active is None and os.environ.get(LIBRARY_ENV):
        return activate(os.environ[LIBRARY_ENV])
    return _active


def loaded() -> Library | None:
    """The library loaded in this process, without loading one."""
    return _active


def summary() -> str | None:
    """One line on the active library: where, for which target, what it served and what it lacked; None without one."""
    if _active is None:
        return None
    lacked = len(_active.not_in_it)
    instead = "compiled just in time" if _tilelang.installed() else "their ops ran the reference"
    return (f"kernel library {_active.folder} ({_active.manifest.target}, {len(_active.by_key)} kernels): "
            f"{len(_active.used)} used" + (f"; {lacked} kernels not in it, {instead}" if lacked else ""))


def lookup(key: tuple) -> Callable | None:
    """The active library's kernel for `key`, None when there is no library; KernelMissing when the library
    lacks it and TileLang is not installed to compile it."""
    library = active()
    if library is None:
        return None
    kernel = library.kernel(key)
    if kernel is None and not _tilelang.installed():
        shown = ", ".join(map(str, key))
        left_out = library.manifest.left_out.get(repr(key))
        why = f"left it out when built: {left_out}" if left_out else "add this model to `tiletune kernels build`"
        raise KernelMissing(f"the kernel library {library.folder} has no kernel ({shown}) and TileLang is not installed "
                            f"to compile it ({why})")  # fmt: skip
    return kernel
