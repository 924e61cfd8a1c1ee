"""Ahead-of-time kernel library: the manifest, the generated registration, refusals, fallback rules, and (where
nvcc is installed) a real library built for sm_90, loaded in a process where TileLang cannot be imported."""

import json
import os
import shutil
import subprocess
import sys
import textwrap
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from tiletune.cli import main
from tiletune.env import library_check
from tiletune.errors import UserError
from tiletune.hipcc import find_hipcc
from tiletune.kernels import _tilelang, library, registry
from tiletune.kernels.customop import _run_or_fall_back
from tiletune.kernels.library import Kernel, Library, Manifest, Param, why_not_loadable
from tiletune.patch import apply_kernels, parse_kernel_spec

RMS_KEY = ("rms_norm_fwd", 4096, 1e-6, "bfloat16", 0.0)
needs_tilelang = pytest.mark.skipif(not _tilelang.installed(), reason="needs TileLang (pip install tilelang)")
needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None or shutil.which("objcopy") is None,
                                reason="needs nvcc (CUDA toolkit) and objcopy: install the CUDA toolkit to build a library")  # fmt: skip


def rms_norm_kernels(dtype: str = "bfloat16"):
    from tiletune.kernels import rms_norm

    return [((*RMS_KEY[:3], dtype, 0.0), lambda: rms_norm.forward_kernel(4096, 1e-6, dtype, offset=0.0))]


def manifest(**changes) -> Manifest:
    kernel = Kernel(repr(RMS_KEY), library.kernel_name(RMS_KEY),
                    [Param("X", "bfloat16", ["m", 4096]), Param("W", "bfloat16", [4096]),
                     Param("Y", "bfloat16", ["m", 4096])], ["m"], "0" * 64)  # fmt: skip
    built = Manifest("cuda:sm_90", torch.__version__, bool(torch._C._GLIBCXX_USE_CXX11_ABI), "0.1.15", "nvcc 13.0",
                     library.LIBRARY_FILE, [kernel])  # fmt: skip
    return replace(built, **changes)


@pytest.fixture
def no_library(monkeypatch):
    monkeypatch.setattr(library, "_active", None)
    monkeypatch.delenv(library.LIBRARY_ENV, raising=False)


def test_manifest_round_trip_and_damage(tmp_path):
    manifest().write(tmp_path)
    assert Manifest.read(tmp_path) == manifest()
    assert not list(tmp_path.glob(".*.tmp"))  # written atomically
    (tmp_path / library.MANIFEST).write_text('{"target": "cuda:sm_90"')
    with pytest.raises(UserError, match="is damaged"):
        Manifest.read(tmp_path)
    with pytest.raises(UserError, match="no manifest.json; build one with `tiletune kernels build`"):
        Manifest.read(tmp_path / "elsewhere")


@pytest.mark.parametrize(("changes", "target", "said"), [
    ({}, "cuda:sm_90", None),
    ({}, "hip:gfx942", "was built for cuda:sm_90; this machine is hip:gfx942: `tiletune kernels build --target hip:gfx942`"),
    ({}, None, "this machine is without a GPU"),
    ({"torch": "1.0.0"}, "cuda:sm_90", "built against torch 1.0.0; this is torch"),
    ({"cxx11_abi": not torch._C._GLIBCXX_USE_CXX11_ABI}, "cuda:sm_90", "the ops' C++ ABI differs"),
    ({"library": None, "why_not_compiled": "hipcc 5.2 is older than ROCm 6"}, "cuda:sm_90", "is a source package"),
    ({"format": 99}, "cuda:sm_90", "has format 99"),
])  # fmt: skip
def test_refusals_are_one_line_with_what_to_do(changes, target, said):
    reason = why_not_loadable(manifest(**changes), Path("/libs/x"), target)
    if said is None:
        assert reason is None
    else:
        assert said in reason and "\n" not in reason


def test_activate_refuses_another_target_with_one_line(tmp_path, no_library, monkeypatch):
    manifest(target="hip:gfx942").write(tmp_path)
    monkeypatch.setattr(_tilelang, "device_target", lambda device=None: "cuda:sm_90")
    with pytest.raises(UserError, match="was built for hip:gfx942; this machine is cuda:sm_90"):
        library.activate(tmp_path)
    assert library.loaded() is None


def test_registration_checks_every_tensor_and_reads_dynamic_dims():
    source = library._registration_source(manifest().kernels)
    name = library.kernel_name(RMS_KEY)
    assert f'm.def("{name}(Tensor(a0!) a0, Tensor(a1!) a1, Tensor(a2!) a2, int stream) -> ()", &{name});' in source
    for check in ("a1.size(0) == 4096", "a0.size(1) == 4096", "a2.size(0) == a0.size(0)"):
        assert check in source
    assert "a0.scalar_type() == at::kBFloat16" in source and "a2.is_cuda() && a2.is_contiguous()" in source
    assert f"{name}_call(a0.data_ptr(), a1.data_ptr(), a2.data_ptr(), static_cast<int>(a0.size(0)), " in source
    # a scalar (NF4 dequantization's nested offset) keeps its C type: a float, not a pointer, in the launch
    scaled = replace(manifest().kernels[0], name="dq", params=[Param("Data", "uint8", [64]), Param("offset", "float32"),
                                                               Param("Out", "bfloat16", [128])], dims=[])  # fmt: skip
    source = library._registration_source([scaled])
    assert 'extern "C" int dq_call(void*, float, void*, void*);' in source
    assert 'm.def("dq(Tensor(a0!) a0, float a1, Tensor(a2!) a2, int stream) -> ()", &dq);' in source
    assert "dq_call(a0.data_ptr(), static_cast<float>(a1), a2.data_ptr(), reinterpret_cast<void*>(stream))" in source
    orphan = replace(manifest().kernels[0], dims=["m", "n"])  # a launch dimension no tensor carries
    with pytest.raises(RuntimeError, match="dynamic dimension n is not the size of any tensor"):
        library._registration_source([orphan])


def test_only_the_launchers_own_functions_get_the_kernels_name():
    """A Hopper GEMM's launcher initialises its barriers with `mbarrier[i].init(n)`: a member, not the launcher's
    init, so it keeps its name (the H200 build failed on exactly this)."""
    launcher = textwrap.dedent("""\
        extern "C" int init() { mbarrier[3].init(256); tl::Barrier::init(1); return 0; }
        extern "C" const char* get_last_error() { return error_buf; }
        extern "C" int call(void* a, cudaStream_t stream) { k<<<1, 1, 0, stream>>>(a); p->call(a); return 0; }
    """)
    renamed = library.prefix_launcher_symbols(launcher, "gemm_1")
    assert 'int gemm_1_init() { mbarrier[3].init(256); tl::Barrier::init(1);' in renamed
    assert "const char* gemm_1_get_last_error()" in renamed
    assert "int gemm_1_call(void* a, cudaStream_t stream)" in renamed and "p->call(a)" in renamed


def test_lookup_takes_the_librarys_kernel_and_counts_what_it_lacks(monkeypatch, no_library):
    found = Library(Path("/libs/x"), manifest(), {k.key: k for k in manifest().kernels})
    monkeypatch.setattr(library, "_active", found)
    stand_in = torch.library.Library(library.NAMESPACE, "FRAGMENT")  # the op a loaded library would register
    stand_in.define(f"{library.kernel_name(RMS_KEY)}(Tensor(a0!) a0, Tensor(a1!) a1, Tensor(a2!) a2, int stream) -> ()")
    assert callable(library.lookup(RMS_KEY))
    other = ("rms_norm_fwd", 5120, 1e-6, "bfloat16", 0.0)
    monkeypatch.setattr(_tilelang, "installed", lambda: True)
    assert library.lookup(other) is None  # compiled just in time by the caller
    monkeypatch.setattr(_tilelang, "installed", lambda: False)
    with pytest.raises(library.KernelMissing, match="has no kernel \\(rms_norm_fwd, 5120.*TileLang is not installed"):
        library.lookup(other)
    assert found.used == {library.kernel_name(RMS_KEY)} and found.not_in_it == {repr(other)}
    assert "1 used; 1 kernels not in it, their ops ran the reference" in library.summary()


def test_a_missing_kernel_runs_the_reference_and_is_counted(monkeypatch):
    def missing(x):
        raise library.KernelMissing("the kernel library /libs/x has no kernel (rms_norm_fwd, 5120)")

    before = dict(registry.runtime_fallbacks)
    out = _run_or_fall_back("rms_norm", "tilelang", False, missing, lambda x: x + 1, (torch.zeros(2),))
    assert torch.equal(out, torch.ones(2))
    new = {k: n - before.get(k, 0) for k, n in registry.runtime_fallbacks.items() if n != before.get(k, 0)}
    assert new == {("rms_norm", "tilelang", "the kernel library /libs/x has no kernel (rms_norm_fwd, 5120)"): 1}
    with pytest.raises(library.KernelMissing):
        _run_or_fall_back("rms_norm", "tilelang", True, missing, lambda x: x, (torch.zeros(2),))


def test_the_spec_names_a_library_and_a_bad_one_is_one_line(tmp_path, no_library):
    assert parse_kernel_spec({"all": True, "library": str(tmp_path)}).library == str(tmp_path)
    with pytest.raises(UserError, match="kernels.library: expected the folder"):
        parse_kernel_spec({"all": True, "library": 3})
    with pytest.raises(UserError, match="no manifest.json; build one with `tiletune kernels build`"):
        apply_kernels(torch.nn.Linear(2, 2), {"all": True, "library": str(tmp_path / "missing")})


def test_env_checks_a_library(tmp_path, no_library):
    manifest(target="hip:gfx942").write(tmp_path)
    check = library_check(str(tmp_path))
    assert check.level == "fail" and "was built for hip:gfx942" in check.message and "--target" in check.fix


def test_kernels_build_without_a_gpu_is_one_line(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("model_name_or_path: examples/tiny-llama\nkernels: all\n")
    result = CliRunner().invoke(main, ["kernels", "build", str(config), "--out", str(tmp_path / "lib")])
    assert result.exit_code == 2
    if not _tilelang.installed():
        assert "kernels build needs TileLang" in result.output
    elif not torch.cuda.is_available():
        assert "no CUDA or ROCm GPU is visible" in result.output
    assert "Traceback" not in result.output and len(result.output.strip().splitlines()) == 1


def test_kernels_build_takes_every_presets_kernels_into_one_library(tmp_path, monkeypatch):
    """--model-preset twice: the kernels both shapes need, once each, in one library per target."""
    from tiletune.patch import warmup

    config = tmp_path / "c.yaml"
    config.write_text("model_name_or_path: examples/tiny-llama\nkernels: all\nbf16: true\n")
    monkeypatch.setattr(_tilelang, "installed", lambda: True)
    monkeypatch.setattr(_tilelang, "device_target", lambda: "cuda:sm_90")
    monkeypatch.setattr(warmup, "record_kernels", lambda model, spec, dtype: {
        ("rms_norm_fwd", model.config.hidden_size): None, ("rms_norm_fwd", 1024): None})  # fmt: skip
    built = []
    monkeypatch.setattr(library, "build", lambda kernels, target, out, progress: built.append((target, dict(kernels))) or manifest())
    result = CliRunner().invoke(main, ["kernels", "build", str(config), "--model-preset", "llama3-8b", "--model-preset",
                                       "gemma3-12b", "--target", "cuda:sm_90", "--out", str(tmp_path / "lib")])  # fmt: skip
    assert result.exit_code == 0, result.output
    assert [(target, sorted(kernels)) for target, kernels in built] == [
        ("cuda:sm_90", [("rms_norm_fwd", 1024), ("rms_norm_fwd", 3840), ("rms_norm_fwd", 4096)])]  # 1024: once


@needs_tilelang
def test_a_target_without_its_compiler_gets_a_source_package(tmp_path, monkeypatch):
    monkeypatch.setattr(library, "toolchain", lambda target: "hipcc (ROCm) is not installed; install ROCm >= 6 or set HIPCC")
    built = library.build(rms_norm_kernels(), "hip:gfx942", tmp_path)
    folder = tmp_path / "hip-gfx942"
    assert built.library is None and "hipcc (ROCm) is not installed" in built.why_not_compiled
    name = library.kernel_name(RMS_KEY)
    source = (folder / "objects" / f"{name}.hip").read_text()
    assert f"{name}_kernel" in source and f"int {name}_call(" in source and "hipStream_t" in source
    script = (folder / "build.sh").read_text()
    assert "--offload-arch=gfx942" in script and f"objcopy --weaken objects/{name}.o" in script
    assert json.loads((folder / "manifest.json").read_text())["kernels"][0]["dims"] == ["m"]
    assert "is a source package" in why_not_loadable(Manifest.read(folder), folder, "hip:gfx942")


@needs_tilelang
@pytest.mark.skipif(find_hipcc() is None, reason="needs hipcc: apt install hipcc (Debian's ROCm 5) or install ROCm >= 6")
def test_the_hip_library_for_gfx90a_with_this_machines_hipcc(tmp_path):
    """With ROCm >= 6 the HIP library is built; with an older hipcc (Debian's 5.2) the folder is a source package,
    and the reason it gives is the real one: that hipcc stops at TileLang's hip/hip_bf16.h include, while the
    registration unit compiles against this torch."""
    built = library.build(rms_norm_kernels("float16"), "hip:gfx90a", tmp_path)
    folder = tmp_path / "hip-gfx90a"
    if built.library:
        assert (folder / built.library).exists()
        return
    assert "older than ROCm 6" in built.why_not_compiled and "hip/hip_bf16.h" in built.why_not_compiled
    tl_src = Path(_tilelang.tilelang().__file__).parent / "src"
    kernel = next((folder / "objects").glob("*.hip"))
    compiled = subprocess.run([find_hipcc(), "-x", "hip", "--offload-arch=gfx90a", "-std=c++17", "-w", f"-I{tl_src}",
                               "-fsyntax-only", str(kernel)], capture_output=True, text=True, check=False,
                              env={**os.environ, "HIP_PLATFORM": "amd"})  # fmt: skip
    assert compiled.returncode != 0 and "hip/hip_bf16.h" in compiled.stderr
    torch_flags, _ = library._torch_flags()
    registration = subprocess.run([os.environ.get("CXX", "c++"), "-std=c++17", "-fsyntax-only", *torch_flags,
                                   str(folder / "registration.cpp")], capture_output=True, text=True, check=False)  # fmt: skip
    assert registration.returncode == 0, registration.stderr[-2000:]


@needs_tilelang
@needs_nvcc
def test_a_built_library_loads_and_checks_without_tilelang(tmp_path):
    """sm_90 library from nvcc on this machine; a fresh process that cannot import TileLang loads it with
    torch.ops.load_library alone and its op refuses CPU tensors through the generated checks."""
    said = []
    first = library.build(rms_norm_kernels(), "cuda:sm_90", tmp_path, progress=said.append)
    name = library.kernel_name(RMS_KEY)
    assert first.library == library.LIBRARY_FILE and first.kernels[0].name == name
    assert [p.shape for p in first.kernels[0].params] == [["m", 4096], [4096], ["m", 4096]]
    assert f"compiled {name}" in said
    said.clear()
    library.build(rms_norm_kernels(), "cuda:sm_90", tmp_path, progress=said.append)
    assert f"reused {name} (its source is unchanged)" in said  # a second build recompiles nothing unchanged
    probe = textwrap.dedent(f"""
        import sys
        sys.modules["tilelang"] = None  # TileLang cannot be imported
        import torch
        torch.ops.load_library({str(tmp_path / "cuda-sm_90" / library.LIBRARY_FILE)!r})
        op = torch.ops.tiletune_aot.{name}
        print(op.default._schema)
        x = torch.zeros(3, 4096, dtype=torch.bfloat16)
        try:
            op(x, torch.zeros(4096, dtype=torch.bfloat16), torch.empty_like(x), 0)
        except RuntimeError as err:
            print("refused:", str(err).splitlines()[0])
    """)
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-2000:]
    assert f"tiletune_aot::{name}(Tensor(a0!) a0, Tensor(a1!) a1, Tensor(a2!) a2, int stream) -> ()" in result.stdout
    assert "refused: " in result.stdout and "tensor 0 (X) must be a contiguous GPU tensor" in result.stdout


TINY_STEP = textwrap.dedent("""
    import json, sys
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from tiletune.config import build_config
    from tiletune.patch import apply_kernels
    from tiletune.train.model import prepare_for_training

    config = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=704, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    cfg = build_config({"model_name_or_path": "x", "finetuning_type": "lora", "lora_target": "q_proj,v_proj"})

    def model():
        torch.manual_seed(0)
        return prepare_for_training(cfg, LlamaForCausalLM(config).to("cuda", torch.bfloat16))

    def step(net, spec):
        report = apply_kernels(net, spec)
        tokens = torch.randint(0, 512, (2, 96), generator=torch.Generator().manual_seed(1)).cuda()
        loss = net(input_ids=tokens, labels=tokens).loss
        loss.backward()
        grads = {n: p.grad.float().cpu() for n, p in net.named_parameters() if p.grad is not None}
        return loss.item(), grads, report
""")


@pytest.mark.gpu
@needs_tilelang
def test_a_library_built_here_trains_like_the_jit_kernels_without_tilelang(tmp_path):
    """Build this GPU's library for a tiny Llama with every op; a fresh process that cannot import TileLang
    takes every kernel it calls from it (none missing, no fallback, every op among them) and computes the JIT kernels' loss and gradients."""
    from tiletune.patch.warmup import record_kernels

    namespace = {}
    exec(TINY_STEP, namespace)  # noqa: S102 - the same step text runs here and in the fresh process
    recorded = record_kernels(namespace["model"](), "all", torch.bfloat16)
    assert {"rms_norm_fwd", "rms_norm_bwd", "silu", "rope", "linear"} <= {key[0] for key in recorded}
    built = library.build(recorded.items(), _tilelang.device_target(), tmp_path)
    assert built.library and not built.left_out
    loss, grads, _ = namespace["step"](namespace["model"](), "all")
    torch.save(grads, tmp_path / "jit_grads.pt")
    folder = tmp_path / _tilelang.device_target().replace(":", "-")
    probe = ("import sys\nsys.modules['tilelang'] = None\n" + TINY_STEP + textwrap.dedent(f"""
        loss, grads, report = step(model(), {{"all": True, "library": {str(folder)!r}}})
        jit = torch.load({str(tmp_path / "jit_grads.pt")!r})
        print(json.dumps({{"loss": loss, "same_grads": all(torch.equal(grads[n], jit[n]) for n in jit),
                           "library": report.to_dict()["library"], "fallbacks": report.runtime_fallbacks()}}))
    """))
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=600, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    seen = json.loads(result.stdout.strip().splitlines()[-1])
    assert seen["fallbacks"] == [] and seen["library"]["not_in_it"] == []
    used = set(seen["library"]["used"])  # the warm-up records a few kernels this step does not reach
    assert used <= {kernel.name for kernel in built.kernels}
    assert {"rms_norm_fwd", "rms_norm_bwd", "silu", "rope", "linear"} <= {name.rsplit("_", 1)[0] for name in used}
    assert seen["loss"] == loss and seen["same_grads"]  # the same kernels: bit for bit
