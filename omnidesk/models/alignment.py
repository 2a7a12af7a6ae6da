"""Played audio -> heard text: which part of a spoken reply the user heard before cutting in.

The rule (documented with the thinker-talker conversation, :mod:`omnidesk.models.thinker_talker`):
text is aligned to speech linearly by characters.  It lives in a module of its own, free of torch,
because the remote executor (:mod:`omnidesk.remote`) keeps the heard part of a server's reply by
the same rule as the local executors.
"""

from __future__ import annotations


def heard_text_pieces(piece_chars: list[int], heard_samples: int, speech_samples: int, speech_done: bool,
                      chars_per_second: float, sample_rate: int) -> int:
    """How many of a reply's text pieces (tokens, or a server's text deltas) the user heard: the
    played audio -> heard text alignment (see the module docstring), shared by the local executors
    and the remote one (:mod:`omnidesk.remote`).

    ``piece_chars``: the characters of each piece, in order; ``heard_samples``: reply audio that
    reached the speaker; ``speech_samples``: reply audio made so far (exact once ``speech_done``,
    else estimated as the larger of it and the text's length at ``chars_per_second``), both at
    ``sample_rate``.  Piece j is heard once the played fraction of the speech reaches the
    fraction of the characters up to and including piece j."""
    total_chars = sum(piece_chars)
    if total_chars == 0:
        return 0
    if speech_done:
        speech = speech_samples
    else:
        speech = max(speech_samples, total_chars / chars_per_second * sample_rate)
    heard = min(1.0, heard_samples / speech) if speech else 1.0
    kept, chars = 0, 0
    for n in piece_chars:
        chars += n
        if chars / total_chars <= heard + 1e-9:
            kept += 1
        else:
            break
    return kept
