"""``python -m benchmarks.gpu_probe``: the same as ``python benchmarks/gpu_probe.py``."""

import sys

from .cli import main

sys.exit(main())
