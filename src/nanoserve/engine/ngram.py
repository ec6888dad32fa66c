"""N-gram speculation (prompt lookup, `--speculative-ngram K`): draft tokens for a request from its own
prompt and output, no draft model. The longest recent n-gram that occurred before proposes what followed it."""
from __future__ import annotations

import numpy as np

# The n-gram lengths tried, longest first. A 1-gram match proposes too often to pay for its rows.
NGRAM_MAX, NGRAM_MIN = 4, 2


def drafts_per_request(num_draft: int, max_rows: int, num_running: int) -> int:
    """Drafts each running request may get in the next step: `num_draft` (--speculative-ngram) while the
    step's decode rows, a token and its drafts per request, stay within `max_rows`; 0 beyond."""
    return max(0, min(num_draft, max_rows // max(1, num_running) - 1))


def propose_ngram(tokens: list[int], k: int, min_n: int = NGRAM_MIN, max_n: int = NGRAM_MAX) -> list[int]:
    """Up to `k` tokens that followed the most recent earlier occurrence of the last n tokens (n from
    `max_n` down to `min_n`); [] when no suffix occurred before."""
    length = len(tokens)
    if k <= 0 or length <= min_n:
        return []
    arr = np.asarray(tokens, dtype=np.int64)
    # Candidate ends: earlier positions holding the last token (never the last position itself), which
    # are then narrowed to those whose preceding d tokens also match, d = 1, 2, ...
    ends = np.flatnonzero(arr[:length - 1] == arr[length - 1])
    best, matched = -1, 1
    for d in range(1, max_n):
        if d >= min_n and ends.size:
            best, matched = int(ends[-1]), d  # the most recent end whose last d tokens match
        ends = ends[ends >= d]
        ends = ends[arr[ends - d] == arr[length - 1 - d]] if ends.size else ends
        if not ends.size:
            break
    else:
        if ends.size:
            best, matched = int(ends[-1]), max_n
    if best < 0 or matched < min_n:
        return []
    return tokens[best + 1:best + 1 + k]
