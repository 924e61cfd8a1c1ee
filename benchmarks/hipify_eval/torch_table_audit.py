"""Which HIP runtime / driver names in torch's hipify table HIP does not declare.

torch.utils.hipify maps CUDA names to HIP names it does not check: some HIP names are spelt otherwise
(`hipPointerAttributeMemoryType` for HIP's `HIP_POINTER_ATTRIBUTE_MEMORY_TYPE`), some mark a call HIP lacks
(`hipStreamCreate__`), some never existed. This script reads HIP's headers (ROCm/HIP's `include/` and
ROCm/clr's `hipamd/include/`, given with --hip-include) and

- checks that every target of `tiletune.port.engines.TORCH_TABLE_CORRECTIONS` is declared there (exit 1 if not),
- writes `src/tiletune/port/torch_table_undeclared.txt`: each CUDA runtime / driver name whose torch target
  names an identifier HIP does not declare (the torch engine leaves those CUDA names as they are, so the report
  counts them as left untranslated), corrected names excluded.

Library names (hipBLAS, hipSPARSE, hipRAND, hipFFT, hipSOLVER, MIOpen, hipCUB) are not audited: their headers
live in other repositories.

    python benchmarks/hipify_eval/torch_table_audit.py --hip-include HIP/include --hip-include clr/hipamd/include \
        --source "ROCm/HIP c5e11fca, ROCm/clr 1a2b3c4d"
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from tiletune.port.engines import TORCH_TABLE_CORRECTIONS
from tiletune.port.lint import strip_comments

OUTPUT = Path(__file__).resolve().parents[2] / "src" / "tiletune" / "port" / "torch_table_undeclared.txt"
LIBRARY_PREFIXES = ("hipblas", "hipsparse", "hiprand", "hipfft", "hipsolver", "hipdnn", "miopen", "hipcub", "rocblas",
                    "hiptensor", "rccl", "rsmi", "roctx", "hiprtc")  # fmt: skip
_IDENTIFIER = re.compile(r"\b\w+\b")


def declared_names(include_dirs: list[Path]) -> set[str]:
    """Every identifier in the code (comments stripped) of the header trees."""
    names: set[str] = set()
    for root in include_dirs:
        for header in root.rglob("*"):
            if header.is_file() and header.suffix in (".h", ".hpp", ".inc", ""):
                names.update(_IDENTIFIER.findall(strip_comments(header.read_text(encoding="utf-8", errors="replace"))))
    return names


def undeclared_targets(table: dict[str, str], declared: set[str]) -> dict[str, str]:
    """CUDA name -> torch's HIP target, for targets naming a runtime / driver identifier HIP does not declare."""
    undeclared = {}
    for cuda, hip in table.items():
        if not isinstance(hip, str) or "/" in hip or "::" in cuda or hip.endswith((".h", ".hpp")) or cuda in TORCH_TABLE_CORRECTIONS:
            continue
        for name in _IDENTIFIER.findall(hip):
            if name.lower().startswith(("hip", "__hip")) and not name.lower().startswith(LIBRARY_PREFIXES) \
                    and name not in declared:  # fmt: skip
                undeclared[cuda] = hip
                break
    return undeclared


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hip-include", type=Path, action="append", required=True, help="a HIP header tree")
    parser.add_argument("--source", required=True, help="where the headers came from (repository and commit)")
    args = parser.parse_args(argv)
    from torch import __version__ as torch_version
    from torch.utils.hipify import hipify_python

    declared = declared_names(args.hip_include)
    wrong = {cuda: hip for cuda, hip in TORCH_TABLE_CORRECTIONS.items() if hip not in declared}
    for cuda, hip in wrong.items():
        print(f"TORCH_TABLE_CORRECTIONS: {cuda} -> {hip}, which the headers do not declare", file=sys.stderr)
    undeclared = undeclared_targets(hipify_python.PYTORCH_MAP, declared)
    lines = [f"# CUDA runtime / driver names torch {torch_version}'s hipify table maps to a HIP name HIP does not",
             f"# declare ({args.source}), written by benchmarks/hipify_eval/torch_table_audit.py: CUDA name, torch's target.",
             *(f"{cuda} {hip}" for cuda, hip in sorted(undeclared.items()))]  # fmt: skip
    OUTPUT.write_text("\n".join(lines) + "\n", encoding="utf-8")
    print(f"{len(undeclared)} undeclared targets written to {OUTPUT}; {len(TORCH_TABLE_CORRECTIONS) - len(wrong)} "
          f"of {len(TORCH_TABLE_CORRECTIONS)} corrections declared")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
