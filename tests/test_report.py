"""``saguaro report``: the page renders in a real headless browser (Chromium) with its figures drawn
and its script run; without a browser the test is skipped, saying so."""

import collections
import re
import shutil
import struct
import subprocess
import zlib

import pytest
import torch

import saguaro
from saguaro.core.stages import stages_for
from saguaro.inspection.graph_view import have_dot
from saguaro.inspection.report import write_report
from tests.conftest import tiny_pair

BROWSERS = ("chromium", "chromium-browser", "google-chrome")
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def browser():
    found = next((shutil.which(b) for b in BROWSERS if shutil.which(b)), None)
    if found is None:
        pytest.skip("no headless Chromium installed (`make test-deps` installs Debian's chromium)")
    return found


def run_browser(exe, tmp_path, *args) -> str:
    profile = tmp_path / f"profile-{len(list(tmp_path.iterdir()))}"
    done = subprocess.run(
        [exe, *FLAGS, f"--user-data-dir={profile}", *args], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def ink(png_path) -> float:
    """Share of the PNG's (filtered) pixel bytes that differ from its most common byte: ~0 for a
    blank page."""
    data, chunks, i = png_path.read_bytes(), [], 8
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    while i < len(data):
        n, kind = struct.unpack(">I4s", data[i : i + 8])
        if kind == b"IDAT":
            chunks.append(data[i + 8 : i + 8 + n])
        i += 12 + n
    raw = zlib.decompress(b"".join(chunks))
    return 1 - collections.Counter(raw).most_common(1)[0][1] / len(raw)


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    target, draft, _ = tiny_pair("llama")
    program = saguaro.compile(
        target,
        draft,
        k=4,
        mode="ssd",
        lane="thread",
        fan_out="geometric",
        backend="eager",
        sd_when_faster=False,
    )
    path = tmp_path_factory.mktemp("report") / "report.html"
    try:
        write_report(program, path, input_ids=torch.arange(3, 12)[None], max_new_tokens=32)
    finally:
        program.close()
    return path


def test_report_is_self_contained(report):
    page = report.read_text()
    assert "<script>" in page and not re.search(r'(src|href)="(https?:)?//', page)  # nothing fetched
    anchors = re.findall(r'href="#([\w-]+)"', page)
    assert len(anchors) == len(stages_for("ssd", 0.0))  # one link per stage graph of an SSD generation
    for anchor in anchors:
        assert f'id="{anchor}"' in page, f"link to #{anchor} leads nowhere"


def test_report_renders_in_a_headless_browser(report, tmp_path):
    exe = browser()
    dom = run_browser(exe, tmp_path, "--dump-dom", report.as_uri())
    assert 'data-rendered="yes"' in dom, "the page's script did not run"
    charts = int(re.search(r'id="charts-count">(\d+)<', dom).group(1))
    assert charts == 5  # timeline, acceptance, hits by position, hits over time, fan-out
    for cls in ("timeline", "acceptance", "hits", "hits-over-time", "fan-out"):
        assert f'class="chart {cls}"' in dom
    assert dom.count('class="slice"') > 10 and dom.count('class="bar"') >= 4 + 5 + 5
    if have_dot():
        assert re.search(r'<div id="schedule"><svg', dom) and dom.count('class="graph"') >= 6
    shot, blank = tmp_path / "report.png", tmp_path / "blank.png"
    run_browser(exe, tmp_path, f"--screenshot={shot}", "--window-size=1200,1600", report.as_uri())
    run_browser(exe, tmp_path, f"--screenshot={blank}", "--window-size=1200,1600", "about:blank")
    assert ink(blank) < 0.001 and ink(shot) > 0.005, (ink(blank), ink(shot))  # a blank page has no ink
