"""Moshi's text tokenizer: the SentencePiece model of the published repos (``tokenizer_spm_32k_3.model``).

Moshi's text stream is one SentencePiece id per 80 ms frame; most frames are
padding (ids the config names), the rest are word pieces.  OmniDesk only
decodes (the model writes the text, the user never types to it), so this is
a thin wrapper over ``sentencepiece``: ids -> text, ids the model knows but
the tokenizer does not (the LM's text vocabulary may be larger) decode to "".

:func:`write_demo_tokenizer` trains a tiny model at demo time from a built-in
text, so no binary file is shipped; training is seeded and single-threaded, so
the same bytes come out every time.
"""

from __future__ import annotations

import io
from pathlib import Path

from ..checkpoint import CheckpointError

# The special ids of the published model (<unk> 0, <s> 1, </s> 2, <pad> 3): the demo uses the same.
SPECIAL_IDS = dict(unk_id=0, bos_id=1, eos_id=2, pad_id=3)


class MoshiTokenizer:
    """Decodes Moshi's text tokens (a SentencePiece model) to text."""

    def __init__(self, model_bytes: bytes, where: str = "tokenizer"):
        import sentencepiece as spm

        self.where = where
        self._sp = spm.SentencePieceProcessor()
        try:
            self._sp.LoadFromSerializedProto(model_bytes)
        except Exception as e:  # sentencepiece raises RuntimeError / OSError for a damaged model
            raise CheckpointError(f"{where}: not a SentencePiece model ({type(e).__name__}: {e})") from None
        self.vocab_size = int(self._sp.GetPieceSize())

    @classmethod
    def from_file(cls, path: str | Path) -> "MoshiTokenizer":
        path = Path(path)
        if not path.is_file():
            raise CheckpointError(f"{path.parent}: missing file {path.name} (the text tokenizer)")
        return cls(path.read_bytes(), str(path))

    def decode(self, ids) -> str:
        """Text of ``ids``; ids outside the tokenizer's vocabulary are dropped (decode to "")."""
        keep = [int(i) for i in ids if 0 <= int(i) < self.vocab_size]
        return self._sp.DecodeIds(keep) if keep else ""

    def encode(self, text: str) -> list[int]:
        """Ids of ``text`` (for tests and tools; the assistant never encodes)."""
        return list(self._sp.EncodeAsIds(text))

    def piece(self, token: int) -> str:
        return self._sp.IdToPiece(int(token)) if 0 <= int(token) < self.vocab_size else ""


# A few sentences of plain English: enough for a few hundred pieces of a demo tokenizer.
_DEMO_TEXT = """\
Hello, how can I help you today?
I am a tiny demo model with random weights, so what I say is noise.
The weather is nice today; would you like to go for a walk in the park?
Please tell me more about what you are working on this afternoon.
Sure, I can explain that again, more slowly this time.
That is a good question, and the answer depends on what you want to do next.
Let me think about it for a second before I answer you.
We talked about music, about books, about the garden and about the evening news.
Yes. No. Maybe later. Thank you very much. You are welcome. Good morning. Good night.
One, two, three, four, five, six, seven, eight, nine, ten, eleven, twelve.
The quick brown fox jumps over the lazy dog while the cat sleeps by the window.
Speaking and listening at the same time is what a full duplex model does all day.
"""
DEMO_VOCAB = 320


def demo_tokenizer_bytes(vocab_size: int = DEMO_VOCAB) -> bytes:
    """A tiny SentencePiece model trained on a built-in text: deterministic (one thread, no
    sampling of the input), a fraction of a second.  ``hard_vocab_limit=False`` lets the trainer
    stop below ``vocab_size`` if the text cannot fill it, so the result never has more pieces
    than asked for (the LM's text_card must hold them all) and training never fails on it."""
    import sentencepiece as spm

    out = io.BytesIO()
    lines = [line for line in _DEMO_TEXT.splitlines() if line.strip()]
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines * 4), model_writer=out, vocab_size=vocab_size, model_type="unigram",
        hard_vocab_limit=False, character_coverage=1.0, num_threads=1, input_sentence_size=0,
        shuffle_input_sentence=False, normalization_rule_name="identity", minloglevel=2, **SPECIAL_IDS)
    return out.getvalue()


def write_demo_tokenizer(path: str | Path, vocab_size: int = DEMO_VOCAB) -> Path:
    """Write the demo tokenizer model to ``path`` (a file); returns it."""
    path = Path(path)
    path.write_bytes(demo_tokenizer_bytes(vocab_size))
    return path


__all__ = ["DEMO_VOCAB", "MoshiTokenizer", "SPECIAL_IDS", "demo_tokenizer_bytes", "write_demo_tokenizer"]
