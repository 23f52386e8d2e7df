"""Loading a target/draft pair for the CLI and the benchmark: two folders, or the default pair."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from saguaro.core.errors import SaguaroError

log = logging.getLogger(__name__)


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_pair(
    target_dir: str | None,
    draft_dir: str | None,
    need_draft: bool = True,
    dtype=torch.float32,
    device: str | None = None,
):
    """Return ``(target, draft, tokenizer_or_None)``, in eval mode, in ``dtype``, on ``device``.

    With no folders, the default pair (``saguaro.default_pair()``). ``draft`` is ``None`` when
    ``draft_dir`` is (allowed only with ``need_draft=False``).
    """
    device = check_device(device)
    if target_dir is None and draft_dir is None:
        from saguaro.default_pair import load_default_pair

        target, draft, tokenizer = load_default_pair(dtype=dtype)
        return _to(target, device), _to(draft, device), tokenizer
    if target_dir is None:
        raise ValueError(
            f"--draft {draft_dir!r} was given without --target: give both --target DIR and "
            "--draft DIR, or neither to use the default pair"
        )
    if need_draft and draft_dir is None:
        raise ValueError(
            f"--target {target_dir!r} was given without --draft: give both --target DIR and "
            "--draft DIR, or neither to use the default pair"
        )
    from transformers import AutoModelForCausalLM

    models = []
    for role, folder in (("target", target_dir), ("draft", draft_dir)):
        if folder is None:
            models.append(None)
            continue
        if not Path(folder).exists():
            raise ValueError(
                f"--{role} {folder!r} does not exist: give a folder holding a saved Hugging Face "
                "model (written by save_pretrained)"
            )
        if not Path(folder).is_dir():
            raise ValueError(f"--{role} {folder!r} is not a folder holding a saved Hugging Face model")
        try:
            models.append(AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval())
        except Exception as exc:
            raise SaguaroError(f"could not load the {role} from {folder!r}: {exc}") from exc
    return _to(models[0], device), _to(models[1], device), load_tokenizer(target_dir)


def check_device(device: str | None) -> torch.device | None:
    """``device`` as a ``torch.device``; a ``ValueError`` naming it when torch cannot use it here."""
    if device is None:
        return None
    try:
        parsed = torch.device(device)
    except (RuntimeError, ValueError) as exc:
        raise ValueError(
            f"--device {device!r} is not a torch device (e.g. cpu, cuda, cuda:1): {exc}"
        ) from None
    if parsed.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {device!r} is not available: this torch build sees no CUDA device")
    return parsed


def _to(model, device):
    return model if model is None or device is None else model.to(device)


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
