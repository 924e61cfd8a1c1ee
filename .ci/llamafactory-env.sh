#!/usr/bin/env bash
# LLaMA-Factory integration in its own environment: a fresh venv with LLaMA-Factory and the
# dependencies it pins, tiletune on top without its own, then the tests that run
# `tiletune llamafactory train` for real on the demo model. About 2 minutes to build, 20 s to test.
#
# torch comes from LLaMA-Factory's resolution (the default PyPI build, run here on the CPU), not the
# CPU wheel the main CI uses: LLaMA-Factory imports torchaudio at start-up, and the PyPI torchaudio
# wheels (<= 2.11.1) load only against a CUDA build of torch.
#
#   bash .ci/llamafactory-env.sh          build the venv, then test
#   bash .ci/llamafactory-env.sh build    only the venv with LLaMA-Factory (CI builds it beside its main tests)
#   bash .ci/llamafactory-env.sh test     tiletune into that venv, then the tests
set -euo pipefail
cd "$(dirname "$0")/.."

LF_VERSION=0.9.5
VENV=${LF_VENV:-/tmp/tiletune-lf-venv}
STEP=${1:-all}

if [ "$STEP" != test ]; then
    rm -rf "$VENV"
    python3 -m venv "$VENV"
    "$VENV/bin/python" -m pip install -q --upgrade pip
    "$VENV/bin/python" -m pip install -q "llamafactory==$LF_VERSION" "pytest>=8"
fi
if [ "$STEP" != build ]; then
    "$VENV/bin/python" -m pip install -q -e . --no-deps
    "$VENV/bin/python" -m pytest -q tests/train/test_llamafactory.py
fi
