"""The CUDA sample corpus of the port tests and its `// expect: rule-id` markers."""

import re
from pathlib import Path

CORPUS = Path(__file__).parent / "corpus"
CLEAN_SAMPLE = CORPUS / "clean_silu_mul.cu"
SAMPLES = sorted(CORPUS.glob("*.cu*"))
_EXPECT = re.compile(r"//\s*expect:\s*(.+)$")


def expected_findings(path: Path) -> set[tuple[int, str]]:
    """(line, rule id) pairs the sample declares with `// expect: rule[, rule]` comments."""
    expected = set()
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if match := _EXPECT.search(line):
            expected |= {(number, rule.strip()) for rule in match.group(1).split(",")}
    return expected
