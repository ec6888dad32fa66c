"""`Sampler`: samples one token for every row of a batch in one chain of tensor operations, in vLLM's
order: allowed tokens -> min_tokens (EOS and stop tokens banned) and logit_bias -> repetition,
frequency and presence penalties -> greedy rows take the argmax; the others are scaled by their own
temperature, filtered by min_p, then by top-k and top-p (one sort for the whole batch, each row its
own thresholds), and drawn by the exponential race `argmax(p / q)`, `q ~ Exp(1)`, which picks token i
with probability p_i and lets seeded rows draw their noise from their own generator. Stages no row
uses are skipped."""
from __future__ import annotations

from typing import Optional

import torch

from nanoserve.sample.metadata import SamplingMetadata
from nanoserve.sample.penalties import PenaltyState, apply_penalties


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Masks tokens whose probability is below min_p times the row's top probability."""
    probs = torch.softmax(logits, dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    return logits.masked_fill(probs < threshold, float("-inf"))


TOP_CANDIDATES = 1024  # top-k/top-p look at this many best tokens per row before any full sort


def apply_top_k_top_p(logits: torch.Tensor, top_k: Optional[torch.Tensor],
                      top_p: Optional[torch.Tensor]) -> torch.Tensor:
    """top-k keeps tokens whose logit is at least the row's k-th largest; top-p then keeps each token
    while the probability of the tokens ranked above it is below p (so at least the best one).
    Returns the whole (B, V) logits with dropped tokens at -inf; rows using neither are untouched."""
    if top_k is None and top_p is None:
        return logits
    batch, vocab = logits.shape
    k = top_k if top_k is not None else torch.full((batch,), vocab)
    p = top_p if top_p is not None else torch.ones(batch)
    rows = ((k < vocab) | (p < 1.0)).nonzero().squeeze(1)
    if rows.numel() == 0:
        return logits
    out = logits.clone()
    values, order, full = top_k_top_p_candidates(logits[rows], k[rows], p[rows])
    out[rows[~full]] = scatter_candidates(values[~full], order[~full], vocab)
    out[rows[full]] = truncate_full(logits[rows[full]], k[rows[full]], p[rows[full]])
    return out


def top_k_top_p_candidates(sub: torch.Tensor, k: torch.Tensor, p: torch.Tensor):
    """Filters rows by top-k and top-p looking only at each row's best TOP_CANDIDATES tokens (one
    `topk` for the batch instead of a full sort). Returns the candidates' filtered logits (-inf where
    dropped), their token ids, and which rows need the full vocabulary to be exact: the candidates hold
    less than p of the mass, or a tie at the k-th value spans the candidate boundary."""
    vocab = sub.shape[-1]
    cand = min(vocab, max(TOP_CANDIDATES, int(k[k < vocab].max()) if bool((k < vocab).any()) else 0))
    values, order, needs_full = _truncate_sorted(sub, k, p, cand)
    return values, order, needs_full


def truncate_full(sub: torch.Tensor, k: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """The exact filter over the whole vocabulary (one full sort), as (B, V) logits."""
    vocab = sub.shape[-1]
    values, order, _ = _truncate_sorted(sub, k, p, vocab)
    return scatter_candidates(values, order, vocab)


def scatter_candidates(values: torch.Tensor, order: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.full((values.shape[0], vocab), float("-inf")).scatter_(1, order, values)


def _truncate_sorted(sub: torch.Tensor, k: torch.Tensor, p: torch.Tensor, cand: int):
    vocab = sub.shape[-1]
    values, order = sub.topk(cand, dim=-1)  # descending
    k_on = k < vocab
    kth = values.gather(1, (k - 1).clamp(max=cand - 1).unsqueeze(1))
    kth = torch.where(k_on.unsqueeze(1), kth, torch.full_like(kth, float("-inf")))
    # Normaliser over the whole row after top-k (ties at the k-th value are kept).
    lse = torch.logsumexp(sub.masked_fill(sub < kth, float("-inf")), dim=-1, keepdim=True)
    values = values.masked_fill(values < kth, float("-inf"))
    probs = torch.exp(values - lse)
    above = probs.cumsum(dim=-1) - probs
    keep = (above < p.unsqueeze(1)) & (values > float("-inf"))
    keep[:, 0] = True
    needs_full = torch.zeros(sub.shape[0], dtype=torch.bool)
    if cand < vocab:
        tie_beyond = k_on & (values[:, -1] >= kth.squeeze(1))
        # Without top-k the tokens past the candidates are live; they matter if the candidates hold < p.
        mass_beyond = ~k_on & (probs.sum(dim=-1) < p)
        needs_full = tie_beyond | mass_beyond
    return values.masked_fill(~keep, float("-inf")), order, needs_full


def apply_processors(logits: torch.Tensor, md: SamplingMetadata,
                     penalties: Optional[PenaltyState]) -> torch.Tensor:
    """The logits processors that also apply to greedy rows, in vLLM's order."""
    logits = logits.clone()
    if md.allowed_rows is not None:
        rows = logits[md.allowed_rows]
        logits[md.allowed_rows] = rows.masked_fill(~md.allowed_mask, float("-inf"))
    if md.banned is not None:
        logits[md.banned] = float("-inf")
    if md.bias is not None:
        rows, tokens, values = md.bias
        logits.index_put_((rows, tokens), values, accumulate=True)
    if md.penalty_rows is not None:
        state_rows = md.penalty_state_rows
        logits[md.penalty_rows] = apply_penalties(
            logits[md.penalty_rows], penalties.prompt_mask[state_rows], penalties.output_counts[state_rows],
            md.repetition, md.frequency, md.presence)
    return logits


class Sampler:
    def __init__(self, generator: Optional[torch.Generator] = None):
        self.generator = generator or torch.Generator().manual_seed(0)

    def __call__(self, logits: torch.Tensor, md: SamplingMetadata,
                 penalties: Optional[PenaltyState] = None) -> torch.Tensor:
        """logits: (B, V) float32. Returns (B,) int64 token ids."""
        return self.sample(logits, md, penalties)[0]

    def sample(self, logits: torch.Tensor, md: SamplingMetadata, penalties: Optional[PenaltyState] = None
               ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Returns the sampled ids and, when `md.need_processed`, the processed logits they were drawn
        from (greedy rows: after the processors, without temperature or truncation)."""
        if md.has_processors:
            logits = apply_processors(logits, md, penalties)
        if md.all_greedy:
            return logits.argmax(dim=-1), logits
        batch, vocab = logits.shape
        rows = md.sample_rows if md.sample_rows is not None else torch.arange(batch)
        tokens = torch.empty(batch, dtype=torch.long)
        if md.greedy_mask is not None:
            greedy = md.greedy_mask.nonzero().squeeze(1)
            tokens[greedy] = logits.index_select(0, greedy).argmax(dim=-1)
        x = logits.index_select(0, rows) if md.sample_rows is not None else logits.clone()
        x.div_(md.temperature[rows].unsqueeze(1))
        if md.min_p is not None:
            on = (md.min_p[rows] > 0).nonzero().squeeze(1)
            x[on] = apply_min_p(x[on], md.min_p[rows][on])
        processed = logits.clone() if md.need_processed else None
        # Rows without top-k/top-p race over the whole vocabulary; the others over their candidates only.
        whole = torch.ones(len(rows), dtype=torch.bool)
        if md.truncated is not None:
            t = md.truncated
            k = md.top_k[rows[t]] if md.top_k is not None else torch.full((len(t),), vocab)
            p = md.top_p[rows[t]] if md.top_p is not None else torch.ones(len(t))
            values, order, full = top_k_top_p_candidates(x[t], k, p)
            ok = (~full).nonzero().squeeze(1)
            if ok.numel():
                probs = torch.softmax(values[ok], dim=-1)
                noise = self.exponential_noise(rows[t[ok]], probs.shape[1], md, order[ok])
                tokens[rows[t[ok]]] = order[ok].gather(1, (probs / noise).argmax(dim=-1, keepdim=True)).squeeze(1)
                if processed is not None:
                    processed[rows[t[ok]]] = scatter_candidates(values[ok], order[ok], vocab)
            whole[t[ok]] = False
            redo = t[full]
            if redo.numel():
                x[redo] = truncate_full(x[redo], k[full], p[full])
        whole = whole.nonzero().squeeze(1)
        if whole.numel():
            probs = torch.softmax(x[whole], dim=-1)
            noise = self.exponential_noise(rows[whole], vocab, md)
            tokens[rows[whole]] = (probs / noise).argmax(dim=-1)
            if processed is not None:
                processed[rows[whole]] = x[whole]
        return tokens, processed

    def exponential_noise(self, rows: torch.Tensor, width: int, md: SamplingMetadata,
                          token_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Exp(1) noise as -log(U), U ~ Uniform[0, 1): the same distribution as `exponential_`, about
        four times faster on the CPU, and never 0 (U < 1), so `p / q` is never 0 / 0. One row per batch
        row in `rows`; `token_ids` (same shape as the result) says which token each column is when the
        race runs over candidates. A seeded row always draws one number per vocabulary token from its
        own generator and reads them by token id, so its draws do not depend on the batch around it."""
        q = torch.rand(len(rows), width, generator=self.generator)
        position = {row: j for j, row in enumerate(rows.tolist())} if md.generators else {}
        for row, gen in md.generators.items():
            j = position.get(row)
            if j is None:
                continue
            own = torch.rand(md.vocab_size if token_ids is not None else width, generator=gen)
            q[j] = own if token_ids is None else own[token_ids[j]]
        return q.log_().neg_()
