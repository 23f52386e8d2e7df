"""AR vs SD (vs SSD) vs transformers assisted generation: prints a table, writes JSON.

A thin wrapper over ``saguaro bench``; every option is the CLI's (``python benchmarks/bench.py --help``).
Example: ``python benchmarks/bench.py --prompts 8 --max-new-tokens 64 --json bench.json``.
"""

import sys

from saguaro.cli.main import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
