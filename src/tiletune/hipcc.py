"""Finding hipcc and running it for AMD targets: shared by `tiletune env` and the hipify compile check.

hipcc picks the NVIDIA platform on a machine with nvcc unless `HIP_PLATFORM=amd` is set, so every
call here sets it; hipcc compiles device code for a gfx target that way without a GPU.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess

_HIP_VERSION = re.compile(r"HIP version:?\s*(\d+\.\d+(?:\.\d+)?)")


def find_hipcc() -> str | None:
    """Path of hipcc: $HIPCC, then $ROCM_PATH/bin/hipcc, /opt/rocm/bin/hipcc, then PATH."""
    candidates = [os.environ.get("HIPCC"), os.path.join(os.environ.get("ROCM_PATH", "/opt/rocm"), "bin", "hipcc")]
    for candidate in filter(None, candidates):
        if os.access(candidate, os.X_OK):
            return candidate
    return shutil.which("hipcc")


def run_hipcc(command: list[str]) -> subprocess.CompletedProcess:
    """Run `command` (hipcc and its arguments) with HIP_PLATFORM=amd; output captured as text, never raises."""
    return subprocess.run(command, capture_output=True, text=True, check=False, env={**os.environ, "HIP_PLATFORM": "amd"})


def hipcc_version(hipcc: str) -> str | None:
    """The HIP version hipcc reports ("5.2.21153"), or None when it does not say."""
    result = run_hipcc([hipcc, "--version"])
    match = _HIP_VERSION.search(result.stdout + result.stderr)
    return match.group(1) if match else None
