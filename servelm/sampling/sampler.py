"""Batched token selection: one token per logits row, each row with its own SamplingParams.

Order of operations per row (what vLLM/SGLang users expect):
  1. logit_bias
  2. min_tokens: eos_token_ids and stop_token_ids are banned while fewer than min_tokens tokens
     have been generated
  3. penalties: repetition (prompt + output), frequency and presence (output only)
  4. greedy rows (``SamplingParams.is_greedy``): argmax, ties to the lowest token id
  5. sampled rows: temperature, top_k, top_p, min_p, then one draw

Grammar masks are applied by the engine's executor before the sampler (one bitmask op per step).

Invariants:
- The caller's logits tensor is never modified; logprobs are log_softmax of it (see logprobs.py).
- A seeded row's token depends only on (seed, its logits row, len(output_token_ids)), never on
  the other rows of the batch: its randomness comes from a generator seeded from exactly that.
  A row's seed is its request's ``seed``, else its ``default_seed``: the engine derives one per
  request from the server's ``--seed`` and the request's arrival order (``request_seed``), so a
  server restarted with the same seed and sent the same requests in the same order samples the
  same tokens, however they were batched.
- Work is vectorised across rows and skipped when no row needs it (no clone without a processor,
  no vocab sort without top_k/top_p, no log_softmax without logprobs).

Sampling uses the exponential race: ``argmax(probs / E)`` with ``E ~ Exp(1)`` i.i.d. per token
picks token i with probability ``probs[i] / sum(probs)``, so filtered distributions need no
renormalisation and each row's draw is a fixed-size block of noise from its own generator.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from servelm.sampling.argmax import NativeArgmax, first_argmax
from servelm.sampling.logprobs import TokenLogprob, compute_prompt_logprobs, gather_logprobs
from servelm.sampling.params import SamplingParams
from servelm.sampling.penalties import apply_logit_bias, apply_penalties, ban_tokens

__all__ = ["Sampler", "SamplerOutput", "SamplingRow", "compute_prompt_logprobs", "needs_only_argmax", "request_seed"]

_UINT64_MASK = (1 << 64) - 1


@dataclass(slots=True)
class SamplingRow:
    """One logits row to sample from, with the request state the processors need."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    """Generated so far (for penalties, min_tokens and the seeded generator's step)."""
    eos_token_ids: list[int]
    """Suppressed while len(output_token_ids) < params.min_tokens."""
    default_seed: int | None = None
    """The generator seed when ``params.seed`` is None (see ``request_seed``); None as well: the
    sampler's shared generator."""

    @property
    def seed(self) -> int | None:
        return self.params.seed if self.params.seed is not None else self.default_seed


@dataclass
class SamplerOutput:
    """The chosen token for each row, in row order."""

    token_ids: list[int]
    logprobs: list[TokenLogprob | None] | None
    """None when no row asked; else one entry per row, None for rows that did not ask."""


def needs_only_argmax(params: SamplingParams, num_output_tokens: int) -> bool:
    """Whether this sampler picks the argmax of the raw logits row and reads nothing else of it:
    greedy, no logprobs, no logit bias, no penalties, no min_tokens ban at this length, no beam
    search (its beams read logprobs). The caller adds what the sampler does not see (grammars,
    speculative drafts, prompt logprobs)."""
    return (params.is_greedy and params.logprobs is None and not params.logit_bias
            and not params.needs_penalties and num_output_tokens >= params.min_tokens
            and params.beam is None)


class Sampler:
    """Picks one token per logits row. Stateless apart from the generator of unseeded rows."""

    def __init__(self, seed: int | None = None, native_argmax: NativeArgmax | None = None) -> None:
        """``seed`` fixes the shared generator of unseeded rows (tests); None seeds it randomly.
        ``native_argmax``: greedy rows' argmax in one native call where it takes them (the engine
        passes the fused ops' ``first_argmax``), else ``first_argmax``'s torch ops: the same ids."""
        self._seed = seed
        self.native_argmax = native_argmax
        self._shared_generators: dict[torch.device, torch.Generator] = {}
        self._seeded_generators: dict[torch.device, torch.Generator] = {}

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow],
                 argmax: Mapping[int, int] | None = None) -> SamplerOutput:
        """``argmax``: rows whose argmax the caller already has (row -> token id: the LM-head screen's,
        ``torch.argmax``'s answer on the row), taken for those of them that are greedy instead of
        searching their rows; the caller passes only rows whose logits this sampler reads for
        nothing else (``needs_only_argmax``)."""
        assert logits.dim() == 2 and logits.shape[0] == len(rows), "one logits row per SamplingRow"
        processed = self._process(logits, rows)
        known = {row: token for row, token in (argmax or {}).items() if rows[row].params.is_greedy}
        if not known:
            token_ids = self._select(processed, rows)
        else:   # the other rows chosen as always, on a copy of their logits rows
            rest = [row for row in range(len(rows)) if row not in known]
            if rest:
                picked = self._select(processed[torch.tensor(rest, device=processed.device)], [rows[r] for r in rest])
                known.update(zip(rest, picked))
            token_ids = [known[row] for row in range(len(rows))]
        return SamplerOutput(token_ids=token_ids, logprobs=self._logprobs(logits, rows, token_ids))

    # -- steps 1-3: logit processors -------------------------------------------------------------

    def _process(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """Bias, min_tokens bans and penalties; returns a copy when any applies."""
        biases = [(i, token_id, bias)
                  for i, row in enumerate(rows) if row.params.logit_bias
                  for token_id, bias in row.params.logit_bias.items()]
        bans = [(i, row.eos_token_ids + row.params.stop_token_ids)
                for i, row in enumerate(rows) if len(row.output_token_ids) < row.params.min_tokens]
        penalized = [i for i, row in enumerate(rows) if row.params.needs_penalties]
        if not (biases or bans or penalized):
            return logits
        logits = logits.to(torch.float32, copy=True)
        apply_logit_bias(logits, biases)
        ban_tokens(logits, bans)
        if penalized:
            index = torch.tensor(penalized, device=logits.device)
            selected = logits[index]
            apply_penalties(
                selected,
                [rows[i].prompt_token_ids for i in penalized],
                [rows[i].output_token_ids for i in penalized],
                [rows[i].params.repetition_penalty for i in penalized],
                [rows[i].params.frequency_penalty for i in penalized],
                [rows[i].params.presence_penalty for i in penalized],
            )
            logits[index] = selected
        return logits

    # -- steps 4-5: selection --------------------------------------------------------------------

    def _select(self, logits: torch.Tensor, rows: list[SamplingRow]) -> list[int]:
        greedy = [i for i, row in enumerate(rows) if row.params.is_greedy]
        if len(greedy) == len(rows):
            # The first maximal index, as torch.argmax: ties go to the lowest token id.
            token_ids: list[int] = first_argmax(logits, self.native_argmax).tolist()
            return token_ids
        sampled = [i for i, row in enumerate(rows) if not row.params.is_greedy]
        device = logits.device
        chosen = torch.empty(len(rows), dtype=torch.int64, device=device)
        if greedy:
            greedy_index = torch.tensor(greedy, device=device)
            chosen[greedy_index] = first_argmax(logits[greedy_index], self.native_argmax)
        sampled_index = torch.tensor(sampled, device=device)
        sampled_logits = logits if len(sampled) == len(rows) else logits[sampled_index]
        chosen[sampled_index] = self._sample(sampled_logits, [rows[i] for i in sampled])
        result: list[int] = chosen.tolist()
        return result

    def _sample(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """Draw one token per row of ``logits`` ``[m, vocab_size]`` (all rows non-greedy)."""
        probs = self._distribution(logits, rows)
        noise = self._exponential_noise(rows, logits.shape[1], logits.device)
        return (probs / noise).argmax(dim=-1)

    def probabilities(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """The distribution each row's token is drawn from, float32 ``[len(rows), vocab_size]``
        (unnormalised after min_p: the race needs no normalising, callers that do divide by the
        sum): logit processors, then a point mass on the argmax for a greedy row, else
        temperature, top_k, top_p and min_p. Speculative decoding's rejection sampler compares
        the drafts with it (``servelm.spec.verify.rejection_sample``)."""
        assert logits.dim() == 2 and logits.shape[0] == len(rows), "one logits row per SamplingRow"
        processed = self._process(logits, rows)
        probs = torch.zeros(processed.shape, dtype=torch.float32, device=processed.device)
        greedy = [i for i, row in enumerate(rows) if row.params.is_greedy]
        if greedy:
            index = torch.tensor(greedy, device=processed.device)
            probs[index, first_argmax(processed[index], self.native_argmax)] = 1.0
        sampled = [i for i, row in enumerate(rows) if not row.params.is_greedy]
        if sampled:
            index = torch.tensor(sampled, device=processed.device)
            distribution = self._distribution(processed[index], [rows[i] for i in sampled])
            probs[index] = distribution / distribution.sum(dim=-1, keepdim=True)
        return probs

    def _distribution(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """Temperature, top_k, top_p, softmax and min_p of non-greedy rows ``[m, vocab_size]``."""
        vocab_size = logits.shape[1]
        device = logits.device
        params = [row.params for row in rows]
        temperature = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device)
        logits = logits / temperature[:, None]

        top_k = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params]
        top_p = [p.top_p for p in params]
        if any(k < vocab_size for k in top_k) or any(p < 1.0 for p in top_p):
            logits = _apply_top_k_top_p(logits, top_k, top_p)

        probs = torch.softmax(logits, dim=-1)
        min_p = [p.min_p for p in params]
        if any(m > 0.0 for m in min_p):
            threshold = probs.amax(dim=-1, keepdim=True) * torch.tensor(min_p, device=device)[:, None]
            probs = probs.masked_fill(probs < threshold, 0.0)
        return probs

    def _exponential_noise(self, rows: list[SamplingRow], vocab_size: int,
                           device: torch.device) -> torch.Tensor:
        """Exp(1) noise ``[len(rows), vocab_size]``; seeded rows' rows come from their own seed."""
        noise = torch.empty(len(rows), vocab_size, dtype=torch.float32, device=device)
        unseeded = [j for j, row in enumerate(rows) if row.seed is None]
        shared = self._shared_generator(device)
        if len(unseeded) == len(rows):
            noise.exponential_(generator=shared)
        elif unseeded:
            block = torch.empty(len(unseeded), vocab_size, dtype=torch.float32, device=device)
            noise[torch.tensor(unseeded, device=device)] = block.exponential_(generator=shared)
        for j, row in enumerate(rows):
            seed = row.seed
            if seed is not None:
                generator = self._seeded_generator(device)
                generator.manual_seed(_row_seed(seed, len(row.output_token_ids)))
                noise[j].exponential_(generator=generator)
        # A zero draw would make 0/0 = NaN for filtered tokens, and argmax prefers NaN.
        return noise.clamp_(min=torch.finfo(torch.float32).tiny)

    def _shared_generator(self, device: torch.device) -> torch.Generator:
        generator = self._shared_generators.get(device)
        if generator is None:
            generator = torch.Generator(device=device)
            if self._seed is None:
                generator.seed()
            else:
                generator.manual_seed(_row_seed(self._seed, 0))
            self._shared_generators[device] = generator
        return generator

    def _seeded_generator(self, device: torch.device) -> torch.Generator:
        generator = self._seeded_generators.get(device)
        if generator is None:
            generator = torch.Generator(device=device)
            self._seeded_generators[device] = generator
        return generator

    # -- logprobs --------------------------------------------------------------------------------

    def _logprobs(self, raw_logits: torch.Tensor, rows: list[SamplingRow],
                  token_ids: list[int]) -> list[TokenLogprob | None] | None:
        asking = [i for i, row in enumerate(rows) if row.params.logprobs is not None]
        if not asking:
            return None
        selected = raw_logits if len(asking) == len(rows) else raw_logits[
            torch.tensor(asking, device=raw_logits.device)]
        computed = gather_logprobs(selected, [token_ids[i] for i in asking],
                                   [rows[i].params.logprobs or 0 for i in asking])
        result: list[TokenLogprob | None] = [None] * len(rows)
        for i, entry in zip(asking, computed):
            result[i] = entry
        return result


def _apply_top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Set to -inf every token outside each row's top_k, then outside its top_p nucleus.

    Semantics are those of a stable descending sort of the vocabulary: ties are broken towards
    the lowest token id exactly as greedy does (top_k=1 and a tiny top_p both reproduce argmax),
    top_p is measured on the distribution left after top_k, and the most likely token always
    survives. Sorting 150k-token rows dominates the sampler's cost, so each row first tries the
    exact shortcut of _filter_candidates and only rows it cannot settle get the full sort. Which
    path a row takes depends on that row alone, so seeded rows stay batch-independent.
    """
    num_rows, vocab_size = logits.shape
    device = logits.device
    top_k_tensor = torch.tensor(top_k, device=device)
    bound = _top_p_bound(top_p, device)
    removed = torch.zeros_like(logits, dtype=torch.bool)
    unsettled = [i for i in range(num_rows) if top_k[i] < vocab_size or top_p[i] < 1.0]
    if vocab_size > _NUM_CANDIDATES:
        # The shortcut needs the whole top_k inside the candidates (or top_k off).
        shortcut = [i for i in unsettled if top_k[i] < _NUM_CANDIDATES or top_k[i] == vocab_size]
        if shortcut:
            index = torch.tensor(shortcut, device=device)
            row_removed, is_exact = _filter_candidates(logits[index], top_k_tensor[index], bound[index])
            removed[index] = row_removed
            settled = set(index[is_exact].tolist())
            unsettled = [i for i in unsettled if i not in settled]
    if unsettled:
        index = torch.tensor(unsettled, device=device)
        removed[index] = _filter_sorted(logits[index], top_k_tensor[index], bound[index])
    return logits.masked_fill(removed, float("-inf"))


_NUM_CANDIDATES = 1024
"""Tokens the top_k/top_p shortcut looks at; rows with a larger top_k use the full sort."""


def _top_p_bound(top_p: list[float], device: torch.device) -> torch.Tensor:
    """[m, 1] mass bound; rows with top_p == 1 get inf so cumsum rounding can drop nothing."""
    return torch.tensor([p if p < 1.0 else float("inf") for p in top_p], device=device)[:, None]


def _filter_sorted(logits: torch.Tensor, top_k: torch.Tensor, bound: torch.Tensor) -> torch.Tensor:
    """Removed-token mask [m, vocab] from a stable descending sort of each whole row."""
    vocab_size = logits.shape[1]
    sorted_logits, sorted_ids = logits.sort(dim=-1, descending=True, stable=True)
    positions = torch.arange(vocab_size, device=logits.device)[None, :]
    is_removed = positions >= top_k[:, None]
    if bool(torch.isfinite(bound).any()):
        probs = torch.softmax(sorted_logits.masked_fill(is_removed, float("-inf")), dim=-1)
        is_removed |= (probs.cumsum(dim=-1) - probs) >= bound
    return torch.zeros_like(is_removed).scatter_(1, sorted_ids, is_removed)


def _filter_candidates(logits: torch.Tensor, top_k: torch.Tensor, bound: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Removed-token mask [m, vocab] from each row's _NUM_CANDIDATES largest logits, and a bool
    [m] saying for which rows it equals _filter_sorted's.

    Exact when every kept token is strictly above the smallest candidate: then the kept tokens
    lie in the set of tokens larger than it, which topk always returns in full, and ordering the
    candidates by (logit desc, id asc) puts that set in the same positions as the full stable
    sort. The top_p normaliser is the logsumexp of the top_k candidates, or of the whole row when
    top_k is off, so the nucleus mass is that of the full distribution.
    """
    num_candidates = _NUM_CANDIDATES
    values, ids = torch.topk(logits, num_candidates, dim=-1)
    ids, order = ids.sort(dim=-1)                      # ids ascending ...
    values = values.gather(1, order)
    values, order = values.sort(dim=-1, descending=True, stable=True)  # ... then logits descending
    ids = ids.gather(1, order)
    positions = torch.arange(num_candidates, device=logits.device)[None, :]
    is_removed = positions >= top_k[:, None]
    if bool(torch.isfinite(bound).any()):
        kept = values.masked_fill(is_removed, float("-inf"))
        normaliser = torch.where(top_k < logits.shape[1], torch.logsumexp(kept, dim=-1),
                                 torch.logsumexp(logits, dim=-1))
        probs = torch.exp(kept - normaliser[:, None])
        is_removed |= (probs.cumsum(dim=-1) - probs) >= bound
    smallest_kept = values.masked_fill(is_removed, float("inf")).amin(dim=-1)
    is_exact = smallest_kept > values[:, -1]
    removed = torch.ones_like(logits, dtype=torch.bool).scatter_(1, ids, is_removed)
    return removed, is_exact


def request_seed(server_seed: int, arrival_index: int) -> int:
    """The sampling seed of the ``arrival_index``-th request (from 0) to a server started with
    ``--seed server_seed``, for requests that give no seed: unrelated streams for neighbouring
    indices and seeds, and never equal to ``_row_seed``'s inputs by construction of the salt."""
    salted = _splitmix64((server_seed ^ _REQUEST_SEED_SALT) & _UINT64_MASK)
    return _splitmix64((salted + arrival_index) & _UINT64_MASK) >> 1


_REQUEST_SEED_SALT = 0x5EED_5EED_5EED_5EED


def _row_seed(seed: int, step: int) -> int:
    """A 63-bit generator seed from (seed, step): two splitmix64 rounds, so nearby seeds and
    steps give unrelated streams."""
    return _splitmix64((_splitmix64(seed & _UINT64_MASK) + step) & _UINT64_MASK) >> 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _UINT64_MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _UINT64_MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _UINT64_MASK
    return x ^ (x >> 31)
