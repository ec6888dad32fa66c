"""`PenaltyState`: per-request token statistics for repetition, frequency and presence penalties,
kept in persistent rows of tensors (which tokens the prompt holds, how often each output token
occurred, and the list of distinct tokens seen in either, which the C kernel walks instead of the
whole vocabulary) and updated with each sampled token instead of being recounted every step."""
from __future__ import annotations

import torch


class PenaltyState:
    def __init__(self, vocab_size: int, initial_rows: int = 8):
        self.vocab_size = vocab_size
        self.prompt_mask = torch.zeros(initial_rows, vocab_size, dtype=torch.bool)
        self.output_counts = torch.zeros(initial_rows, vocab_size, dtype=torch.int32)
        # The distinct tokens of each row's prompt and output, in order of first appearance.
        self.seen_tokens = torch.zeros(initial_rows, 256, dtype=torch.int32)
        self.num_seen = torch.zeros(initial_rows, dtype=torch.int64)
        self.rows: dict[str, int] = {}  # request id -> row
        self.free_rows = list(range(initial_rows - 1, -1, -1))

    def row(self, request_id: str, prompt_ids: list[int], output_ids: list[int]) -> int:
        """The request's row, created from its tokens on first use."""
        row = self.rows.get(request_id)
        if row is not None:
            return row
        if not self.free_rows:
            self._grow()
        row = self.rows[request_id] = self.free_rows.pop()
        self.prompt_mask[row].zero_()
        self.prompt_mask[row, torch.tensor(prompt_ids, dtype=torch.long)] = True
        self.output_counts[row].zero_()
        if output_ids:  # e.g. a request whose first sampling step came after preemption
            ids = torch.tensor(output_ids, dtype=torch.long)
            self.output_counts[row].index_add_(0, ids, torch.ones_like(ids, dtype=torch.int32))
        seen = list(dict.fromkeys([*prompt_ids, *output_ids]))
        self._reserve(len(seen))
        self.seen_tokens[row, :len(seen)] = torch.tensor(seen, dtype=torch.int32)
        self.num_seen[row] = len(seen)
        return row

    def _reserve(self, width: int) -> None:
        """Makes room for `width` seen tokens in every row (doubling the columns)."""
        cols = self.seen_tokens.shape[1]
        if width > cols:
            while cols < width:
                cols *= 2
            grown = torch.zeros(self.seen_tokens.shape[0], cols, dtype=torch.int32)
            grown[:, :self.seen_tokens.shape[1]] = self.seen_tokens
            self.seen_tokens = grown

    def _grow(self) -> None:
        old = self.prompt_mask.shape[0]
        self.prompt_mask = torch.cat([self.prompt_mask, torch.zeros_like(self.prompt_mask)])
        self.output_counts = torch.cat([self.output_counts, torch.zeros_like(self.output_counts)])
        self.seen_tokens = torch.cat([self.seen_tokens, torch.zeros_like(self.seen_tokens)])
        self.num_seen = torch.cat([self.num_seen, torch.zeros_like(self.num_seen)])
        self.free_rows.extend(range(2 * old - 1, old - 1, -1))

    def remove(self, request_id: str) -> None:
        row = self.rows.pop(request_id, None)
        if row is not None:
            self.free_rows.append(row)

    def record(self, rows: torch.Tensor, tokens: torch.Tensor) -> None:
        """Counts one new output token for each given row (distinct rows; batched scatters) and appends
        the tokens seen for the first time to their rows' lists."""
        new = ~self.prompt_mask[rows, tokens] & (self.output_counts[rows, tokens] == 0)
        if bool(new.any()):
            new_rows = rows[new]
            self._reserve(int(self.num_seen[new_rows].max()) + 1)
            self.seen_tokens[new_rows, self.num_seen[new_rows]] = tokens[new].to(torch.int32)
            self.num_seen[new_rows] += 1
        self.output_counts.index_put_((rows, tokens), torch.ones_like(tokens, dtype=torch.int32),
                                      accumulate=True)


def apply_penalties(logits: torch.Tensor, prompt_mask: torch.Tensor, output_counts: torch.Tensor,
                    repetition: torch.Tensor, frequency: torch.Tensor, presence: torch.Tensor) -> torch.Tensor:
    """logits (P, V) of the rows with penalties. Repetition (HF / vLLM definition) divides positive and
    multiplies negative logits of every token seen in the prompt or the output; frequency and presence
    (OpenAI's definition) subtract per output occurrence and once per output token."""
    counts = output_counts.to(logits.dtype)
    seen = prompt_mask | (output_counts > 0)
    rep = repetition.unsqueeze(1)
    penalized = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalized, logits)
    return logits - frequency.unsqueeze(1) * counts - presence.unsqueeze(1) * (counts > 0).to(logits.dtype)
