"""_tilelang: the disk cache makes a second run compile nothing; targets parse; lazy import."""

import os
import subprocess
import sys

import pytest

from tiletune.kernels import _tilelang


def test_parse_target():
    assert _tilelang.parse_target("cuda:sm_90") == {"kind": "cuda", "arch": "sm_90a"}
    assert _tilelang.parse_target("hip:gfx942") == {"kind": "hip", "mcpu": "gfx942"}
    with pytest.raises(ValueError, match="unknown target"):
        _tilelang.parse_target("rocm:942")


def test_import_tiletune_does_not_import_tilelang():
    code = "import sys, tiletune, tiletune.kernels.registry; tiletune.kernels.registry.load_ops(); print('tilelang' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


@pytest.mark.gpu
def test_second_run_compiles_nothing(tmp_path):
    code = ("import time, torch; from tiletune.kernels import rms_norm as m\n"
            "x = torch.randn(77, 256, device='cuda', dtype=torch.bfloat16)\n"
            "t = time.perf_counter(); m.tilelang_forward(x, torch.ones(256, device='cuda', dtype=torch.bfloat16), 1e-5)\n"
            "torch.cuda.synchronize(); print(time.perf_counter() - t)")
    env = dict(os.environ, TILELANG_CACHE_DIR=str(tmp_path))

    def run():
        secs = float(subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                                    check=True).stdout.split()[-1])
        return secs, sorted(str(p) for p in tmp_path.rglob("*") if p.is_file())

    first_secs, first_files = run()
    second_secs, second_files = run()
    assert first_files and second_files == first_files
    assert second_secs < first_secs / 2, (first_secs, second_secs)


def test_threads_compile_different_kernels_at_once_and_each_kernel_once(monkeypatch):
    """Two kernels meet inside their compiles (a barrier a single compile lock would never release); two threads
    asking for the same kernel get one compile."""
    import threading
    from concurrent.futures import ThreadPoolExecutor
    from types import SimpleNamespace

    from tiletune.kernels import library

    meeting, compiles = threading.Barrier(2, timeout=10), []

    def compile_(func, target):
        compiles.append(func)
        if func != "same":
            meeting.wait()
        return f"kernel {func}"

    monkeypatch.setattr(_tilelang, "tilelang", lambda: SimpleNamespace(compile=compile_))
    monkeypatch.setattr(_tilelang, "device_target", lambda: "cuda:sm_90")
    monkeypatch.setattr(library, "lookup", lambda key: None)
    monkeypatch.setattr(_tilelang, "_compiled", {})
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda name: _tilelang.compiled(("test", name), lambda: name), ["a", "b", "same", "same"]))
    assert got == ["kernel a", "kernel b", "kernel same", "kernel same"] and sorted(compiles) == ["a", "b", "same"]


def test_compile_jobs_from_the_environment(monkeypatch):
    from tiletune.errors import UserError
    monkeypatch.setenv("TILETUNE_COMPILE_JOBS", "3")
    assert _tilelang.compile_jobs() == 3
    monkeypatch.setenv("TILETUNE_COMPILE_JOBS", "many")
    with pytest.raises(UserError, match="TILETUNE_COMPILE_JOBS='many'"):
        _tilelang.compile_jobs()
