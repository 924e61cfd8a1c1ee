"""The CUDA sample corpus of the port tests and its `// expect: rule-id` markers."""

import re
from pathlib import Path

from tiletune.port.preprocessor import HIPCC, Build

CORPUS = Path(__file__).parent / "corpus"
CLEAN_SAMPLE = CORPUS / "clean_silu_mul.cu"
SAMPLES = sorted([*CORPUS.glob("*.cu*"), *CORPUS.glob("*.cpp")])
_EXPECT = re.compile(r"//\s*expect:\s*(.+)$")
_HIP_BUILD = re.compile(r"//\s*hip-build:\s*(.+)$", re.MULTILINE)


def expected_findings(path: Path) -> set[tuple[int, str]]:
    """(line, rule id) pairs the sample declares with `// expect: rule[, rule]` comments."""
    expected = set()
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if match := _EXPECT.search(line):
            expected |= {(number, rule.strip()) for rule in match.group(1).split(",")}
    return expected


def build_of(text: str) -> Build:
    """The HIP build a sample (or a rule's `before`) declares with `// hip-build: -D NAME -U NAME` (hipify's -D / -U),
    else hipcc alone."""
    if not (match := _HIP_BUILD.search(text)):
        return HIPCC
    tokens = match.group(1).split()
    names = {flag: frozenset(name for given, name in zip(tokens, tokens[1:]) if given == flag) for flag in ("-D", "-U")}
    return Build(names["-D"], names["-U"])
