"""A character-level tokenizer whose vocabulary matches the tiny models' (128 ids, pad/bos/eos 0/1/2)."""

from __future__ import annotations

from tests.models import BOS, EOS, PAD


def tiny_tokenizer(vocab_size: int = 128):
    """``PreTrainedTokenizerFast``: specials, tab, newline, printable ASCII, then Greek letters up to ``vocab_size``.

    Every id in ``[0, vocab_size)`` decodes, so whatever a random tiny model generates prints.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": PAD, "<s>": BOS, "</s>": EOS, "<unk>": 3}
    chars = ["\t", "\n"] + [chr(c) for c in range(32, 127)]
    greek = 0x3B1
    while len(vocab) + len(chars) < vocab_size:
        chars.append(chr(greek))
        greek += 1
    for ch in chars[: vocab_size - len(vocab)]:
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")  # one token per character
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
