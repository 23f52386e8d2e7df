"""SD's greedy round as one replay: the ``k`` draft steps and the target's verify captured together as one
CUDA graph (where the target's builder graphs stages: ``cuda_graphs`` on CUDA), so a round launches one
graph instead of ``k + 1`` stage calls and the index and KV-slot bookkeeping between them.

Every tensor the round reads or writes has a fixed address: the sequence buffers (``SequencePool``) and
both KV stores (``KVPool``), so the graph of one (batch, capacity) is captured once and replays in every
later round and generation of that shape, with no input copied. Its function is
:func:`~saguaro.runtime.decode.sd.draft_speculation` then :func:`~saguaro.runtime.decode.sd.verify` over
views of those tensors: the same calls as the rounds run stage by stage, so the same tokens. The graph's
first replay is checked against the round run without it (``GraphedStage``), as every stage's is.

Stage by stage instead (each stage its own graph): sampled rounds (their uniforms come from the generator on
the host side), traced generations (a trace shows each stage), a draft on another device than the target's,
and every generation after the round's graph differed from the round run without it or failed to capture.
"""

from __future__ import annotations

from saguaro.runtime.base.kv_store import KVStore
from saguaro.runtime.base.model_runner import ModelRunner, elsewhere
from saguaro.runtime.base.sequences import SequenceBatch
from saguaro.runtime.base.state import DecodeState

ROUND_NAME = "sd round (draft steps and verify)"  # its name in logs and stats["graphs_off"]


def graphed_sd_round(target: ModelRunner, draft: ModelRunner, state: DecodeState, speculate, verify):
    """A callable ``() -> (draft_tokens [B, k], accepted [B], next_token [B])`` replaying this generation's
    SD round as one CUDA graph, or None where the round runs stage by stage (see the module docstring).
    ``speculate`` and ``verify``: ``sd.draft_speculation`` and ``sd.verify``, which the round calls."""
    if state.temperature != 0 or state.recorder is not None or elsewhere(target.spec.device, draft.spec.device):
        return None
    tensors = (*state.seqs.buffers(), *state.target_store.tensors(), *state.draft_store.tensors())
    k, split = state.k, len(state.seqs.buffers()) + len(state.target_store.tensors())  # never the state itself:
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
