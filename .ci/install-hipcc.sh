#!/bin/sh
# Install Debian's hipcc (ROCm 5.2) so `tiletune hipify --compile-check --offload-arch gfx90a` can be
# tested on a CI machine without a GPU. Idempotent, and always exits 0: when the install fails, the
# compile-check tests skip and say why. Measured here: ~15 s (apt-get update + install, 2 cores).
set -u

if command -v hipcc >/dev/null 2>&1; then
    echo "install-hipcc: hipcc already present: $(command -v hipcc)"
    exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "install-hipcc: no apt-get on this machine; skipping (compile-check tests will skip)"
    exit 0
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    if command -v sudo >/dev/null 2>&1; then
        SUDO="sudo"
    else
        echo "install-hipcc: not root and no sudo; skipping (compile-check tests will skip)"
        exit 0
    fi
fi
if ! $SUDO apt-get update -qq; then
    echo "install-hipcc: apt-get update failed; skipping (compile-check tests will skip)"
    exit 0
fi
if ! DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends hipcc >/dev/null; then
    echo "install-hipcc: 'apt-get install hipcc' failed (the package is in Debian >= 12 and Ubuntu >= 23.04);"
    echo "install-hipcc: skipping (compile-check tests will skip)"
    exit 0
fi
echo "install-hipcc: installed $(HIP_PLATFORM=amd hipcc --version 2>/dev/null | grep -m1 'HIP version' || echo hipcc)"
exit 0
