"""The GPU probe's command (the package ``benchmarks/gpu_probe/`` holds it): ``python benchmarks/gpu_probe.py
--part A --out DIR``; ``--help`` lists the parts and options."""

import sys
from pathlib import Path

sys.path.insert(
    0, str(Path(__file__).resolve().parents[1])
)  # the repository: benchmarks and saguaro from a checkout

from benchmarks.gpu_probe.cli import main

if __name__ == "__main__":
    sys.exit(main())
