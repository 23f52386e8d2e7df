"""The remote lane between two network namespaces: target and draft server on two addresses that are
not loopback (a veth pair, addresses of the test's choosing, private to the test)."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.runtime.test_ssd_sampling import models

pytestmark = pytest.mark.heavy
ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).parent / "scripts" / "remote_lane_netns.py"


def namespaces_available() -> str | None:
    """None, or why this runner may not create network namespaces with a veth pair."""
    for tool in ("unshare", "ip"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed"
    probe = subprocess.run(
        ["unshare", "-n", "sh", "-c", "ip link add va type veth peer name vb"], capture_output=True, text=True
    )
    if probe.returncode != 0:
        return f"cannot create a network namespace with a veth pair here: {probe.stderr.strip()}"
    return None


def test_target_and_draft_server_on_two_non_loopback_addresses(tmp_path):
    why = namespaces_available()
    if why is not None:
        pytest.skip(why)
    models()[1].save_pretrained(tmp_path / "draft")
    (tmp_path / "secret").write_bytes(b"a secret for the veth pair")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("SAGUARO_DRAFT_SECRET", None)
    done = subprocess.run(
        ["unshare", "-n", sys.executable, str(SCRIPT), str(tmp_path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert "10.213.7.2:7321" in seen["listening"]
    assert seen["equal"] and seen["lane"] == "remote" and seen["mode"] == "ssd" and seen["failures"] == 0
    assert (seen["local"], seen["peer"]) == ("10.213.7.1", "10.213.7.2")
