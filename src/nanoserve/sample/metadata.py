"""`SamplingMetadata`: the per-batch tensors the sampler needs, built once per step from the rows'
`SamplingParams` and a few per-request numbers. Stages no row uses are left as None so that the
sampler skips them."""
from __future__ import annotations

import array
from dataclasses import dataclass, field
from typing import Optional

import torch

from nanoserve.sampling_params import SamplingParams


_TYPECODES = {torch.float32: "f", torch.int64: "q", torch.int32: "i", torch.bool: "b"}


def small_tensor(values, dtype: torch.dtype) -> torch.Tensor:
    """A 1-D tensor from a Python sequence through a typed array: several times faster than
    `torch.tensor` on the short per-batch lists built every step."""
    if not values:
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(array.array(_TYPECODES[dtype], values), dtype=dtype)


@dataclass
class SamplingMetadata:
    temperature: Optional[torch.Tensor]  # (B,) float32; None when every row is greedy
    greedy_mask: Optional[torch.Tensor]  # (B,) bool; None when no row is greedy
    all_greedy: bool
    vocab_size: int = 0
    top_k: Optional[torch.Tensor] = None  # (B,) int64, vocab size where disabled; None if no row uses it
    top_p: Optional[torch.Tensor] = None  # (B,) float32, 1.0 where disabled
    min_p: Optional[torch.Tensor] = None  # (B,) float32, 0.0 where disabled
    # Each row's seed (None: unseeded) and output position: a seeded row's noise is a function of both.
    seeds: list = field(default_factory=list)
    positions: list = field(default_factory=list)
    # Rows drawn at random (not greedy), and among those the ones that top-k or top-p truncate.
    sample_rows: Optional[torch.Tensor] = None
    truncated: Optional[torch.Tensor] = None  # positions within sample_rows
    # Whether the caller needs the full processed logits back (logprobs_mode "processed").
    need_processed: bool = False
    # allowed_token_ids and grammars: batch rows and their (A, mask_words(V)) packed masks of allowed tokens.
    allowed_rows: Optional[torch.Tensor] = None
    allowed_mask: Optional[torch.Tensor] = None
    # (row, token) pairs banned this step: bad words whose prefix was just generated, and EOS and stop
    # tokens of rows still below min_tokens.
    banned: Optional[tuple[torch.Tensor, torch.Tensor]] = None
    # logit_bias as (row, token, bias) triples.
    bias: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None
    # Penalties: batch rows that use them, their rows in the `PenaltyState`, and the three values.
    penalty_rows: Optional[torch.Tensor] = None
    penalty_state_rows: Optional[torch.Tensor] = None
    repetition: Optional[torch.Tensor] = None
    frequency: Optional[torch.Tensor] = None
    presence: Optional[torch.Tensor] = None

    @classmethod
    def build(cls, params: list[SamplingParams], vocab_size: int,
              num_output_tokens: Optional[list[int]] = None, eos_token_ids: tuple[int, ...] = (),
              penalty_state_rows: Optional[dict[int, int]] = None,
              output_token_ids: Optional[list[list[int]]] = None,
              allowed_masks: Optional[dict[int, torch.Tensor]] = None,
              grammar_rows: frozenset[int] = frozenset()) -> "SamplingMetadata":
        """`penalty_state_rows`: batch row -> `PenaltyState` row, for the rows with penalties.
        `output_token_ids`: each row's tokens so far (for bad words). `allowed_masks`: batch row ->
        the packed mask of its allowed tokens (`pack_bits`) (allowed_token_ids, kept by the caller across steps, and
        grammar masks); built here from allowed_token_ids if absent. `grammar_rows`: rows whose grammar
        decides where they end, so min_tokens does not ban their EOS (a complete grammar allows nothing else)."""
        greedy = [p.greedy for p in params]
        md = cls(None, None, all(greedy), vocab_size)
        if output_token_ids is not None:
            num_output_tokens = [len(ids) for ids in output_token_ids]
        md.seeds = [p.seed for p in params]
        md.positions = num_output_tokens or [0] * len(params)
        md._build_processors(params, vocab_size, num_output_tokens or [0] * len(params), eos_token_ids,
                             penalty_state_rows or {}, output_token_ids, allowed_masks or {}, grammar_rows)
        if md.all_greedy:
            return md
        md.temperature = small_tensor([1.0 if g else p.temperature for p, g in zip(params, greedy)], torch.float32)
        if any(greedy):
            md.greedy_mask = small_tensor(greedy, torch.bool)
            md.sample_rows = small_tensor([i for i, g in enumerate(greedy) if not g], torch.int64)
        if any(p.top_k > 0 for p in params):
            md.top_k = small_tensor([min(p.top_k, vocab_size) if p.top_k > 0 else vocab_size for p in params],
                                    torch.int64)
        if any(p.top_p < 1.0 for p in params):
            md.top_p = small_tensor([p.top_p for p in params], torch.float32)
        if any(p.min_p > 0.0 for p in params):
            md.min_p = small_tensor([p.min_p for p in params], torch.float32)
        sampled = [p for p, g in zip(params, greedy) if not g]
        truncated = [j for j, p in enumerate(sampled) if 0 < p.top_k < vocab_size or p.top_p < 1.0]
        if truncated:
            md.truncated = small_tensor(truncated, torch.int64)
        return md

    def _build_processors(self, params, vocab_size, num_output_tokens, eos_token_ids, penalty_rows,
                          output_token_ids, allowed_masks, grammar_rows=frozenset()) -> None:
        allowed = sorted({i for i, p in enumerate(params) if p.allowed_token_ids} | set(allowed_masks))
        if allowed:
            self.allowed_rows = small_tensor(allowed, torch.int64)
            self.allowed_mask = torch.stack([allowed_masks[i] if i in allowed_masks
                                             else allowed_token_mask(params[i], vocab_size) for i in allowed])
        ban_rows, ban_tokens = [], []
        for i, (p, n) in enumerate(zip(params, num_output_tokens)):
            if n >= p.min_tokens and not p.bad_words_token_ids:
                continue
            banned = set()
            if n < p.min_tokens and i not in grammar_rows:
                banned |= set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_token_ids))
            if p.bad_words_token_ids:
                banned |= banned_by_bad_words(p.bad_words_token_ids, output_token_ids[i] if output_token_ids else [])
            ban_rows += [i] * len(banned)
            ban_tokens += sorted(banned)
        if ban_rows:
            self.banned = (small_tensor(ban_rows, torch.int64), small_tensor(ban_tokens, torch.int64))
        triples = [(i, t, b) for i, p in enumerate(params) if p.logit_bias for t, b in p.logit_bias.items()]
        if triples:
            rows, tokens, values = zip(*triples)
            self.bias = (small_tensor(rows, torch.int64), small_tensor(tokens, torch.int64),
                         small_tensor(values, torch.float32))
        if penalty_rows:
            batch_rows = sorted(penalty_rows)
            self.penalty_rows = small_tensor(batch_rows, torch.int64)
            self.penalty_state_rows = small_tensor([penalty_rows[i] for i in batch_rows], torch.int64)
            self.repetition = small_tensor([params[i].repetition_penalty for i in batch_rows], torch.float32)
            self.frequency = small_tensor([params[i].frequency_penalty for i in batch_rows], torch.float32)
            self.presence = small_tensor([params[i].presence_penalty for i in batch_rows], torch.float32)

    @property
    def has_processors(self) -> bool:
        return any(x is not None for x in (self.allowed_rows, self.banned, self.bias, self.penalty_rows))


def mask_words(vocab_size: int) -> int:
    """The one layout of allowed-token masks (xgrammar's, read by the C sampler): int32 words, token t is
    bit t % 32 of word t // 32."""
    return (vocab_size + 31) // 32


_BIT = 1 << torch.arange(32, dtype=torch.int64)


def pack_bits(allowed: torch.Tensor) -> torch.Tensor:
    """(..., V) bool -> (..., mask_words(V)) int32 packed mask."""
    vocab = allowed.shape[-1]
    padded = torch.zeros(*allowed.shape[:-1], mask_words(vocab) * 32, dtype=torch.int64)
    padded[..., :vocab] = allowed
    words = (padded.view(*allowed.shape[:-1], -1, 32) * _BIT).sum(-1)
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def unpack_bits(words: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(..., mask_words(V)) int32 packed mask -> (..., V) bool."""
    bits = (words.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    return bits.flatten(-2)[..., :vocab_size].bool()


def allowed_token_mask(params: SamplingParams, vocab_size: int) -> torch.Tensor:
    """The packed mask of a request's allowed_token_ids."""
    mask = torch.zeros(vocab_size, dtype=torch.bool)
    mask[torch.tensor(params.allowed_token_ids, dtype=torch.long)] = True
    return pack_bits(mask)


class GrammarMasks:
    """The packed allowed-token masks of structured-outputs rows, from their xgrammar matchers, in one call.
    One thread: at 32 rows a fill takes ~0.2 ms, and two threads made it 3-5x slower (`bench grammar`)."""

    def __init__(self, vocab_size: int):
        import xgrammar

        self.words, self.batch = mask_words(vocab_size), xgrammar.BatchGrammarMatcher(max_threads=1)

    def __call__(self, matchers: list) -> torch.Tensor:
        mask = torch.empty(len(matchers), self.words, dtype=torch.int32)
        self.batch.batch_fill_next_token_bitmask(matchers, mask)
        return mask


def banned_by_bad_words(bad_words: list[list[int]], output_ids: list[int]) -> set[int]:
    """The last token of every bad-word sequence whose other tokens were just generated: banning it
    now keeps the whole sequence out of the output (one-token words are banned outright)."""
    banned = set()
    for seq in bad_words:
        prefix = seq[:-1]
        if not prefix or (len(output_ids) >= len(prefix) and output_ids[len(output_ids) - len(prefix):] == prefix):
            banned.add(seq[-1])
    return banned
