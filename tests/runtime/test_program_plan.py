"""``Program.plan`` plans a call as ``generate`` plans it (once: the verdict counted), and ``generate(plan=...)``
runs exactly that plan: the same tokens as ``generate`` planning it itself; a plan for another call is refused."""

import pytest
import torch

from saguaro.runtime import program as program_module
from tests.conftest import tiny_program
from tests.models import prompts


@pytest.fixture(scope="module")
def ssd_program():
    _, _, program = tiny_program("llama", mode="ssd", lane="thread", sd_when_faster=False)
    yield program
    program.close()


def test_a_plan_runs_the_tokens_generate_plans_itself_and_is_not_planned_twice(ssd_program, monkeypatch):
    ids, _ = prompts(1, 9, seed=21)
    alone = ssd_program.generate(ids, max_new_tokens=10, temperature=0.8, seed=7)
    plan = ssd_program.plan(ids, max_new_tokens=10, temperature=0.8, seed=7)
    assert plan.run == "ssd" and plan.lane is not None
    calls = []
    real = program_module.plan_call
    monkeypatch.setattr(program_module, "plan_call", lambda *args: calls.append(args) or real(*args))
    planned = ssd_program.generate(ids, max_new_tokens=10, temperature=0.8, seed=7, plan=plan)
    assert calls == []  # generate ran the plan it was given
    assert torch.equal(planned.sequences, alone.sequences)
    assert planned.stats["ran_as"] == "ssd" and planned.stats["mode"] == "ssd"


def test_a_plan_planned_sd_runs_sd_tokens(ssd_program, monkeypatch):
    """Where the planner's verdict is SD, the planned call is SD's generation with the same seed."""
    monkeypatch.setattr(type(ssd_program.calibration), "run_as_sd", lambda self, verdict, prior: True)
    sd_program = ssd_program.reconfigure(sd_when_faster=True)
    ids, _ = prompts(1, 7, seed=22)
    plan = sd_program.plan(ids, max_new_tokens=9, temperature=0.7, seed=3)
    assert plan.run == "sd"
    out = sd_program.generate(ids, max_new_tokens=9, temperature=0.7, seed=3, plan=plan)
    sd = sd_program.generate(ids, max_new_tokens=9, temperature=0.7, seed=3, mode="sd")
    assert out.stats["ran_as"] == "sd" and torch.equal(out.sequences, sd.sequences)


def test_a_plan_for_another_call_is_refused(ssd_program):
    ids, _ = prompts(2, 8, seed=23)
    plan = ssd_program.plan(ids[:1], max_new_tokens=6, temperature=0.8, seed=1)
    for other in (
        {"input_ids": ids[1:], "seed": 1},
        {"input_ids": ids[:1], "seed": 2},
        {"input_ids": ids[:1], "seed": 1, "max_new_tokens": 7},
        {"input_ids": ids[:1], "seed": 1, "eos_token_id": None},
    ):
        call = {"max_new_tokens": 6, "temperature": 0.8} | other
        with pytest.raises(ValueError, match="plan= was made by plan"):
            ssd_program.generate(**call, plan=plan)


def test_planning_a_sampled_call_needs_its_seed(ssd_program):
    ids, _ = prompts(1, 5, seed=24)
    with pytest.raises(ValueError, match="needs its seed"):
        ssd_program.plan(ids, max_new_tokens=4, temperature=0.5)
    with pytest.raises(ValueError, match="max_new_tokens"):
        ssd_program.plan(ids, max_new_tokens=0)
