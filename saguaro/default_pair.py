"""The default model pair shipped with Saguaro, and the held-out evaluation that describes it.

Loads ``saguaro/assets/default/{target,draft}`` (trained by ``examples/train_default_pair.py`` on the
standard library's source) and rebuilds the corpus split and held-out slice its model card is measured on.
Imports nothing else of ``saguaro`` at import time, so the training script can load it alone.
"""

from __future__ import annotations

import hashlib
import json
import logging
import sysconfig
from pathlib import Path
from typing import NamedTuple

import torch

logger = logging.getLogger(__name__)

ASSETS_DIR = Path(__file__).parent / "assets" / "default"
HELDOUT_EVAL_FILE = "heldout_eval.json"
TRAIN_COMMAND = "python examples/train_default_pair.py"

# Split and corpus rules. The held-out set is a fixed function of each file's relative path.
HELDOUT_PERCENT = 3
MAX_FILE_BYTES = 200_000
SKIP_DIR_NAMES = ("site-packages", "__pycache__")


def stdlib_root() -> Path:
    """The folder holding the running interpreter's standard library source."""
    return Path(sysconfig.get_paths()["stdlib"])


def is_heldout(relpath: str, percent: int = HELDOUT_PERCENT) -> bool:
    """Whether ``relpath`` (POSIX, under the stdlib folder: ``json/decoder.py``) is held out: its sha1
    modulo 100 is below ``percent``."""
    return int(hashlib.sha1(relpath.encode("utf-8")).hexdigest(), 16) % 100 < percent


def corpus_files(root: Path | None = None, max_file_bytes: int = MAX_FILE_BYTES) -> list[str]:
    """Sorted relative POSIX paths of the corpus: every ``*.py`` under ``root`` (default: the stdlib) but
    those under :data:`SKIP_DIR_NAMES` or larger than ``max_file_bytes``."""
    root = stdlib_root() if root is None else Path(root)
    out = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if any(part in SKIP_DIR_NAMES for part in rel.parts):
            continue
        if not path.is_file() or path.stat().st_size > max_file_bytes:
            continue
        out.append(rel.as_posix())
    return sorted(out)


def read_source(root: Path, relpath: str) -> str | None:
    """The file's text, or ``None`` when it is not UTF-8 (a handful of stdlib test files)."""
    try:
        return (Path(root) / relpath).read_text(encoding="utf-8")
    except UnicodeDecodeError:
        return None


def document_ids(tokenizer, text: str) -> list[int]:
    """Token ids of one file as the models saw it: ``[eos] + ids(text)``; eos separates files."""
    return [tokenizer.eos_token_id] + tokenizer.encode(text, add_special_tokens=False)


def heldout_sources(root: Path, heldout_percent: int = HELDOUT_PERCENT, max_file_bytes: int = MAX_FILE_BYTES):
    """``(relative path, text)`` of each readable held-out file (:func:`is_heldout`), in sorted path order."""
    for rel in corpus_files(root, max_file_bytes):
        if is_heldout(rel, heldout_percent):
            text = read_source(root, rel)
            if text is not None:
                yield rel, text


def heldout_chunks(
    tokenizer,
    n_chunks: int,
    seq_len: int,
    root: Path | None = None,
    heldout_percent: int = HELDOUT_PERCENT,
    max_file_bytes: int = MAX_FILE_BYTES,
) -> torch.Tensor:
    """The fixed held-out slice ``[n_chunks, seq_len]``: the held-out files' :func:`document_ids`, in path
    order, cut into chunks. ``ValueError`` when they hold too few tokens."""
    root = stdlib_root() if root is None else Path(root)
    need = n_chunks * seq_len
    ids: list[int] = []
    for _, text in heldout_sources(root, heldout_percent, max_file_bytes):
        ids.extend(document_ids(tokenizer, text))
        if len(ids) >= need:
            break
    if len(ids) < need:
        raise ValueError(f"held-out files give {len(ids)} tokens, fewer than n_chunks*seq_len={need}")
    return torch.tensor(ids[:need], dtype=torch.long).view(n_chunks, seq_len)


class HeldoutSnippet(NamedTuple):
    """A prompt cut from a held-out file: its relative path, its first line (1-based) and its text."""

    path: str
    line: int
    text: str


def heldout_snippets(
    count: int,
    root: Path | None = None,
    max_lines: int = 12,
    max_chars: int = 400,
    heldout_percent: int = HELDOUT_PERCENT,
    max_file_bytes: int = MAX_FILE_BYTES,
) -> list[HeldoutSnippet]:
    """``count`` deterministic prompts of held-out source, the pair never trained on.

    Prompt ``i`` starts at candidate ``i * n // count`` of the ``n`` top-level ``def`` / ``class`` lines of
    the held-out files, for at most ``max_lines`` whole lines and ``max_chars`` characters (its first line
    always), ending with a newline. ``ValueError`` when there is no candidate (no stdlib under ``root``).
    """
    if count < 1:
        raise ValueError(f"count={count} is not allowed: ask for at least one snippet")
    root = stdlib_root() if root is None else Path(root)
    candidates: list[tuple[str, int, list[str]]] = []
    for rel, text in heldout_sources(root, heldout_percent, max_file_bytes):
        lines = [line.rstrip() + "\n" for line in text.splitlines()]
        candidates.extend(
            (rel, i, lines) for i, line in enumerate(lines) if line.startswith(("def ", "class "))
        )
    if not candidates:
        raise ValueError(
            f"no held-out file under {root} has a top-level def or class (are the stdlib sources there?)"
        )
    snippets = []
    for i in range(count):
        rel, start, lines = candidates[i * len(candidates) // count]
        taken = [lines[start]]
        for line in lines[start + 1 : start + max_lines]:
            if sum(map(len, taken)) + len(line) > max_chars:
                break
            taken.append(line)
        snippets.append(HeldoutSnippet(rel, start + 1, "".join(taken)))
    return snippets


def slice_digest(chunks: torch.Tensor) -> str:
    """sha1 of the slice's token ids, to tell whether a rebuilt slice is the one evaluated."""
    return hashlib.sha1(",".join(map(str, chunks.flatten().tolist())).encode()).hexdigest()


@torch.no_grad()
def perplexity(model, chunks: torch.Tensor, batch_size: int = 8) -> float:
    """``exp`` of the mean next-token NLL after each chunk's first position, each chunk alone, in float32."""
    total, count = 0.0, 0
    for start in range(0, chunks.shape[0], batch_size):
        batch = chunks[start : start + batch_size]  # [b, L]
        logits = model(input_ids=batch).logits.float()  # [b, L, V]
        nll = torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1), reduction="sum"
        )
        total += nll.item()
        count += batch[:, 1:].numel()
    return float(torch.exp(torch.tensor(total / count)))


def flops_per_token(model) -> int:
    """Forward FLOPs per token, attention scores left out: ``2 * (non-embedding params + V * d)`` (the
    embedding is a lookup; the head a ``d x V`` matmul, tied or not)."""
    embed = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    skip = {id(embed), id(head)}
    non_embedding = sum(p.numel() for p in model.parameters() if id(p) not in skip)
    vocab, hidden = head.shape
    return 2 * (non_embedding + vocab * hidden)


def load_default_pair(dtype: torch.dtype | None = None):
    """``(target, draft, tokenizer)`` from :data:`ASSETS_DIR`, in eval mode, in ``dtype`` (None: float32;
    stored as float16). ``SaguaroError`` when the pair is not built."""
    from saguaro.core.errors import SaguaroError

    target_dir = ASSETS_DIR / "target"
    draft_dir = ASSETS_DIR / "draft"
    missing = [str(d) for d in (target_dir, draft_dir) if not (d / "config.json").is_file()]
    if missing:
        raise SaguaroError(
            f"the default model pair is not built: missing {', '.join(missing)}. "
            f"Build it with `{TRAIN_COMMAND}` (see saguaro/assets/default/MODEL_CARD.md)."
        )
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = torch.float32 if dtype is None else dtype
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=dtype).eval()
    draft = AutoModelForCausalLM.from_pretrained(draft_dir, dtype=dtype).eval()
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    return target, draft, tokenizer


def load_heldout_eval(assets_dir: Path | None = None) -> dict:
    """The slice definition and expected perplexities written by the training script."""
    assets_dir = ASSETS_DIR if assets_dir is None else Path(assets_dir)
    return json.loads((assets_dir / HELDOUT_EVAL_FILE).read_text())
