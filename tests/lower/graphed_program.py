"""Routes a compiled Program's fixed-shape stages through GraphedStages, its KV stores through a KVPool per
runner and its sequence buffers through a SequencePool, by hand, for the tests (``saguaro.compile`` does
it on CUDA, where it needs no fake)."""

from __future__ import annotations

from saguaro.core.stages import TARGET_VERIFY_ROUND
from saguaro.lower.cuda_graphs import GraphedStage, captures_stage, enclosing
from saguaro.lower.graph_inputs import mutated_inputs
from saguaro.runtime.base.kv_store import KVPool, KVStore
from saguaro.runtime.base.sequences import SequencePool


def graphed(program, device_type: str = "cuda", wrap=lambda fn, stage: fn) -> dict:
    """``{"stages": {qualified name: GraphedStage}, "stores": [(runner, batch, capacity, address)]}``,
    filled as the program builds stages (and SD's round: stage None) and stores; ``wrap(fn, stage)`` wraps
    each before it is graphed."""
    made = {"stages": {}, "stores": []}
    program.target.seq_pool = SequencePool()
    for runner in (program.target, program.draft):
        if runner is None:
            continue
        build, pool = runner.build, KVPool()

        def wrapped(stage, build=build):
            fn = build(stage)
            if not captures_stage(stage):
                return fn
            graphs = GraphedStage(
                wrap(fn, stage),
                stage.qualified,
                mutated_inputs(build.stage_graph(stage)),
                device_type=device_type,
            )
            made["stages"][stage.qualified] = graphs
            return graphs

        def new_store(batch, capacity, runner=runner, pool=pool):
            store = KVStore(runner.spec, batch, capacity, pool=pool)
            made["stores"].append((runner.name, batch, capacity, store.k_caches[0].data_ptr()))
            return store

        def graphed_fn(
            fn, name, fixed
        ):  # a function of several stages (SD's round), as CompiledStages.graphed
            # its stages run as themselves inside it, on a real device because its replay runs no Python
            made["stages"][name] = GraphedStage(
                wrap(enclosing(fn), None), name, fixed, device_type=device_type, encloses=True
            )
            return made["stages"][name]

        wrapped.graphed = graphed_fn
        # what CompiledStages offers under CUDA graphs: SD's greedy round runs as sd_graph's one graph instead
        wrapped.provides = lambda stage: stage is not TARGET_VERIFY_ROUND
        runner.build, runner.new_store = wrapped, new_store
    return made


def counts(made: dict) -> dict:
    """The GraphedStages' counts, summed."""
    total: dict = {}
    for stage in made["stages"].values():
        for key, n in stage.counts.items():
            total[key] = total.get(key, 0) + n
    return total
