"""The draft a process lane rebuilds from files equals the caller's, bit for bit, without pickling it."""

import pytest
import torch
from transformers import LlamaForCausalLM

from saguaro.runtime.lanes.draft_files import RemoteDraft, RemoteDraftError, load_draft
from tests.models import tiny_config, tiny_target, truncated_draft


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tied", [False, True])
def test_the_rebuilt_draft_gives_the_same_logits_and_buffers(tmp_path, dtype, tied):
    if tied:  # tied embeddings: stored once, restored under both names
        torch.manual_seed(0)
        draft = LlamaForCausalLM(tiny_config("llama", layers=1)).eval()
        draft.config.tie_word_embeddings = True
        draft.tie_weights()
    else:
        draft = truncated_draft(tiny_target("qwen3"))
    draft = draft.to(dtype)  # casts the rotary buffers too: they must come back in that dtype
    description = RemoteDraft(draft, "eager", "auto").save(str(tmp_path))
    rebuilt = load_draft(description)
    assert type(rebuilt) is type(draft) and bool(description["aliases"]) == tied
    buffers, rebuilt_buffers = dict(draft.named_buffers()), dict(rebuilt.named_buffers())
    assert list(rebuilt_buffers) == list(buffers) and "model.rotary_emb.inv_freq" in buffers  # none missing
    for name, a in buffers.items():
        b = rebuilt_buffers[name]
        assert a.dtype == b.dtype and torch.equal(a, b), name
    ids = torch.randint(3, 128, (2, 9))
    with torch.no_grad():
        assert torch.equal(draft(ids).logits, rebuilt(ids).logits)


def test_a_class_in_main_or_a_function_is_refused_with_its_name(tmp_path):
    class Local(LlamaForCausalLM):
        pass

    with pytest.raises(RemoteDraftError, match="Local is defined in a function body"):
        RemoteDraft(Local(tiny_config("llama", layers=1)), "eager", "auto").save(str(tmp_path))
    Local.__module__, Local.__qualname__ = "__main__", "Local"
    with pytest.raises(RemoteDraftError, match="Local is defined in the script's __main__"):
        RemoteDraft(Local(tiny_config("llama", layers=1)), "eager", "auto").save(str(tmp_path))
