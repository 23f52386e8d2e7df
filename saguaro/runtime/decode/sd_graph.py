"""SD's greedy round as one CUDA graph: the ``k`` draft steps and the verify over views of the pooled
sequence buffers and both KV stores, whose fixed addresses let one capture per (batch, capacity) replay in
every later round and generation (``docs/design.md``, "One round, step by step")."""

from __future__ import annotations

from saguaro.runtime.base.kv_store import KVStore
from saguaro.runtime.base.model_runner import ModelRunner, elsewhere
from saguaro.runtime.base.sequences import SequenceBatch
from saguaro.runtime.base.state import DecodeState

ROUND_NAME = "sd round (draft steps and verify)"  # its name in logs and stats["graphs_off"]


def graphed_sd_round(target: ModelRunner, draft: ModelRunner, state: DecodeState, speculate, verify):
    """A callable ``() -> (draft_tokens [B, k], accepted [B], next_token [B])`` replaying ``speculate`` then
    ``verify`` (``sd.draft_speculation``, ``sd.verify``) as one graph, its first replay checked against the
    round run without it; None where the round runs stage by stage: sampled, traced, the draft on another
    device, or a round graph that differed or failed to capture."""
    # sampled rounds draw their uniforms on the host side; a trace shows each stage
    if (
        state.temperature != 0
        or state.recorder is not None
        or elsewhere(target.spec.device, draft.spec.device)
    ):
        return None
    tensors = (*state.seqs.buffers(), *state.target_store.tensors(), *state.draft_store.tensors())
    k, split = (
        state.k,
        len(state.seqs.buffers()) + len(state.target_store.tensors()),
    )  # never the state itself:
    # the runner keeps the function, and a generation's buffers go back to their pools once it is collected

    def round_fn(*flat):  # [B, C] tokens, [B] lengths, [B] padding, [C] steps, then the two stores' tensors
        seqs = SequenceBatch.over(*flat[:4])
        view = DecodeState(seqs, KVStore.over(*flat[4:split]), KVStore.over(*flat[split:]), 0.0, None, k)
        draft_tokens, _ = speculate(draft, view)  # [B, k]
        return (draft_tokens, *verify(target, view, draft_tokens, None))

    graph = target.graphed(f"{ROUND_NAME} k={k}", round_fn, range(len(tensors)))
    if graph is None or graph.graphs_off is not None:  # a round graph that differed or failed: stage by stage
        return None
    return lambda: graph(*tensors)
