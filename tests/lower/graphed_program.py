"""Routes a compiled Program's fixed-shape stages through GraphedStages and its KV stores through a
KVPool per runner, by hand, for the tests (``saguaro.compile(cuda_graphs=True)`` does it when wired)."""

from __future__ import annotations

from saguaro.lower.cuda_graphs import GraphedStage, captures_stage
from saguaro.lower.graph_inputs import mutated_inputs
from saguaro.runtime.base.kv_store import KVPool, KVStore


def graphed(program, device_type: str = "cuda", wrap=lambda fn: fn) -> dict:
    """``{"stages": {qualified name: GraphedStage}, "stores": [(runner, batch, capacity, address)]}``,
    filled as the program builds stages and stores; ``wrap`` wraps each stage before it is graphed."""
    made = {"stages": {}, "stores": []}
    for runner in (program.target, program.draft):
        build, pool = runner.build, KVPool()

        def wrapped(stage, build=build):
            fn = build(stage)
            if not captures_stage(stage):
                return fn
            graphs = GraphedStage(wrap(fn), stage.qualified, mutated_inputs(build.stage_graph(stage)),
                                  device_type=device_type)
            made["stages"][stage.qualified] = graphs
            return graphs

        def new_store(batch, capacity, runner=runner, pool=pool):
            store = KVStore(runner.spec, batch, capacity, pool=pool)
            made["stores"].append((runner.name, batch, capacity, store.k_caches[0].data_ptr()))
            return store

        runner.build, runner.new_store = wrapped, new_store
    return made


def counts(made: dict) -> dict:
    """The GraphedStages' counts, summed."""
    total: dict = {}
    for stage in made["stages"].values():
        for key, n in stage.counts.items():
            total[key] = total.get(key, 0) + n
    return total
