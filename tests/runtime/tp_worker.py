"""One rank of the tensor-parallel tests' job (``tests/runtime/test_tensor_parallel.py``): three ranks over
gloo on loopback, ranks 0 and 1 the target's shards, rank 2 the draft. Every rank runs the same jobs
(SPMD, as a ``torchrun`` script would) and saves what its ``generate`` calls returned."""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

import saguaro
from tests.models import prompts, tiny_target, truncated_draft

TP = 2
K = 4
NEW = 16
ARCHS = ("llama", "qwen2")
MODES = ("ar", "sd", "ssd")
SAMPLED_VOCAB = 16
SAMPLES = 1000  # rows per call (the lane's messages carry at most 1024)
CALLS = 3
SAMPLED_PROMPT = torch.tensor([[3, 7, 11, 4, 9, 13]])


def greedy_jobs():
    """``(arch, mode)`` of every greedy call, in the order every rank makes them."""
    return [(arch, mode) for arch in ARCHS for mode in MODES]


def sampled_target():
    """A sharp tiny Llama over 16 tokens (so a chi-square test sees a wrong distribution)."""
    return tiny_target("llama", vocab_size=SAMPLED_VOCAB, logit_scale=12.0, seed=5)


def greedy_prompt():
    return prompts(2, 6, pad_rows={1: 2})


def run_rank(rank: int, port: int, out_dir: str) -> None:
    """The job of one rank; results go to ``out_dir/rank{rank}.pt``."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=TP + 1, timeout=datetime.timedelta(seconds=120))
    results = {}
    try:
        ids, mask = greedy_prompt()
        for arch in ARCHS:
            target = tiny_target(arch)
            # a fixed geometric fan-out: the planner's cost measurements would only add warm-up time here
            program = saguaro.compile(
                target,
                truncated_draft(target),
                k=K,
                mode="sd",
                backend="eager",
                tensor_parallel=TP,
                fan_out="geometric",
            )
            for mode in MODES:
                out = program.generate(ids, attention_mask=mask, max_new_tokens=NEW, mode=mode)
                results[(arch, mode)] = {"sequences": out.sequences, "stats": out.stats}
            if rank < TP:  # what `saguaro inspect graph target.verify_greedy` shows on a target rank
                inspector = saguaro.inspect(program)
                gm = inspector.stage_graph("target.verify_greedy")
                results[(arch, "inspect")] = {
                    "all_reduce_nodes": sum(
                        n.op == "call_function" and "all_reduce" in str(n.target) for n in gm.graph.nodes
                    ),
                    "text": inspector.graph("target.verify_greedy", expand=True),
                    "layers": target.config.num_hidden_layers,
                }
        # k = 1 and every outcome cached (fan-out V-1 after the draft token, V after the bonus): the third
        # and fourth tokens come from rounds served by cache hits
        target = sampled_target()
        program = saguaro.compile(
            target,
            truncated_draft(target),
            k=1,
            mode="ssd",
            backend="eager",
            tensor_parallel=TP,
            fan_out=[SAMPLED_VOCAB - 1, SAMPLED_VOCAB],
            fallback="neural",
        )
        outs = [
            program.generate(
                SAMPLED_PROMPT.expand(SAMPLES, -1), max_new_tokens=4, temperature=1.0, eos_token_id=None
            )
            for _ in range(CALLS)
        ]  # seed None: rank 0 draws each
        results["sampled_ssd"] = {
            "sequences": torch.cat([o.sequences for o in outs]),
            "stats": [o.stats for o in outs],
        }
    finally:
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.destroy_process_group()
