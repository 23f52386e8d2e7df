"""Loading a target/draft pair for the CLI and the benchmark: folders, or the default pair."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from saguaro.errors import SaguaroError

log = logging.getLogger(__name__)


def load_pair(target_dir: str | None, draft_dir: str | None, need_draft: bool = True, dtype=torch.float32):
    """Return ``(target, draft, tokenizer_or_None)``; with no folders, ``saguaro.default_pair()``."""
    if target_dir is None and draft_dir is None:
        from saguaro.default_pair import load_default_pair

        return load_default_pair(dtype=dtype)
    if target_dir is None:
        raise ValueError(f"--draft {draft_dir!r} was given without --target: give both --target DIR and "
                         "--draft DIR, or neither to use the default pair")
    if need_draft and draft_dir is None:
        raise ValueError(f"--target {target_dir!r} was given without --draft: give both --target DIR and "
                         "--draft DIR, or neither to use the default pair")
    from transformers import AutoModelForCausalLM

    models = []
    for role, folder in (("target", target_dir), ("draft", draft_dir)):
        if folder is None:
            models.append(None)
            continue
        if not Path(folder).exists():
            raise ValueError(f"--{role} {folder!r} does not exist: give a folder holding a saved Hugging Face "
                             "model (written by save_pretrained)")
        if not Path(folder).is_dir():
            raise ValueError(f"--{role} {folder!r} is not a folder holding a saved Hugging Face model")
        try:
            models.append(AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval())
        except Exception as exc:
            raise SaguaroError(f"could not load the {role} from {folder!r}: {exc}") from exc
    return models[0], models[1], load_tokenizer(target_dir)


def load_tokenizer(folder: str):
    """The tokenizer saved beside a model, or ``None`` when the folder has none."""
    from transformers import AutoTokenizer

    if not any((Path(folder) / name).exists() for name in ("tokenizer.json", "tokenizer_config.json")):
        return None
    try:
        return AutoTokenizer.from_pretrained(folder)
    except Exception as exc:  # a model without a usable tokenizer still benchmarks on token ids
        log.warning("no usable tokenizer in %s (%s); using token ids", folder, exc)
        return None
