"""Run inside ``unshare -n`` by ``tests/runtime/test_remote_lane_netns.py``: a veth pair between this
network namespace (the target, 10.213.7.1) and a nested one (the draft server, 10.213.7.2), both
private to the test; prints one JSON line with what the target saw. Usage: SCRIPT FOLDER."""

import json
import subprocess
import sys
from pathlib import Path

import torch

import saguaro
from tests.models import prompts, reference_greedy
from tests.runtime.remote_server_util import server_command
from tests.runtime.test_ssd_sampling import VOCAB, models

TARGET_IP, DRAFT_IP, PORT = "10.213.7.1", "10.213.7.2", 7321


def ip(*args):
    subprocess.run(["ip", *args], check=True)


def main(folder: Path) -> None:
    ip("link", "set", "lo", "up")
    ip("link", "add", "veth-t", "type", "veth", "peer", "name", "veth-d")
    command = " ".join(
        f"'{a}'" for a in server_command(f"{DRAFT_IP}:{PORT}", folder / "draft", folder / "secret")
    )
    setup = (
        f"echo in; read go; ip link set lo up; ip addr add {DRAFT_IP}/24 dev veth-d; ip link set veth-d up; "
        f"exec {command}"
    )
    server = subprocess.Popen(
        ["unshare", "-n", "sh", "-c", setup], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert server.stdout.readline().strip() == "in"  # the nested namespace exists now
        ip("link", "set", "veth-d", "netns", str(server.pid))
        ip("addr", "add", f"{TARGET_IP}/24", "dev", "veth-t")
        ip("link", "set", "veth-t", "up")
        server.stdin.write("go\n")
        server.stdin.flush()
        lines = [server.stdout.readline().strip(), server.stdout.readline().strip()]
        assert lines[1] == "ready", lines
        target, _ = models()
        program = saguaro.compile(
            target,
            None,
            k=2,
            mode="ssd",
            backend="eager",
            sd_when_faster=False,
            draft_address=f"{DRAFT_IP}:{PORT}",
            draft_secret_file=str(folder / "secret"),
        )
        ids, mask = prompts(2, 6, vocab_size=VOCAB, seed=3)
        out = program.generate(ids, attention_mask=mask, max_new_tokens=10, eos_token_id=None)
        lane = program.lanes.lane().lane
        local, peer = lane.sock.getsockname()[0], lane.sock.getpeername()[0]
        program.close()
        print(
            json.dumps(
                {
                    "listening": lines[0],
                    "equal": torch.equal(out.sequences, reference_greedy(target, ids, mask, 10)),
                    "lane": out.stats["lane"],
                    "mode": out.stats["mode"],
                    "failures": out.stats["lane_failures"],
                    "local": local,
                    "peer": peer,
                }
            )
        )
    finally:
        server.kill()
        server.wait()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
