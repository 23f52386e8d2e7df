"""Device→host reads per SSD round, counted on the CPU.

On CUDA a device→host read (``.item()``, ``bool(t)``, ``int(t)``, ``.tolist()``, ``.cpu()``,
``.nonzero()``, a boolean-mask index) waits for the device. On the CPU the same calls cost nothing, but
they are exactly the calls that sync on CUDA, so counting them during an SSD generation on the CPU is
the honest check that a round stays at one read per lane: the outcome on the target lane (``commit``),
the build's candidate table on the draft lane (``SpeculationServer._read_build``, off the critical
path). Everything else a round decides is host data.
"""

from __future__ import annotations

import collections
import sys
import threading
from pathlib import Path

import pytest
import torch

import saguaro
from saguaro.runtime.decode import ssd
from tests.conftest import tiny_program
from tests.models import prompts

READS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "numpy", "cpu", "nonzero")
PACKAGE = Path(saguaro.__file__).parent
# the fan-out estimator's statistics are CPU tensors by construction (device="cpu"), fed host lists:
# its reads are host work, not syncs
HOST_MODULES = (PACKAGE / "runtime" / "draft" / "fan_out.py",)
MAX_READS_PER_ROUND = 2  # the outcome (target lane) and the candidate table (draft lane)


class ReadCounter:
    """Records every device→host read made by Saguaro code while installed: ``(round, what, where)``;
    ``round`` is the SSD round running when it happened (None before the first)."""

    def __init__(self):
        self.round = None
        self.reads: list[tuple] = []
        self._lock = threading.Lock()

    def install(self, monkeypatch) -> None:
        for name in READS:
            monkeypatch.setattr(torch.Tensor, name, self._counted(name, getattr(torch.Tensor, name)))
        monkeypatch.setattr(torch, "nonzero", self._counted("torch.nonzero", torch.nonzero))
        for name in ("__getitem__", "__setitem__"):
            monkeypatch.setattr(torch.Tensor, name, self._masked(name, getattr(torch.Tensor, name)))
        real_round = ssd.ssd_round

        def counted_round(*args):
            self.round = 1 if self.round is None else self.round + 1
            return real_round(*args)

        monkeypatch.setattr(ssd, "ssd_round", counted_round)

    def _record(self, what: str) -> None:
        frame = sys._getframe(2)
        while frame is not None and not frame.f_code.co_filename.startswith(str(PACKAGE)):
            frame = frame.f_back  # torch's own Python code on the way: the read belongs to its Saguaro caller
        if frame is None or Path(frame.f_code.co_filename) in HOST_MODULES:
            return
        where = f"{Path(frame.f_code.co_filename).relative_to(PACKAGE.parent)}:{frame.f_lineno}"
        with self._lock:
            self.reads.append((self.round, what, where))

    def _counted(self, name, original):
        def counted(*args, **kwargs):
            self._record(name)
            return original(*args, **kwargs)
        return counted

    def _masked(self, name, original):
        def indexed(tensor, index, *value):
            parts = index if isinstance(index, tuple) else (index,)
            if any(isinstance(p, torch.Tensor) and p.dtype == torch.bool for p in parts):
                self._record(f"{name} with a boolean mask")  # a nonzero inside
            return original(tensor, index, *value)
        return indexed

    def per_round(self, rounds: int) -> list[int]:
        counts = collections.Counter(r for r, _, _ in self.reads)
        return [counts.get(r, 0) for r in range(1, rounds + 1)]

    def where(self) -> str:
        places = collections.Counter((what, where) for _, what, where in self.reads)
        return "\n".join(f"  {n:4d} x {what} at {where}" for (what, where), n in places.most_common())


CASES = {
    "greedy-neural": dict(temperature=0.0, fallback="neural"),
    "greedy-fast": dict(temperature=0.0, fallback="fast"),
    "sampled-neural": dict(temperature=1.0, fallback="neural"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_an_ssd_round_reads_the_device_once_per_lane(case, monkeypatch):
    options = CASES[case]
    _, _, program = tiny_program("llama", k=3, mode="ssd", lane="thread", fan_out="geometric",
                                 fallback=options["fallback"])
    ids, mask = prompts(3, 8, seed=2, pad_rows={1: 3})
    call = dict(attention_mask=mask, max_new_tokens=24, eos_token_id=None, temperature=options["temperature"],
                seed=0)
    try:
        program.generate(ids, **call)  # the lane's warm-up and every stage's first call: not counted
        counter = ReadCounter()
        counter.install(monkeypatch)
        out = program.generate(ids, **call)
        monkeypatch.undo()
    finally:
        program.close()
    stats = out.stats
    assert stats["mode"] == "ssd" and stats["rounds"] >= 4
    # both paths of a round ran: hits, and misses served by the fallback
    assert sum(stats["hits_by_position"].values()) > 0 and stats["fallbacks"][options["fallback"]] > 0
    per_round = counter.per_round(stats["rounds"])
    setup = sum(1 for r, _, _ in counter.reads if r is None)
    report = (f"{case}: reads per round {per_round} (max {max(per_round)}), {setup} before the first round; "
              f"where:\n{counter.where()}")
    print(report)
    assert max(per_round) <= MAX_READS_PER_ROUND, report
    assert setup <= 4, report  # the input checks and the prefill's read of the finished flags
