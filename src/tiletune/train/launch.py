"""Several processes for one run: re-launch `tiletune` under torchrun when the environment asks for it.

LLaMA-Factory's convention: `FORCE_TORCHRUN=1` (with `NPROC_PER_NODE`, `NNODES`, `NODE_RANK`,
`MASTER_ADDR`, `MASTER_PORT`) makes the command start itself on every process. A run already started
by torchrun or `accelerate launch` (LOCAL_RANK is set) is left alone.
"""

from __future__ import annotations

import os
import socket
import sys


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def torchrun_command(argv: list[str]) -> list[str] | None:
    """The torchrun command that re-runs `tiletune <argv>` on every process, or None when not asked for."""
    if os.environ.get("FORCE_TORCHRUN", "").lower() not in ("1", "true", "yes") or "LOCAL_RANK" in os.environ:
        return None
    import torch

    nproc = os.environ.get("NPROC_PER_NODE") or str(max(torch.cuda.device_count(), 1))
    return [
        sys.executable, "-m", "torch.distributed.run",
        "--nnodes", os.environ.get("NNODES", "1"),
        "--node_rank", os.environ.get("NODE_RANK", "0"),
        "--nproc_per_node", nproc,
        "--master_addr", os.environ.get("MASTER_ADDR", "127.0.0.1"),
        "--master_port", os.environ.get("MASTER_PORT") or str(_free_port()),
        "-m", "tiletune", *argv,
    ]  # fmt: skip
