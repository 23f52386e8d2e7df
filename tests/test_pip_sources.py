"""tools/pip_sources.py: the sources pip is configured with become uv options, each once, in order."""

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "tools" / "pip_sources.py"


def load():
    spec = importlib.util.spec_from_file_location("pip_sources", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_pip_configuration_becomes_uv_options():
    listing = "\n".join(
        [
            ":env:.find-links='/opt/wheels'",
            ":env:.default-timeout='180'",  # not a source: left out
            "global.cert='/etc/ssl/certs/ca-certificates.crt'",
            "global.constraint='/etc/pip/constraints.txt'",
            "global.extra-index-url='file:///opt/pypi/simple file:///opt/more/simple'",
            "global.find-links='/opt/wheels'",  # the same folder again: once
            "user.index-url='https://mirror.example/simple'",
        ]
    )
    assert load().uv_options(listing) == [
        "--find-links",
        "/opt/wheels",
        "--constraint",
        "/etc/pip/constraints.txt",
        "--extra-index-url",
        "file:///opt/pypi/simple",
        "--extra-index-url",
        "file:///opt/more/simple",
        "--index-url",
        "https://mirror.example/simple",
    ]


def test_no_configuration_gives_no_options():
    assert load().uv_options("") == []
