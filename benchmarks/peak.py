"""The machine's matmul peak: `python benchmarks/peak.py [--n 2048]`.

Every MFU figure of the other benchmarks divides by this, measured in the same run.
"""

from __future__ import annotations

import argparse

from common import emit, machine, matmul_peak_flops


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--n", type=int, default=2048, help="matrix size")
    args = parser.parse_args()
    figures = {
        f"{dtype}_gflops": matmul_peak_flops(args.n, dtype) / 1e9
        for dtype in ("float32", "bfloat16")
    }
    emit({"workload": "matmul_peak", "n": args.n, **figures, "machine": machine()})


if __name__ == "__main__":
    main()
