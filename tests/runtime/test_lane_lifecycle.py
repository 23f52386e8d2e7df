"""Nothing runs twice, nothing is left behind: the draft lanes under scripts, threads, interrupts and
a killed parent. One process lane (a tiny llama pair) serves the in-process tests; one run of an
unguarded script (tests/runtime/scripts/unguarded_ssd.py) serves the script, socket and SIGKILL tests.

Interrupts are real SIGINTs, sent to the main thread by a hook at a chosen call of the lane's protocol
(the n-th ``match``, the send of a request, ...), never by a timer racing the generation: each lands
where the test says, on a loaded machine as on an idle one."""

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path

import pytest
import torch
from transformers import LlamaForCausalLM

from saguaro.runtime.lanes import owner as lane_owner
from saguaro.runtime.lanes import process as process_lane
from saguaro.runtime.lanes import protocol
from saguaro.runtime.lanes import thread as lanes
from saguaro.runtime.lanes.draft_files import RemoteDraft
from saguaro.runtime.program import Program
from tests.conftest import tiny_pair
from tests.models import prompts, reference_greedy

REPO = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).parent / "scripts" / "unguarded_ssd.py"
SILENT_ENTRY_POINT = "tests.runtime.scripts.silent_draft"  # a draft process that never answers start-up

# one pytest-xdist worker runs this module (make test: --dist loadgroup), so its process lane and its
# unguarded script run once. Its signals go to this process's main thread and to its own children only, and
# it counts its own children only, so it shares the machine with the other worker's tests.
pytestmark = pytest.mark.xdist_group("lane_lifecycle")


def process_state(pid: int) -> str | None:
    """The state letter of ``pid`` in /proc (``Z``: defunct), or None when it does not exist."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return stat.rsplit(")", 1)[1].split()[0]


def draft_children(parent: int | None = None) -> set:
    """Children of ``parent`` (default: this process) running the draft process, defunct ones included."""
    parent = parent or os.getpid()
    found = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (entry / "cmdline").read_bytes()
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue
        entry_points = (process_lane.DRAFT_ENTRY_POINT.encode(), SILENT_ENTRY_POINT.encode())
        if ppid == parent and (
            any(e in cmdline for e in entry_points) or process_state(int(entry.name)) == "Z"
        ):
            found.add(int(entry.name))
    return found


def listening_sockets(pid: int) -> list:
    """TCP/TCP6 sockets of ``pid`` in the LISTEN state, as ``(local address, port)`` hex pairs."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except FileNotFoundError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                found.append(tuple(fields[1].split(":")))
    return found


def interrupted(fn) -> bool:
    """Run ``fn`` under Python's own SIGINT handler, as in a user's script (a test worker may hold
    another); True if a KeyboardInterrupt ended it."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        fn()
        return False
    except KeyboardInterrupt:
        return True
    finally:
        signal.signal(signal.SIGINT, previous)


def sigint_at(monkeypatch, owner, name: str, nth: int, after: bool = False, when=lambda *args: True) -> list:
    """Patch ``owner.name`` so that its ``nth`` call among those ``when(*args)`` accepts sends a real
    SIGINT to the main thread, before the call runs or once it has returned (``after``). The hooked
    calls run on the caller's (main) thread, so the signal arrives before ``pthread_kill`` returns and
    Python raises the KeyboardInterrupt right there, in the hook: none of the call has run, or all of it
    has. Returns a list that holds ``name`` once the SIGINT was sent."""
    real, seen, fired = getattr(owner, name), [0], []

    def hooked(*args, **kwargs):
        if when(*args):
            seen[0] += 1
        fire = seen[0] == nth and not fired
        if fire and not after:
            fired.append(name)
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
        result = real(*args, **kwargs)
        if fire and after:
            fired.append(name)
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
        return result

    monkeypatch.setattr(owner, name, hooked)
    return fired


def sent(method):
    """``when`` for ``process.send``: a request (a reply is awaited) of ``method``."""
    return lambda conn, message: message[1] == method and message[3]


@pytest.fixture(scope="module")
def process_program():
    target, _, compiled = tiny_pair("llama")  # k=4; its captured stages, reused
    program = compiled.reconfigure(mode="ssd", lane="process", lane_timeout_s=20)
    yield target, program
    program.close()


@pytest.fixture(scope="module", autouse=True)
def script_run(request, tmp_path_factory):
    """The unguarded script, started at the module's first test when a selected test needs it (so it
    runs while the others do) and held after its three calls (it waits on stdin)."""
    if not any(
        item.module is request.module and "unguarded" in item.fixturenames for item in request.session.items
    ):
        yield None
        return
    marker = tmp_path_factory.mktemp("unguarded") / "marker.txt"
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPT), str(marker), "--hold"],
        cwd=marker.parent,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    yield proc, marker
    if proc.poll() is None:
        proc.kill()
    proc.wait()


@pytest.fixture(scope="module")
def unguarded(script_run):
    proc, marker = script_run
    lines = [json.loads(proc.stdout.readline()) for _ in range(4)]
    return proc, marker, lines


@pytest.mark.parametrize("lane", ["process", "thread"])
def test_concurrent_callers_get_the_ar_tokens(process_program, lane):
    target, program = process_program
    program = program if lane == "process" else program.variant(lane="thread")
    jobs = [prompts(1 + i % 2, 6 + i, seed=20 + i) for i in range(4)]
    expected = [
        program.generate(ids, attention_mask=mask, max_new_tokens=16, eos_token_id=None, mode="ar")
        for ids, mask in jobs
    ]
    results, errors = {}, []

    def caller(i):
        try:
            for _ in range(2):
                ids, mask = jobs[i]
                results.setdefault(i, []).append(
                    program.generate(ids, attention_mask=mask, max_new_tokens=16, eos_token_id=None)
                )
        except Exception as exc:
            errors.append(exc)

    threads = [threading.Thread(target=caller, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert sorted(results) == list(range(len(jobs))) and all(len(outs) == 2 for outs in results.values())
    for i, outs in results.items():
        for out in outs:
            assert torch.equal(out.sequences, expected[i].sequences)
            assert (
                out.stats["mode"] == "ssd" and out.stats["lane"] == lane and out.stats["lane_failures"] == 0
            )


def interrupt_points(lane: str) -> list:
    """``(owner, name, nth, after, when)`` of each interrupt: before the first speculation is asked for,
    with a build running (during a verify), before a lookup, while the caller waits for the lane (the
    process lane: its request sent, the reply abandoned; the thread lane: the worker still building), and
    after a lookup was answered (before its hit or fallback is used)."""
    waiting = (
        (process_lane, "send", 8, True, sent(protocol.Method.MATCH))
        if lane == "process"
        else (lanes.ThreadLane, "settle", 8, False, lambda self, *args: self._posted is not None)
    )
    client, anyone = protocol.DraftClient, lambda *args: True
    return [
        (client, "start", 1, False, anyone),
        (client, "build", 3, True, anyone),
        (client, "match", 5, False, anyone),
        waiting,
        (client, "match", 20, True, anyone),
    ]


@pytest.mark.parametrize("lane", ["process", "thread"])
def test_ctrl_c_during_generate_leaves_the_lane_in_step(process_program, lane, monkeypatch):
    """Real SIGINTs at five points of SSD generations; then the same lane (no restart, no timeout)
    gives the AR tokens, and nothing else runs. A terminal's Ctrl-C also reaches the draft process,
    which ignores it."""
    target, program = process_program
    program = program if lane == "process" else program.variant(lane="thread")
    ids, mask = prompts(2, 8, seed=31, pad_rows={0: 2})
    expected = program.generate(
        ids, attention_mask=mask, max_new_tokens=40, eos_token_id=None, mode="ar"
    ).sequences
    draft_lane = program.lanes.lane()
    threads = torch.get_num_threads()
    for owner, name, nth, after, when in interrupt_points(lane):
        with monkeypatch.context() as patch:
            fired = sigint_at(patch, owner, name, nth, after, when)
            # 200 tokens: at least 40 rounds (k=4), past every point above
            stopped = interrupted(
                lambda: program.generate(ids, attention_mask=mask, max_new_tokens=200, eos_token_id=None)
            )
        assert fired == [name] and stopped, (name, nth, after, fired)
    if lane == "process":
        os.kill(draft_lane.lane.pid, signal.SIGINT)
    out = program.generate(ids, attention_mask=mask, max_new_tokens=40, eos_token_id=None)
    assert torch.equal(out.sequences, expected)
    assert (
        out.stats["mode"] == "ssd" and out.stats["lane_failures"] == 0 and program.lanes.lane() is draft_lane
    )
    assert torch.get_num_threads() == threads
    if lane == "process":
        assert draft_children() == {draft_lane.lane.pid}


@pytest.mark.parametrize("point", ["spawned", "init sent"])
def test_ctrl_c_during_lane_start_up_leaves_no_child_and_no_files(
    process_program, monkeypatch, tmp_path, point
):
    """Interrupted once the draft process exists: before it was sent its description, or while the caller
    waits for it to build its server."""
    program = process_program[1].reconfigure()  # the same stages, a lane of its own (not started)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # this lane's folder, apart from other tests'
    before = draft_children()
    folders = set(Path(tempfile.gettempdir()).glob("saguaro-draft-*"))
    if point == "spawned":
        fired = sigint_at(monkeypatch, process_lane.ProcessLane, "_spawn", 1, after=True)
    else:
        fired = sigint_at(monkeypatch, process_lane, "send", 1, after=True, when=sent(process_lane.INIT))
    ids, mask = prompts(1, 6, seed=3)
    assert interrupted(lambda: program.generate(ids, attention_mask=mask, max_new_tokens=8)) and fired
    assert draft_children() == before
    assert set(Path(tempfile.gettempdir()).glob("saguaro-draft-*")) <= folders
    assert program.lanes.failure is None and program.lane_kind == "process"  # an interrupt is no failure


def test_a_lane_start_past_its_limit_gives_way_to_the_thread_lane_once(process_program, monkeypatch):
    """A draft process that never answers start-up (not merely a slow one, which a fast machine could
    start within the limit)."""
    target, program = process_program
    program = program.reconfigure(lane_start_timeout_s=0.3)
    monkeypatch.setattr(process_lane, "DRAFT_ENTRY_POINT", SILENT_ENTRY_POINT)
    ids, mask = prompts(1, 6, seed=4)
    expected = reference_greedy(target, ids, mask, 10)
    before = draft_children()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = program.generate(ids, attention_mask=mask, max_new_tokens=10, eos_token_id=None)
        second = program.generate(ids, attention_mask=mask, max_new_tokens=10, eos_token_id=None)
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(messages) == 1 and "no answer to start-up within 0.3s" in messages[0], messages
    assert [w.filename for w in caught if issubclass(w.category, RuntimeWarning)] == [
        __file__
    ]  # the caller's line
    for out in (first, second):
        assert torch.equal(out.sequences, expected) and out.stats["lane"] == "thread"
        assert out.stats["mode"] == "ssd"
    assert draft_children() == before
    program.close()
    assert program.lane_kind == "process" and program.lanes.failure is None


def test_a_draft_class_the_draft_process_cannot_import_uses_the_thread_lane(process_program):
    target, draft, _ = tiny_pair("llama")

    class LocalDraft(LlamaForCausalLM):
        pass

    local = LocalDraft(draft.config).eval()
    local.load_state_dict(draft.state_dict())
    compiled = process_program[1]  # its stages, with the local class as the draft a draft process rebuilds
    program = Program(
        compiled.config,
        compiled.target,
        compiled.draft,
        compiled.pad_token_id,
        compiled.eos_token_id,
        compiled.shapes,
        RemoteDraft(local, "eager", "auto"),
    )
    ids, mask = prompts(1, 6, seed=5)
    with pytest.warns(RuntimeWarning, match="LocalDraft is defined in a function body.*thread lane"):
        out = program.generate(ids, attention_mask=mask, max_new_tokens=10, eos_token_id=None)
    assert (
        torch.equal(out.sequences, reference_greedy(target, ids, mask, 10)) and out.stats["lane"] == "thread"
    )
    program.close()


def test_a_thread_lane_that_cannot_start_is_tried_once(process_program, monkeypatch):
    program = process_program[1].reconfigure(lane="thread")
    attempts = []

    def broken(*args, **kwargs):
        attempts.append(1)
        raise lanes.DraftLaneError("no worker")

    monkeypatch.setattr(lane_owner, "ThreadLane", broken)
    ids, mask = prompts(1, 6, seed=8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        outs = [
            program.generate(ids, attention_mask=mask, max_new_tokens=8, eos_token_id=None) for _ in range(3)
        ]
    assert len([w for w in caught if "no worker" in str(w.message)]) == 1 and len(attempts) == 1
    assert all(out.stats["mode"] == "sd" for out in outs)
    program.close()  # forgets the failure: the next call tries again
    with pytest.warns(RuntimeWarning, match="no worker"):
        program.generate(ids, attention_mask=mask, max_new_tokens=8, eos_token_id=None)
    assert len(attempts) == 2


def test_a_lane_failure_mid_generation_warns_at_the_callers_line(process_program, monkeypatch):
    from saguaro.runtime.draft import tree

    target, program = process_program
    program = program.reconfigure(lane="thread")
    ids, mask = prompts(1, 6, seed=12)
    program.generate(ids, attention_mask=mask, max_new_tokens=8, eos_token_id=None)  # the lane's warm-up

    def broken(*args):
        raise RuntimeError("draft device lost")

    monkeypatch.setattr(tree, "build_speculations", broken)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = program.generate(ids, attention_mask=mask, max_new_tokens=8, eos_token_id=None)
    assert [(w.filename, "draft device lost" in str(w.message)) for w in caught] == [(__file__, True)]
    assert (
        torch.equal(out.sequences, reference_greedy(target, ids, mask, 8)) and out.stats["lane_failures"] == 1
    )
    program.close()


def test_seed_none_draws_from_torch_without_reseeding_it():
    _, _, program = tiny_pair("llama")
    ids, mask = prompts(2, 6, seed=9)

    def run():
        torch.manual_seed(1234)
        out = program.generate(
            ids, attention_mask=mask, max_new_tokens=12, temperature=1.0, seed=None, eos_token_id=None
        )
        return out.sequences, torch.rand(4)  # the user's own stream after the call

    (first, after_first), (second, after_second) = run(), run()
    assert torch.equal(first, second) and torch.equal(after_first, after_second)
    assert torch.initial_seed() == 1234


# the held script started at the module's first test; its tests come last, so it ran meanwhile
def test_a_script_without_main_guard_runs_once_and_gets_the_process_lane(unguarded):
    proc, marker, lines = unguarded
    calls, draft_pid = lines[:3], lines[3]["draft_pid"]
    assert marker.read_text().count("top level ran") == 1
    assert all(
        c["mode"] == "ssd" and c["lane"] == "process" and c["lane_failures"] == 0 and c["exact"]
        for c in calls
    ), calls
    assert draft_pid in draft_children(proc.pid)


def test_the_process_lane_listens_on_no_address(unguarded):
    """No TCP listener in the caller or the draft process: the lane is an anonymous socket pair."""
    proc, _, lines = unguarded
    with socket.create_server(("127.0.0.1", 0)) as listener:  # the check sees a listener where there is one
        port = f"{listener.getsockname()[1]:04X}"
        assert port in [p for _, p in listening_sockets(os.getpid())]
    for pid in (proc.pid, lines[3]["draft_pid"]):
        assert listening_sockets(pid) == [], pid


def test_a_killed_parent_leaves_no_draft_process(unguarded):
    proc, _, lines = unguarded
    draft_pid = lines[3]["draft_pid"]
    assert process_state(draft_pid) not in (None, "Z")
    proc.kill()  # SIGKILL: no cleanup runs in the parent
    proc.wait()
    deadline = time.monotonic() + 5
    while process_state(draft_pid) not in (None, "Z") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert process_state(draft_pid) in (None, "Z"), "the draft process outlived its killed parent"
