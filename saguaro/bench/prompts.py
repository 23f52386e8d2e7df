"""The benchmark's prompts and their source: held-out snippets for the default pair
(:func:`saguaro.default_pair.heldout_snippets`), else fixed code prompts with a tokenizer, else seeded random
ids. The fixed prompts stand in, with a warning, where the held-out sources are unavailable.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from saguaro.default_pair import heldout_snippets

log = logging.getLogger(__name__)

HELDOUT, FIXED, RANDOM = "heldout", "fixed", "random"  # PromptSet.source
RANDOM_PROMPT_LEN = 8
# Code prompts without a trailing space: byte-level BPE fuses a space to the next word, so a prompt
# ending in one ("def ") is tokenized unlike any training text and hurts every row alike.
DEFAULT_PROMPTS = (
    "def fibonacci(n):\n",
    "class Stack:\n    def __init__(self):\n",
    "import os\nimport sys\n\n\ndef main():\n",
    "for i in range(10):\n",
    'if __name__ == "__main__":\n',
    "    def __repr__(self):\n        return",
    "with open(path) as f:\n",
    "try:\n    import json\nexcept ImportError:\n",
    "from collections import",
    'def read_lines(path):\n    """Return the lines of a file."""\n',
    "    raise ValueError(",
    "def is_prime(n):\n",
)


@dataclass(frozen=True)
class PromptSet:
    """``ids``: one ``[1, T]`` LongTensor per prompt; ``source``: HELDOUT, FIXED or RANDOM; ``detail``:
    what they are, or why the held-out text was not used; ``origins``: ``path:line`` of each held-out one."""

    ids: list
    source: str
    detail: str
    origins: tuple = field(default=())

    def describe(self) -> dict:
        """The report's ``prompts`` entry."""
        return {
            "source": self.source,
            "count": len(self.ids),
            "detail": self.detail,
            "origins": list(self.origins),
        }


def prompt_set(
    tokenizer, count: int, vocab_size: int, seed: int, default_pair: bool, max_tokens: int | None = None
) -> PromptSet:
    """``count`` prompts for a pair, as the module says (random ids in ``[3, vocab_size)``). ``max_tokens``:
    the longest a held-out prompt may be; its last lines are dropped to fit."""
    if tokenizer is None:
        gen = torch.Generator().manual_seed(seed)
        ids = [torch.randint(3, vocab_size, (1, RANDOM_PROMPT_LEN), generator=gen) for _ in range(count)]
        detail = (
            f"seeded random ids (seed {seed}, {RANDOM_PROMPT_LEN} tokens each): the pair has no tokenizer"
        )
        log.info("bench prompts: %s", detail)
        return PromptSet(ids, RANDOM, detail)
    if not default_pair:
        return _fixed(tokenizer, count, "held-out text is known for the default pair only", logging.INFO)
    try:
        snippets = heldout_snippets(count)
    except (OSError, ValueError) as exc:  # the interpreter's stdlib sources are absent or unreadable
        return _fixed(
            tokenizer,
            count,
            f"the default pair's held-out stdlib sources are unavailable ({exc})",
            logging.WARNING,
        )
    files = len({s.path for s in snippets})
    detail = f"snippets of {files} held-out stdlib files (never trained on)"
    log.info("bench prompts: %s", detail)
    return PromptSet(
        [_fit(tokenizer, s.text, max_tokens) for s in snippets],
        HELDOUT,
        detail,
        tuple(f"{s.path}:{s.line}" for s in snippets),
    )


def bench_prompts(
    tokenizer,
    count: int,
    vocab_size: int,
    seed: int,
    default_pair: bool = False,
    max_tokens: int | None = None,
) -> list[torch.Tensor]:
    """The ids of :func:`prompt_set` (``[1, T]`` each)."""
    return prompt_set(tokenizer, count, vocab_size, seed, default_pair, max_tokens).ids


def _fixed(tokenizer, count: int, reason: str, level: int) -> PromptSet:
    log.log(level, "bench prompts: the fixed code prompts, because %s", reason)
    texts = [DEFAULT_PROMPTS[i % len(DEFAULT_PROMPTS)] for i in range(count)]
    return PromptSet([_encode(tokenizer, t) for t in texts], FIXED, f"fixed code prompts: {reason}")


def _fit(tokenizer, text: str, max_tokens: int | None) -> torch.Tensor:
    """``text``'s ids, without its last lines while it is longer than ``max_tokens`` (its last
    ``max_tokens`` ids when even its first line is)."""
    lines = text.splitlines(keepends=True)
    ids = _encode(tokenizer, text)
    while max_tokens is not None and ids.shape[1] > max_tokens and len(lines) > 1:
        lines.pop()
        ids = _encode(tokenizer, "".join(lines))
    return ids if max_tokens is None else ids[:, -max(max_tokens, 1) :]


def _encode(tokenizer, text: str) -> torch.Tensor:
    return tokenizer(text, return_tensors="pt").input_ids  # [1, T]
