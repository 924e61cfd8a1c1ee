"""Put this folder first on PYTHONPATH to run Python where TileLang cannot be imported (the kernel library's test:
`benchmarks/h200_verify_bench.sh library`)."""

import sys

sys.modules["tilelang"] = None
