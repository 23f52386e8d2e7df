"""Both forms of ``saguaro.compile``: direct and decorator (module or zero-argument factory)."""

import torch

import saguaro
from saguaro.runtime.program import Program
from tests.conftest import tiny_pair
from tests.models import prompts, reference_greedy


def test_decorator_on_factory_and_module():
    target, draft, _ = tiny_pair("qwen2")

    @saguaro.compile(draft=draft, k=3, mode="sd", backend="eager")
    def program():
        return target

    assert isinstance(program, Program) and program.config.k == 3
    wrapped = saguaro.compile(draft=draft, mode="sd", backend="eager")(target)
    ids, mask = prompts(1, 5, seed=2)
    expected = reference_greedy(target, ids, mask, 10)
    for p in (program, wrapped):
        assert torch.equal(p.generate(ids, max_new_tokens=10, eos_token_id=None).sequences, expected)
