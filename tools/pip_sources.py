"""Print the package sources pip is configured with as uv options, for ``make venv``.

uv reads no pip configuration, and a machine may keep packages where only its pip configuration says
(this project's machines keep the CPU build of torch in a find-links folder and mirror PyPI in local
indexes). Reads ``pip config list`` (files and ``PIP_*`` variables); prints nothing where pip has none.
"""

import shlex
import subprocess
import sys

OPTIONS = {
    "find-links": "--find-links",
    "index-url": "--index-url",
    "extra-index-url": "--extra-index-url",
    "constraint": "--constraint",
}


def uv_options(listing: str) -> list[str]:
    """uv options for the ``key='value'`` lines of ``pip config list`` (each value once, in order)."""
    pairs = []
    for line in listing.splitlines():
        key, sep, value = line.partition("=")
        option = OPTIONS.get(key.rsplit(".", 1)[-1])
        if not sep or option is None:
            continue
        for item in " ".join(shlex.split(value)).split():
            if (option, item) not in pairs:
                pairs.append((option, item))
    return [part for pair in pairs for part in pair]


def main() -> None:
    listing = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True, check=False
    ).stdout
    print(shlex.join(uv_options(listing)))


if __name__ == "__main__":
    main()
