"""Grammars for structured output: what a row's tokens must spell (a JSON schema, any JSON object, a Lark grammar,
a regex), and each row's place in one, as token masks over the model's vocabulary.

llguidance matches the grammars (chosen over xgrammar and outlines-core:
docs/measurements/2026-12-07-grammar-libraries.md). :class:`Grammar` is compiled and checked once and shared by
rows; :class:`GrammarState` is one row's matcher. The mask of a position is the set of tokens that keep the text a
prefix of a sentence of the grammar; an end-of-sequence token is allowed exactly where the text is a whole sentence,
and once one is taken (or the grammar admits no more text) only end-of-sequence tokens are allowed. Ids the
tokenizer does not have (a model's padded vocabulary) are never allowed. A mask is never empty.

Errors: a grammar or schema the library refuses raises :class:`GrammarError` (a ``ValueError``) with its message.
"""

from __future__ import annotations

import json
import threading

import torch

# JSON documents are laid out as json.dumps lays them out (", " between items, ": " after keys, no other
# whitespace): free whitespace lets a model loop on it (vLLM's disable_any_whitespace, xgrammar's any_whitespace)
JSON_OPTIONS = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
    "lenient": True,  # a keyword the library does not implement constrains nothing (it is not refused)
}
ANY_JSON_OBJECT = {"type": "object"}
_BITS = torch.arange(32, dtype=torch.int32, device="cpu")


class GrammarError(ValueError):
    """A grammar or schema that cannot be compiled; the message says why (the library's words)."""


class Vocabulary:
    """A tokenizer's tokens as the matcher reads them (bytes per id), over ``vocab_size`` ids (the model's; ids
    past the tokenizer's are never allowed), with ``eos_ids`` (default: the tokenizer's end-of-sequence token).
    Built once per tokenizer: :func:`vocabulary_of` caches it."""

    def __init__(self, tokenizer, vocab_size: int | None = None, eos_ids=None):
        import llguidance
        import llguidance.hf

        self.vocab_size = int(vocab_size if vocab_size is not None else len(tokenizer))
        if eos_ids is None:
            eos_ids = tokenizer.eos_token_id
        eos = [int(eos_ids)] if isinstance(eos_ids, int) else [int(t) for t in (eos_ids or ())]
        if not eos:
            raise GrammarError(
                "a grammar needs an end-of-sequence token: the tokenizer has none; give eos_ids"
            )
        self.eos_ids = tuple(eos)
        try:
            self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=self.vocab_size, eos_token=eos)
        except (ValueError, TypeError, AttributeError):  # a decoder the library does not read: token by token
            wrapper = llguidance.TokenizerWrapper(_DecodedTokens(tokenizer, self.vocab_size, eos))
            self.tokenizer = llguidance.LLTokenizer(wrapper, n_vocab=self.vocab_size, eos_token=eos)


class _DecodedTokens:
    """What ``llguidance.TokenizerWrapper`` reads of a tokenizer whose decoder the library does not know: each id's
    bytes as the tokenizer decodes that id alone (exact for tokenizers whose tokens are whole characters)."""

    def __init__(self, tokenizer, vocab_size: int, eos: list):
        special = set(getattr(tokenizer, "all_special_ids", ())) | set(eos)
        size = len(tokenizer)
        self.eos_token_id, self.bos_token_id = eos[0], getattr(tokenizer, "bos_token_id", None)
        self.special_token_ids = sorted(t for t in special if t < vocab_size)
        self.tokens = [
            b"" if i in special or i >= size else tokenizer.decode([i]).encode("utf-8")
            for i in range(vocab_size)
        ]
        self._tokenizer = tokenizer

    def __call__(self, text):
        text = text.decode("utf-8", "replace") if isinstance(text, bytes) else text
        return list(self._tokenizer(text, add_special_tokens=False).input_ids)


_VOCABULARIES: dict = {}  # (id(tokenizer), vocab_size, eos) -> (tokenizer, Vocabulary): the tokenizer held alive
_VOCABULARIES_LOCK = threading.Lock()


def vocabulary_of(tokenizer, vocab_size: int | None = None, eos_ids=None) -> Vocabulary:
    """The :class:`Vocabulary` of ``tokenizer`` (built on first use, then shared)."""
    if isinstance(tokenizer, Vocabulary):
        return tokenizer
    eos = eos_ids if eos_ids is None or isinstance(eos_ids, int) else tuple(eos_ids)
    key = (id(tokenizer), vocab_size, eos)
    with _VOCABULARIES_LOCK:
        held = _VOCABULARIES.get(key)
        if held is None or held[0] is not tokenizer:
            held = _VOCABULARIES[key] = (tokenizer, Vocabulary(tokenizer, vocab_size, eos_ids))
        return held[1]


class Grammar:
    """A compiled, checked grammar over a :class:`Vocabulary`: immutable, shared by rows (compared and hashed by
    identity). Build one with :meth:`json_schema`, :meth:`lark` or :meth:`regex`; ``tokenizer`` may be a
    ``transformers`` tokenizer (its :class:`Vocabulary` cached) or a :class:`Vocabulary`. :meth:`start` gives a
    row's :class:`GrammarState` at the grammar's start."""

    def __init__(self, text: str, vocabulary: Vocabulary, kind: str):
        import llguidance

        self.text, self.vocabulary, self.kind = text, vocabulary, kind
        error = llguidance.LLMatcher.validate_grammar(text, vocabulary.tokenizer)
        if error:
            raise GrammarError(error)
        self.eos_only = torch.zeros(vocabulary.vocab_size, dtype=torch.bool, device="cpu")  # [V]: read only
        self.eos_only[list(vocabulary.eos_ids)] = True
        self._start = None  # the matcher at the grammar's start, its first mask made: each row's is a copy
        self._start_lock = threading.Lock()

    json_options = JSON_OPTIONS  # how :meth:`json_schema` lays documents out (an ``x-guidance`` object)

    @property
    def vocab_size(self) -> int:
        return self.vocabulary.vocab_size

    @staticmethod
    def vocabulary(tokenizer, vocab_size: int | None = None, eos_ids=None) -> Vocabulary:
        """``tokenizer``'s :class:`Vocabulary`, built on first use and cached (what every constructor reads)."""
        return vocabulary_of(tokenizer, vocab_size, eos_ids)

    @classmethod
    def json_schema(cls, schema, tokenizer, vocab_size: int | None = None, eos_ids=None) -> Grammar:
        """Text that is one JSON document valid under ``schema`` (a dict, a JSON string, or None: any JSON
        object), laid out as :data:`JSON_OPTIONS` says."""
        import llguidance

        schema = ANY_JSON_OBJECT if schema is None else schema
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as exc:
                raise GrammarError(f"the schema is not valid JSON: {exc}") from None
        if not isinstance(schema, dict):
            raise GrammarError(f"a JSON schema is an object; got {type(schema).__name__}")
        try:
            text = llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)
        except (ValueError, TypeError) as exc:
            raise GrammarError(str(exc)) from None
        return cls(text, vocabulary_of(tokenizer, vocab_size, eos_ids), "json_schema")

    @classmethod
    def lark(cls, grammar: str, tokenizer, vocab_size: int | None = None, eos_ids=None) -> Grammar:
        """Text the Lark-like grammar ``grammar`` accepts (llguidance's syntax: ``%json {...}`` inlines a schema)."""
        import llguidance

        text = llguidance.LLMatcher.grammar_from_lark(grammar)
        return cls(text, vocabulary_of(tokenizer, vocab_size, eos_ids), "lark")

    @classmethod
    def regex(cls, pattern: str, tokenizer, vocab_size: int | None = None, eos_ids=None) -> Grammar:
        """Text that matches ``pattern`` whole (Rust ``regex`` syntax)."""
        import llguidance

        text = llguidance.LLMatcher.grammar_from_regex(pattern)
        return cls(text, vocabulary_of(tokenizer, vocab_size, eos_ids), "regex")

    def start(self) -> GrammarState:
        """A row's state at the grammar's start: a copy of one matcher parsed (and its first mask made) once."""
        import llguidance

        with self._start_lock:
            if self._start is None:
                self._start = llguidance.LLMatcher(self.vocabulary.tokenizer, self.text, log_level=0)
                allowed_rows([GrammarState(self, self._start)])  # its first mask, made once
            matcher = self._start.deep_copy()
        return GrammarState(self, matcher)

    def __repr__(self) -> str:
        return f"Grammar({self.kind}, vocab_size={self.vocab_size})"


class GrammarState:
    """One row's place in a :class:`Grammar`: :meth:`allowed` (the mask of its next token), :meth:`advance` by a
    token, :meth:`rollback`, and :meth:`allowed_along` a speculation (the masks at each of its positions, the state
    left as it was). An end-of-sequence token taken where the text is whole ends the row's grammar (``ended``)."""

    def __init__(self, grammar: Grammar, matcher):
        self.grammar = grammar
        self.matcher = matcher  # an llguidance.LLMatcher at the grammar's start (Grammar.start)
        self.eos = set(grammar.vocabulary.eos_ids)
        self.taken: list = []  # per token advanced: True where the matcher consumed it, False for an ending EOS
        self.abandoned = False  # the row took a token its mask allowed and the matcher refused (abandon)

    @property
    def live(self) -> bool:
        """Whether the matcher decides the mask (else only end-of-sequence tokens are allowed)."""
        return not self.ended and not self.matcher.is_error()

    @property
    def ended(self) -> bool:
        return self.abandoned or (bool(self.taken) and not self.taken[-1])

    def abandon(self) -> None:
        """End the row's grammar after a decided token the matcher refused although its mask allowed it (llguidance
        can disagree with itself: guidance-ai/llguidance#366): from here only end-of-sequence tokens are allowed."""
        self.abandoned = True

    def _mask(self) -> torch.Tensor:
        """``[V]`` bool on the CPU."""
        return allowed_rows([self])[0]

    def allowed(self, device=None) -> torch.Tensor:
        """The tokens allowed next: ``[V]`` bool."""
        mask = self._mask()
        return mask if device is None else mask.to(device)

    def advance(self, token: int) -> bool:
        """Take ``token``; False (and the state unchanged) where the grammar does not allow it here."""
        token = int(token)
        if token in self.eos and (self.ended or self.matcher.is_accepting()):
            self.taken.append(False)
            return True
        if self.ended or not self.matcher.try_consume_tokens([token]):
            return False
        self.taken.append(True)
        return True

    def rollback(self, n: int) -> None:
        """Undo the last ``n`` tokens :meth:`advance` took."""
        consumed = sum(self.taken[len(self.taken) - n :]) if n else 0
        del self.taken[len(self.taken) - n :]
        if consumed:
            self.matcher.rollback(consumed)

    def allowed_along(self, tokens: list, device=None) -> torch.Tensor:
        """The masks before each of ``tokens`` and after the last: ``[len(tokens) + 1, V]`` bool, the state left as
        it was. After a token the grammar refuses, every later row allows every token (a verification stops at
        the refused token: those positions decide nothing); one the mask allowed and the matcher refused is
        cleared from its row, so a verification cannot accept it."""
        rows, taken, refused = [self._mask()], 0, False
        for token in map(int, tokens):
            if not refused and rows[-1][token] and not self.advance(token):
                rows[-1][token] = False  # allowed by the mask, refused by the matcher (llguidance#366)
            refused = refused or not rows[-1][token]
            if refused:
                rows.append(torch.ones(self.grammar.vocab_size, dtype=torch.bool, device="cpu"))
                continue
            taken += 1
            rows.append(self._mask())
        self.rollback(taken)
        masks = torch.stack(rows)
        return masks if device is None else masks.to(device)


_EXECUTOR: list = []  # the llguidance.LLExecutor that computes many rows' masks in one call, made on first use


def allowed_rows(states: list, device=None) -> torch.Tensor:
    """The tokens each of ``states`` (``GrammarState`` rows of grammars over one vocabulary size) allows next,
    ``[B, V]`` bool: :meth:`GrammarState.allowed` of each, the matchers' masks computed in one library call and
    unpacked in one op (a mask per row costs a call and several small ops)."""
    import llguidance

    vocab_size = states[0].grammar.vocab_size
    words = torch.zeros(len(states), (vocab_size + 31) // 32, dtype=torch.int32, device="cpu")  # [B, W]
    live = [(state.matcher, b) for b, state in enumerate(states) if state.live]
    if live:
        if not _EXECUTOR:
            _EXECUTOR.append(llguidance.LLExecutor())
        _EXECUTOR[0].unsafe_compute_mask_ptr(live, words.data_ptr(), words.shape[1] * 4, len(states))
    masks = ((words[:, :, None] >> _BITS) & 1).flatten(1)[:, :vocab_size].bool()  # [B, V]
    empty = (~masks.any(dim=1)).tolist()  # an ended row's, or a matcher's that allows nothing: EOS only
    for b, state in enumerate(states):
        if empty[b]:
            masks[b] = state.grammar.eos_only
    return masks if device is None else masks.to(device)
