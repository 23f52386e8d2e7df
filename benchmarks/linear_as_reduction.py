"""An experiment for the CPU-speed issue: the default pair with its one-token stages' linears rewritten
as a product and a sum over K (Inductor fuses them into one vectorised reduction that reads each weight
once), against the stages as built.

    python benchmarks/linear_as_reduction.py THREADS PASSES

Both programs are compiled with Inductor in this process and warmed up in AR and SD; then their timed
passes alternate (4 held-out prompts x 128 tokens each); prints the medians, B/A, and whether every
generation gave the same tokens. The rewrite is done here by patching ``CompiledStages.stage_graph``: an
experiment, not a pass of the library (yet).
"""
import importlib
import statistics
import sys
import time

import torch
import saguaro
from saguaro.passes.graph_pass import settle_code
from saguaro.core.stages import TARGET_STEP, DRAFT_STEP
from saguaro.bench.rows import bench_prompts

compile_mod = importlib.import_module("saguaro.compile")  # the module (saguaro.compile is the function)
threads = int(sys.argv[1]) if len(sys.argv) > 1 else 1
passes = int(sys.argv[2]) if len(sys.argv) > 2 else 5
torch.set_num_threads(threads)
target, draft, tok = saguaro.default_pair()
prompts = bench_prompts(tok, 4, target.config.vocab_size, seed=0)
real = compile_mod.CompiledStages.stage_graph
aten = torch.ops.aten


def rewritten(self, stage, observe=None):
    gm = real(self, stage, observe)
    if stage is TARGET_STEP or stage is DRAFT_STEP.greedy:
        g = gm.graph
        for n in list(g.nodes):
            if n.op == "call_function" and n.target == aten.linear.default:
                x, w = n.args[0], n.args[1]
                b = n.args[2] if len(n.args) > 2 else None
                with g.inserting_before(n):
                    u = g.call_function(aten.unsqueeze.default, (x, -2))
                    m = g.call_function(aten.mul.Tensor, (u, w))
                    s = g.call_function(aten.sum.dim_IntList, (m, [-1]))
                    if b is not None:
                        s = g.call_function(aten.add.Tensor, (s, b))
                n.replace_all_uses_with(s); g.erase_node(n)
        gm.recompile(); settle_code(gm)
    return gm


progs = {}
for name in ("A", "B"):
    compile_mod.CompiledStages.stage_graph = real if name == "A" else rewritten
    p = saguaro.compile(target, draft, k=5, mode="ssd", backend="inductor")
    for mode in ("ar", "sd"):
        for ids in prompts: p.generate(ids, max_new_tokens=128, mode=mode)
    progs[name] = p
compile_mod.CompiledStages.stage_graph = real
res = {(n, m): [] for n in progs for m in ("ar", "sd")}; outs = {}
for rep in range(passes):
    for mode in ("ar", "sd"):
        for n, p in (progs.items() if rep % 2 == 0 else reversed(progs.items())):
            toks, wall = 0, 0.0
            for i, ids in enumerate(prompts):
                t0 = time.perf_counter()
                out = p.generate(ids, max_new_tokens=128, mode=mode)
                wall += time.perf_counter() - t0
                toks += out.stats["new_tokens"]
                outs.setdefault((mode, i), set()).add(str(out.sequences.tolist()))
            res[(n, mode)].append(toks / wall)
print("identical outputs:", all(len(v) == 1 for v in outs.values()), "threads", threads)
for mode in ("ar", "sd"):
    a, b = statistics.median(res[("A", mode)]), statistics.median(res[("B", mode)])
    runs = {n: [round(x) for x in res[(n, mode)]] for n in ("A", "B")}
    print(f"{mode}: A {a:.1f}  B {b:.1f}  B/A {b / a:.3f}   A {runs['A']} B {runs['B']}")
