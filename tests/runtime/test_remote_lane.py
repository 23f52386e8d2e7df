"""The remote lane (``lane="remote"``) against a real ``saguaro draft-server`` child on loopback (gloo):
exact greedy and sampled output, the secret, garbage on the port, faults, and the listening sockets.

One server serves every test of the module (its start-up, about 6 s, is the bulk of the cost); the
fault test kills it and starts it again on the same address. Each test closes its Programs: a server
serves one target at a time.
"""

import functools
import os
import shutil
import socket
import subprocess
import warnings

import pytest
import torch

import saguaro
from saguaro.cli.main import main as cli_main
from saguaro.core.config import SaguaroConfig
from saguaro.core.errors import ConfigError
from saguaro.runtime.lanes import remote
from saguaro.runtime.lanes.protocol import DraftLaneError, Method
from tests.models import prompts, reference_greedy
from tests.runtime.remote_server_util import ServerProcess, free_port
from tests.runtime.test_ssd_sampling import PROMPT, VOCAB, exact_late_joint, models
from tests.stats_util import chi_square_pvalue

# one worker runs this file (make test: --dist loadgroup), so the module's draft server starts once
pytestmark = [pytest.mark.heavy, pytest.mark.xdist_group("remote_lane")]
SECRET = b"correct horse battery staple"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("remote")
    models()[1].save_pretrained(folder / "draft")
    (folder / "secret").write_bytes(SECRET + b"\n")
    (folder / "secret").chmod(0o600)
    process = ServerProcess(f"127.0.0.1:{free_port()}", folder / "draft", folder / "secret").start()
    yield process
    process.stop()


@pytest.fixture(autouse=True)
def no_env_secret(monkeypatch):
    monkeypatch.delenv("SAGUARO_DRAFT_SECRET", raising=False)


def compile_remote(server, draft=None, **options):
    target, _ = models()
    options = dict(
        k=2,
        mode="ssd",
        backend="eager",
        sd_when_faster=False,
        draft_address=server.address,
        draft_secret_file=str(server.secret_file),
        **options,
    )
    return saguaro.compile(target, draft, **options)


@functools.cache
def _remote_only(address, secret_file):  # one capture of the target for the module's draft=None programs
    return compile_remote(_Server(address, secret_file))


class _Server:
    def __init__(self, address, secret_file):
        self.address, self.secret_file = address, secret_file


def remote_only(server, **runtime):
    return _remote_only(server.address, str(server.secret_file)).reconfigure(**runtime)


@pytest.mark.parametrize("batch", [1, 3])
def test_greedy_tokens_over_the_remote_lane_equal_generate(server, batch):
    target, _ = models()
    program = remote_only(server)
    ids, mask = prompts(batch, 6, vocab_size=VOCAB, seed=batch, pad_rows={0: 2} if batch > 1 else None)
    try:
        out = program.generate(ids, attention_mask=mask, max_new_tokens=12, eos_token_id=None, trace=True)
    finally:
        program.close()
    assert torch.equal(out.sequences, reference_greedy(target, ids, mask, 12))
    assert out.stats["lane"] == "remote" and out.stats["mode"] == "ssd" and out.stats["lane_failures"] == 0
    pids = {e["pid"] for e in out.trace["traceEvents"] if e.get("cat") == "draft"}
    assert server.pid in pids  # the server's own stage calls, on the caller's clock
    (clock,) = out.trace["otherData"]["clock_offsets"]
    assert clock["source"].endswith(server.address) and "offset_ns_applied" in clock


def test_a_batch_session_over_the_remote_lane_gives_each_row_its_solo_tokens(server):
    """Continuous batching in mode ``ssd`` over the wire: rows join the server's batch (``join_rows``) and leave
    it (``keep_rows``) between rounds, both sides keeping the batch in step, and each row is its solo output."""
    from saguaro.runtime.batching import BatchSession
    from tests.runtime.test_batch_session import drive, solo

    program = remote_only(server)
    ids, _ = prompts(3, 8, vocab_size=VOCAB, seed=9)
    requests = [
        (0, ids[0, :5].tolist(), 30, None),
        (1, ids[1, :8].tolist(), 6, None),
        (2, ids[2, :3].tolist(), 10, None),
    ]
    try:
        session = BatchSession(program)
        tokens, sizes = drive(session, requests, leave_at={0: 4})
        assert session.run == "ssd" and session.lanes_failed == 0 and max(sizes) == 3, session.why
        for i, (_, prompt, budget, _) in enumerate(requests):
            want = solo(program, prompt, budget)
            assert tokens[i] == want[: len(tokens[i])] and (i == 0 or tokens[i] == want), i
        assert len(tokens[0]) < len(solo(program, requests[0][1], 30))  # it left early
    finally:
        program.close()


def test_sampling_over_the_remote_lane_keeps_the_target_distribution(server):
    program = remote_only(server, fan_out=[2, 2, 2], fallback="neural", saguaro_c=0.5)
    counts = torch.zeros(VOCAB, VOCAB, dtype=torch.long)
    try:
        for seed in (0, 1):
            out = program.generate(
                PROMPT.expand(1000, -1), max_new_tokens=4, temperature=1.0, seed=seed, eos_token_id=None
            )
            assert out.stats["lane"] == "remote" and out.stats["lane_failures"] == 0
            assert 0.0 < out.stats["cache_hit_rate"] < 1.0  # hits and fallbacks both served remotely
            t3, t4 = out.sequences[:, -2], out.sequences[:, -1]
            counts += torch.bincount(t3 * VOCAB + t4, minlength=VOCAB * VOCAB).reshape(VOCAB, VOCAB)
    finally:
        program.close()
    assert chi_square_pvalue(counts, exact_late_joint()) > 1e-3


def test_a_wrong_secret_is_refused_and_the_right_one_then_served(server, tmp_path):
    wrong = tmp_path / "wrong"
    wrong.write_bytes(b"not the secret")
    target, _ = models()
    with pytest.raises(DraftLaneError, match="does not know our secret"):
        saguaro.compile(
            target,
            None,
            k=2,
            mode="ssd",
            backend="eager",
            draft_address=server.address,
            draft_secret_file=str(wrong),
        )
    with pytest.raises(DraftLaneError, match="does not know our secret"):  # no secret at all
        saguaro.compile(target, None, k=2, mode="ssd", backend="eager", draft_address=server.address)
    assert probe(server)["vocab_size"] == VOCAB and server.alive()


def _spec():
    from saguaro.capture import model_spec

    return model_spec(models()[0])


def probe(server) -> dict:
    config = SaguaroConfig(k=2, draft_address=server.address, draft_secret_file=str(server.secret_file))
    return remote.RemoteEndpoint(config, _spec()).probe()


def closed_on_us(sock) -> bool:
    """The server closed the connection without answering (a reset when our bytes were left unread)."""
    sock.settimeout(30)
    try:
        return sock.recv(100) == b""
    except ConnectionResetError:
        return True


def test_random_bytes_on_the_port_leave_the_server_serving(server):
    host, port = server.address.rsplit(":", 1)
    noise = torch.randint(0, 256, (1000,), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(bytes(noise.tolist()))
        assert closed_on_us(sock)
    with socket.create_connection((host, int(port))) as sock:  # a valid magic, then a lying length
        sock.sendall(b"SGRH\x01\xff\xff\xff\xff" + bytes(64))
        assert closed_on_us(sock)
    assert server.alive() and probe(server)["k"] == 2


def test_a_reply_out_of_sequence_finishes_exactly_and_the_next_call_reconnects(server, monkeypatch):
    """No local draft: the generation finishes with the target alone (AR), exactly."""
    target, _ = models()
    program = remote_only(server)
    ids, mask = prompts(2, 6, vocab_size=VOCAB, seed=11)
    expected = reference_greedy(target, ids, mask, 12)
    real_send, matches = remote.RemoteLane._send, []

    def send(self, method, code, args):
        real_send(self, method, code, args)
        if method is Method.MATCH and len(matches) == 1:
            self._seq += 1  # the reply now carries a number the lane does not expect
        matches.append(method) if method is Method.MATCH else None

    try:
        program.generate(
            ids, attention_mask=mask, max_new_tokens=12, eos_token_id=None
        )  # connected, warmed up
        monkeypatch.setattr(remote.RemoteLane, "_send", send)
        with pytest.warns(RuntimeWarning, match="out of sequence.*finishing this generation with AR"):
            out = program.generate(ids, attention_mask=mask, max_new_tokens=12, eos_token_id=None)
        assert torch.equal(out.sequences, expected) and out.stats["lane_failures"] == 1
        monkeypatch.undo()
        again = program.generate(ids, attention_mask=mask, max_new_tokens=12, eos_token_id=None)
    finally:
        program.close()
    assert torch.equal(again.sequences, expected)
    assert (
        again.stats["lane"] == "remote" and again.stats["mode"] == "ssd" and again.stats["lane_failures"] == 0
    )


def test_mode_sd_without_a_local_draft_is_a_config_error(server):
    with pytest.raises(ConfigError, match="local draft"):
        remote_only(server).generate(prompts(1, 4, vocab_size=VOCAB)[0], max_new_tokens=2, mode="sd")


def test_the_server_listens_only_on_the_requested_address(server):
    if shutil.which("ss") is None:
        pytest.skip("ss (iproute2) is not installed")
    lines = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout.splitlines()
    ours = [line.split()[3] for line in lines if f"pid={server.pid}," in line]
    if not ours:
        pytest.skip("ss shows no process names here (not permitted to see other processes' sockets)")
    assert server.address in ours and {a.rsplit(":", 1)[0] for a in ours} == {"127.0.0.1"}, ours


def test_server_killed_mid_generation_finishes_with_sd_and_a_restarted_server_is_found_again(
    server, monkeypatch
):
    target, draft = models()
    program = compile_remote(server, draft)  # a local draft: SD finishes what the lane cannot
    ids, mask = prompts(3, 6, vocab_size=VOCAB, seed=7, pad_rows={2: 1})
    expected = reference_greedy(target, ids, mask, 14)
    real_call = remote.RemoteLane.call

    def call(self, method, *args, **kwargs):
        if method is Method.MATCH and server.alive():
            server.kill()  # between two rounds: the build is posted, the match finds nobody
        return real_call(self, method, *args, **kwargs)

    try:
        assert torch.equal(
            program.generate(ids, attention_mask=mask, max_new_tokens=14, eos_token_id=None).sequences,
            expected,
        )
        monkeypatch.setattr(remote.RemoteLane, "call", call)
        with pytest.warns(RuntimeWarning, match="finishing this generation with SD"):
            out = program.generate(ids, attention_mask=mask, max_new_tokens=14, eos_token_id=None)
        monkeypatch.undo()
        assert torch.equal(out.sequences, expected) and out.stats["lane_failures"] == 1 and not server.alive()
        with pytest.warns(RuntimeWarning, match="cannot reach the draft server"):
            down = program.generate(ids, attention_mask=mask, max_new_tokens=14, eos_token_id=None)
        assert torch.equal(down.sequences, expected) and down.stats["mode"] == "sd"
        server.start()  # the same address
        back = program.generate(ids, attention_mask=mask, max_new_tokens=14, eos_token_id=None)
    finally:
        program.close()
    assert torch.equal(back.sequences, expected)
    assert back.stats["lane"] == "remote" and back.stats["mode"] == "ssd" and back.stats["lane_failures"] == 0


def test_a_non_loopback_address_without_a_secret_refuses_to_start(capsys, monkeypatch):
    port = free_port()
    assert cli_main(["draft-server", "--listen", f"0.0.0.0:{port}"]) == 2
    assert "without a secret" in capsys.readouterr().err
    with socket.socket() as s:  # nothing was bound
        s.bind(("0.0.0.0", port))


def test_ctrl_c_ends_the_server_cleanly(server):
    code, printed = server.interrupt()
    assert code == 0 and "saguaro draft-server: stopped" in printed, (printed, server.stderr()[-3000:])
    if "forced" in printed:  # a native wait held the interrupt (see stop_watchdog): where, for the log
        warnings.warn(
            f"the draft server's stop was forced; its stacks:\n{server.stderr()[-3000:]}", stacklevel=2
        )
    host, port = server.address.rsplit(":", 1)
    with socket.socket() as s:  # the address is free again
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((host, int(port)))
    assert os.path.exists(server.secret_file)
