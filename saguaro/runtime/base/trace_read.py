"""Reading a trace back (tests, the HTML report): format checks, slices (begin/end pairs per ``(pid,
tid)``), counters, the lanes' overlap, stage costs."""

from __future__ import annotations

from dataclasses import dataclass

REQUIRED_KEYS = ("name", "ph", "ts", "pid", "tid")
PHASES = {"B", "E", "C", "i", "M"}
DRAFT_WORK = ("build", "match")  # the draft lane's per-round work that the host may wait for


@dataclass(frozen=True)
class Slice:
    pid: int
    track: str
    name: str
    start_us: float
    end_us: float
    args: dict

    @property
    def dur_us(self) -> float:
        return self.end_us - self.start_us


def check_trace(trace: dict) -> None:
    """``ValueError`` naming the first malformed event, backwards timestamp or unmatched begin/end."""
    events = trace.get("traceEvents")
    if not isinstance(events, list):
        raise ValueError("trace has no traceEvents list")
    last, stacks = {}, {}
    for i, e in enumerate(events):
        missing = [k for k in REQUIRED_KEYS if k not in e]
        if missing:
            raise ValueError(f"event {i} ({e.get('name')!r}) lacks {missing}")
        if e["ph"] not in PHASES:
            raise ValueError(f"event {i} has phase {e['ph']!r}; allowed: {sorted(PHASES)}")
        if e["ph"] == "M":
            continue
        key = (e["pid"], e["tid"])
        if e["ts"] < last.get(key, float("-inf")):
            raise ValueError(f"event {i} ({e['name']!r}) goes back in time on track {key}")
        last[key] = e["ts"]
        if e["ph"] == "B":
            stacks.setdefault(key, []).append(e["name"])
        elif e["ph"] == "E":
            stack = stacks.get(key)
            if not stack or stack.pop() != e["name"]:
                raise ValueError(f"event {i} ends {e['name']!r} on track {key} without its begin")
    open_slices = {key: stack for key, stack in stacks.items() if stack}
    if open_slices:
        raise ValueError(f"slices begun and never ended: {open_slices}")


def track_names(trace: dict) -> dict:
    """``{(pid, tid): track name}`` from the thread_name metadata."""
    return {
        (e["pid"], e["tid"]): e["args"]["name"]
        for e in trace["traceEvents"]
        if e["ph"] == "M" and e["name"] == "thread_name"
    }


def slices(trace: dict) -> list[Slice]:
    """Every begin/end pair as a :class:`Slice`, in order of their ends."""
    names, stacks, out = track_names(trace), {}, []
    for e in trace["traceEvents"]:
        key = (e["pid"], e["tid"])
        if e["ph"] == "B":
            stacks.setdefault(key, []).append(e)
        elif e["ph"] == "E":
            begin = stacks[key].pop()
            out.append(
                Slice(
                    e["pid"],
                    names.get(key, str(key)),
                    begin["name"],
                    begin["ts"],
                    e["ts"],
                    begin.get("args", {}),
                )
            )
    return out


def counters(trace: dict, name: str) -> list[tuple[float, dict]]:
    """``(ts, values)`` of every sample of the counter ``name``."""
    return [(e["ts"], e["args"]) for e in trace["traceEvents"] if e["ph"] == "C" and e["name"] == name]


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def _intersection_us(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Total length of the intersection of two unions of intervals."""
    a, b = _union(a), _union(b)
    total, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        total += max(0.0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def _length_us(intervals) -> float:
    return sum(end - start for start, end in _union(intervals))


def lane_overlap(trace: dict) -> dict:
    """Seconds of the draft lane's per-round work the target lane hid, from the slices alone. Per round that
    waits for ``match`` (until ``m1``): draft work is ``build`` and ``match`` before ``m1``, target work
    ``target.verify`` and ``commit``; ``overlap_s`` is draft work during target work, ``exposed_work_s``
    the rest, ``transport_s`` a process lane's ``match`` messages in flight, ``exposed_s`` draft work and
    transport not hidden (about ``stats["draft_wait_s"]``); and ``verify_s``, ``draft_work_s``, ``rounds``."""
    all_slices = slices(trace)
    host = [s for s in all_slices if s.track == "host"]
    target = [s for s in all_slices if s.track == "target"]
    draft = [s for s in all_slices if s.track == "draft"]
    keys = ("verify_s", "draft_work_s", "overlap_s", "exposed_work_s", "transport_s", "exposed_s")
    totals = dict.fromkeys(keys, 0.0) | {"rounds": 0}
    for r in (s for s in host if s.name == "round"):
        within = lambda s, end: r.start_us <= s.start_us < end  # noqa: B023 (called in this iteration)
        wait = next((s for s in host if s.name == "wait: match" and within(s, r.end_us)), None)
        if wait is None:
            continue  # the last round: nobody waits for its build
        m1 = wait.end_us
        verify = [(s.start_us, s.end_us) for s in target if ".verify" in s.name and within(s, m1)]
        busy = verify + [(s.start_us, s.end_us) for s in host if s.name == "commit" and within(s, m1)]
        work = [(s.start_us, s.end_us) for s in draft if s.name in DRAFT_WORK and within(s, m1)]
        flights = _flights(host, draft, wait)
        length, overlap = _length_us(work), _intersection_us(work, busy)
        exposed = _length_us(work + flights) - _intersection_us(work + flights, busy)
        for key, value in zip(
            keys, (_length_us(verify), length, overlap, length - overlap, _length_us(flights), exposed)
        ):
            totals[key] += value / 1e6
        totals["rounds"] += 1
    return totals


def _flights(host: list[Slice], draft: list[Slice], wait: Slice) -> list[tuple[float, float]]:
    """The ``match`` request's and reply's time in flight between the processes, within ``wait``."""
    inside = lambda s: wait.start_us <= s.start_us < wait.end_us
    match = next(
        (s for s in draft if s.name == "match" and s.start_us < wait.end_us and s.end_us > wait.start_us),
        None,
    )
    if match is None:
        return []
    flights = []
    request = next((s for s in host if s.name == "send match" and inside(s)), None)
    received = [s for s in draft if s.name == "recv" and s.end_us <= match.start_us]
    if request is not None and received:
        flights.append((request.start_us, received[-1].end_us))
    reply = next((s for s in draft if s.name == "send match" and s.start_us >= match.end_us), None)
    answer = next((s for s in host if s.name == "recv" and inside(s)), None)
    if reply is not None and answer is not None:
        flights.append((reply.start_us, answer.end_us))
    return flights


def stage_costs(trace: dict) -> dict:
    """Mean seconds per call of each stage (tree depths together) and of the draft's ``match``."""
    durations: dict = {}
    for s in slices(trace):
        if s.track in ("target", "draft") and "." in s.name:
            durations.setdefault(s.name.split(" depth ")[0], []).append(s.dur_us)
        elif s.track == "draft" and s.name == "match":
            durations.setdefault("match", []).append(s.dur_us)
    return {name: sum(d) / len(d) / 1e6 for name, d in durations.items()}
