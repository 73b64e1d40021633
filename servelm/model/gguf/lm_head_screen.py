"""Exact greedy LM-head screen: the argmax of a Q8_0 GGUF LM head without reading all of it.

A greedy row with no logprobs and no logit processors needs only the argmax of its logits; so do
a greedy request's speculative verify rows (engine/executor.py ``argmax_rows``). The screen keeps,
beside the Q8_0 head, the top 5 bits of each code (``c >> 3``, packed in tiles of 16 vocabulary
rows, 80 bytes per 8 inputs of a tile, with a tiled copy of the Q8_0 scales: lm_head_screen.cpp)
and for such rows, all of a step's at once:

1. ``screen_candidates`` reads the 5-bit copy once per call (0.625 + 0.125 bytes per weight instead
   of 1 + 0.125), scores every unpacked weight register against all the step's rows (register
   blocking over rows, parallel over vocabulary tiles) and gets per vocabulary row an
   approximation ``S`` and a bound factor ``D`` such that the logit the exact int16 kernel computes
   (``gguf_kernel.block_linear_a16``, the full head's kernel) lies within ``S +- bound``,
   ``bound = (3.5 + margin) * D`` (derivation at the top of lm_head_screen.cpp: the screen's code
   is within 3.5 of the exact one, and the two kernels round the activations identically;
   ``margin`` covers float32 summation error several times over). Int8 activations (one VNNI
   product instead of two) need the rounding difference in the bound: 10x the candidates;
2. the candidates are the rows whose upper bound reaches the best lower bound: every other row's
   exact logit is strictly below some candidate's, so it can be neither the argmax nor tie it.
   The kernel selects them in the same pass (a running best lower bound per chunk of tiles, then
   the final one), never storing ``S`` and ``D``;
3. the exact logits of the candidates come from the same kernel on the gathered rows (the kernel
   computes each (activation row, weight row) pair on its own, in a fixed order: bit-identical to
   the full head, which tests/unit/model/test_lm_head_screen.py checks), and the runner returns a
   logits row holding them at their token ids and ``-inf`` elsewhere, so the sampler's
   ``argmax`` (ties to the lowest id) picks exactly the token the full head would give. The screen
   also gives that argmax itself (``tokens``: the first largest of the candidates' exact logits,
   candidates ascending), which the sampler takes instead of searching the row: at 32 greedy rows of
   Gemma 3's 262,144-token vocabulary that search read 33.5 MB a step (3.4 ms of a 62 ms step).

Two builds of lm_head_screen.cpp: AVX512-VNNI (``KERNEL``) and AVX2+FMA (``AVX2_KERNEL``: tiles of
8 rows, vpmaddubsw for VNNI's product, the same exact integer dots); ``build_screen`` takes the
first whose instructions this CPU has (``screen_build``: the AVX-512 one where it can, whatever
build the head's block kernel is) and logs which. The bound holds for both builds against both
exact kernels (``rounding_margin``).

A row whose candidate set exceeds ``max_candidates`` (a bound too loose for that hidden state)
takes the full head instead. Invariants: only ``ModelRunner.execute`` calls it, only for the plan's
``argmax_rows``, only at tp 1 and pp 1 on an unsharded Q8_0 head without softcapping
(``build_screen`` checks the rest); rows that are not argmax rows get the full head's logits.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections import deque
from dataclasses import dataclass, field
from types import ModuleType

import torch
from torch import nn

from servelm.model.cpp_kernel import CppKernel, KernelBuilds
from servelm.model.gguf import gguf_i8gemm
from servelm.model.gguf.gguf_routes import HEAD_SCREEN_ROWS, ROW_INDEPENDENT, Route
from servelm.model.gguf.gguf_blocks import BlockWeight, compact_values
from servelm.model.gguf.gguf_kernel import AVX2_FLAGS, REQUIRED_FLAGS
from servelm.model.huge_pages import on_huge_pages

logger = logging.getLogger(__name__)

KERNEL = CppKernel.beside(__file__, "lm_head_screen.cpp", "lm_head_screen", "LM-head screen kernel (AVX512-VNNI)",
                          REQUIRED_FLAGS)
AVX2_KERNEL = CppKernel.beside(__file__, "lm_head_screen.cpp", "lm_head_screen_avx2",
                               "LM-head screen kernel (AVX2+FMA)", AVX2_FLAGS)
"""The same source compiled without AVX-512: tiles of 8 rows, vpmaddubsw for VNNI (lm_head_screen.cpp)."""
KERNELS = (KERNEL, AVX2_KERNEL)


def screen_build() -> CppKernel:
    """The screen's build: the first of ``KERNELS`` whose instructions this CPU has and that builds
    (the AVX512-VNNI one where it can: tiles of 16 rows, one VNNI product per 4 inputs). The bound
    holds against either build of the exact kernel (lm_head_screen.cpp), so it need not match the
    head's block kernel, whose build is measured (block_builds.py: AVX2 on AMD Zen 4)."""
    return KernelBuilds(*KERNELS).first() or KERNELS[-1]

CODE_ERROR = 3.5
"""Largest |c - c'| between a Q8_0 code and its screen code (8 * (c >> 3) + 3.5)."""
ROUNDING_MARGIN = 5e-3
"""The least margin added to CODE_ERROR for float32 rounding (``rounding_margin``)."""


def rounding_margin(hidden: int) -> float:
    """The float32 rounding margin (in units of D) for a head of ``hidden`` inputs: twice the
    (504 nb + 2004) float32 unit roundoffs that the exact kernel's and the screen's summations over
    nb = hidden / 32 blocks can err by together (derivation at the top of lm_head_screen.cpp), at
    least ROUNDING_MARGIN (hidden 896: 9.6e-4 needed, 5e-3 used; above hidden ~2500 it grows)."""
    return max(ROUNDING_MARGIN, 2 * (504 * (hidden // 32) + 2004) * 2.0 ** -24)
WINDOW_ROWS = 64
"""The screen watches its last this many rows: when more than MAX_FALLBACK_SHARE of them took the
full head, it turns itself off for good (logged): on a model whose hidden states make the bound
too loose, the screen would only cost time (gemma3-270m: 3 of 256 real rows over the limit,
qwen2.5-coder-0.5b 1 of 256)."""
MAX_FALLBACK_SHARE = 0.25
MAX_CANDIDATES = 16384
"""Above this many candidates a row takes the full head: the gathered exact pass then costs a
sizeable part of the full head. qwen2.5-coder-0.5b's head (151,936 x 896), 1 thread, thread clock,
loaded machine: the exact pass takes 1.7 / 3.2 / 6.2 ms for 4,096 / 8,192 / 16,384 candidates, the
full head's int16 kernel 17-24 ms at one row; on 384 real decode hidden states the candidates are
median 8, mean 113, p90 272, p99 ~1,700, max 4,339 (gemma3-270m: median ~60, p99 in the hundreds),
so the limit of 4,096 sent ~1 row in 384 to the full head, as costly on average as all the others'
rescoring (68 us a row)."""


@dataclass
class ScreenStats:
    """Counts since start-up, for benchmarks and tests."""

    rows: int = 0
    """Argmax rows screened."""
    fallbacks: int = 0
    """Of those, rows whose candidates exceeded max_candidates (full head)."""
    candidates: deque[int] = field(default_factory=lambda: deque(maxlen=100_000))
    """Candidate-set size per screened row (the last 100,000; a deque: trimming a full list by one
    entry per step moved its 100,000 entries, ~0.1 ms a step)."""

    recent_fallbacks: deque[bool] = field(default_factory=lambda: deque(maxlen=WINDOW_ROWS))
    """Whether each of the last WINDOW_ROWS rows took the full head."""

    def record(self, counts: list[int], fallbacks: list[bool]) -> None:
        self.rows += len(counts)
        self.fallbacks += sum(fallbacks)
        self.candidates.extend(counts)
        self.recent_fallbacks.extend(fallbacks)

    @property
    def is_paying(self) -> bool:
        """False once a full window of rows took the full head too often."""
        window = self.recent_fallbacks
        return len(window) < WINDOW_ROWS or sum(window) <= MAX_FALLBACK_SHARE * len(window)


CHOICE_SAMPLES = 4
"""Calls each way (screen, full head; the 5-bit and int8 screens) at a number of argmax rows before the fastest is chosen."""
CHOICE_WINDOW = 16
"""The latest calls each way whose median time decides."""
EXPLORE_EVERY = 16
"""Every this many calls at a number of rows, the way not chosen runs once, so its time stays current."""
CLEAR_MARGIN = 1.25
"""A way whose median time is at least this many times the other's is clearly slower: it runs only every
``EXPLORE_EVERY_CLEAR``-th call (a one-row Gemma 3 270M step: the full head 6.9 ms against the screen's 4.5,
so every 16th call cost 0.15 ms a step, 1.5% of it)."""
EXPLORE_EVERY_CLEAR = 128


class ScreenChoice:
    """Which way gives a step's logits fastest (the screen or the full head; where both screens take the
    step, the 5-bit one, the int8 one or the full head), per number of argmax rows, measured in this
    engine's own steps (the head's weights as cold as serving leaves them).

    The screen reads fewer bytes but does more arithmetic per row; which wins depends on the CPU,
    its memory and the row count (Zen 5 VM, session 22, paired steps in one engine: the screen 3-4%
    faster at one row, 10-13% slower at four on gemma3-270m and qwen2.5-coder-0.5b, where an earlier
    Zen 5 host had it faster up to four rows; an Intel Xeon with AMX, session 46, Gemma 3's head at 8
    rows: the 5-bit screen 25.2 ms, the int8 one 16.5, the full head 29.8). Every way gives the same
    token (the screens are exact, and the full head's way gives argmax rows the int16 kernel's logits:
    ``head_logits``), so the choice changes only speed. Until each way has ``CHOICE_SAMPLES`` calls they
    take turns; then the fastest median of the last ``CHOICE_WINDOW`` is taken, and every
    ``EXPLORE_EVERY``-th call another way runs once, in turn (every ``EXPLORE_EVERY_CLEAR``-th where each
    other is ``CLEAR_MARGIN`` times slower)."""

    def __init__(self) -> None:
        self.pinned: bool | None = None
        """True: always the first way offered (the screen), False: the last (the full head) (tests,
        benchmarks); None: measured."""
        self._times: dict[tuple[int, object], deque[float]] = {}
        self._calls: dict[int, int] = {}
        self._ways: dict[int, tuple[object, ...]] = {}

    def pick(self, rows: int, ways: tuple[object, ...]) -> object:
        """The way the next call at ``rows`` argmax rows takes, of ``ways`` (the screen's first, the
        full head last)."""
        if self.pinned is not None:
            return ways[0] if self.pinned else ways[-1]
        self._ways[rows] = ways
        calls = self._calls[rows] = self._calls.get(rows, 0) + 1
        medians = self._medians(rows, ways)
        if medians is None:   # still sampling: the way with fewest calls
            return min(ways, key=lambda way: len(self._times.get((rows, way), ())))
        best = min(range(len(ways)), key=medians.__getitem__)
        others = [index for index in range(len(ways)) if index != best]
        clear = all(medians[index] >= CLEAR_MARGIN * medians[best] for index in others)
        every = EXPLORE_EVERY_CLEAR if clear else EXPLORE_EVERY
        if calls % every:
            return ways[best]
        return ways[others[(calls // every) % len(others)]]

    def _medians(self, rows: int, ways: tuple[object, ...]) -> list[float] | None:
        """Each way's median time at ``rows``; None until each has ``CHOICE_SAMPLES`` calls there."""
        times = [self._times.get((rows, way), ()) for way in ways]
        if any(len(samples) < CHOICE_SAMPLES for samples in times):
            return None
        return [statistics.median(samples) for samples in times]

    def record(self, rows: int, way: object, seconds: float) -> None:
        self._times.setdefault((rows, way), deque(maxlen=CHOICE_WINDOW)).append(seconds)

    def chosen(self) -> dict[int, str]:
        """Rows -> the way now taken there (where every way is measured), for logs and benchmarks."""
        out = {}
        for rows, ways in sorted(self._ways.items()):
            medians = self._medians(rows, ways)
            if medians is not None:
                out[rows] = str(ways[min(range(len(ways)), key=medians.__getitem__)])
        return out

    def forget(self) -> None:
        self._times.clear()
        self._calls.clear()
        self._ways.clear()


FIVE_BITS = "five bits"
FULL_HEAD = "full head"
"""``head_logits``' way without the screen (``ScreenChoice``)."""
INT8 = "int8"
"""The two ways a screen finds a row's candidates: its 5-bit copy (``screen_candidates``) or the int8
GEMM (``I8Screen``)."""
INT8_AMX = "int8 amx"
"""The int8 screen with its GEMM on AMX tiles (``I8Screen.amx``: the same candidates, bit for bit; measured
against the VNNI one by ``ScreenChoice`` like every way, since the tiles pay only from some rows)."""
KERNEL_ONLY = "int16 kernel"
"""No candidates: every argmax row gets the int16 kernel's logits of every token, whose argmax the
screen gives (``head_logits``: the full head's way at a step the screen could take, where the head's own
route there is another kernel, whose logits round differently)."""


def i8_screen_coefficient(hidden: int, levels: int = 127) -> float:
    """The int8 screen's bound coefficient e (gguf_i8gemm.cpp ``i8_screen``): the exact kernel's
    logit lies within e sum_b |d_b| (sum |c_b|) absmax_b of the int8 GEMM's. Per input, the int8
    rounding (absmax / ``levels`` steps: 127, or the AVX2 build's fewer) and the exact kernel's int16
    one (absmax / 32512) each err by at most half a step: 1/254 + 1/65024 of absmax at 127 levels,
    widened by 1e-3 for the float32 roundings of the scales, the reciprocals and the bound's own
    products; and each kernel's float32 sum over the nb = hidden / 32 block terms (each at most
    |d_b| sum |c_b| absmax_b) errs by at most (nb + 5) u of their sum: twice that for the two,
    doubled again."""
    return i8_activation_error(levels) * (1 + 1e-3) + 4 * (hidden // 32 + 5) * 2.0 ** -24


def i8_activation_error(levels: int = 127) -> float:
    """Largest difference, in units of the block's absmax, between an input as the int8 GEMM rounds it
    (to ``levels`` steps each side of zero) and as the exact int16 kernel rounds it."""
    return 0.5 / levels + 0.5 / 32512


BOUND_ROWS = 16384
"""Vocabulary rows per slice when ``I8Screen`` sums its bound factors."""


class I8Screen:
    """The screen for many rows: the int8 GEMM (gguf_i8gemm.cpp ``i8_screen``, or the AVX2 build's) on its
    own copy of the Q8_0 head, its results met by a bound on how far the exact int16 kernel's can be.

    From ~8 rows on, the 5-bit screen is bound by its two VNNI products per 4 inputs and loses to the
    full head; one int8 VNNI product per 4 inputs does the same work at twice the rate. The AVX2 build
    (no VNNI: ``vpmaddubsw``, whose int16 pair sums would saturate on Q8_0's codes against 127 levels)
    rounds the activations to ``gguf_i8gemm.AVX2_SCREEN_LEVELS`` (64) steps instead, which doubles the
    activation term of the bound (``i8_screen_coefficient``): Zen 3, 2 threads, 256 real decode hidden
    states, candidates median 7 / mean 38 on gemma3-270m and 4 / 20 on qwen2.5-coder-0.5b; 32 rows of
    Gemma 3's head in 54 ms against 78 for the full head's float tiles (benchmarks/lm_head_screen.py;
    RESULTS.md "Session 45"). The int8
    activations are not the head's result (generation rows never take int8-rounded activations): they
    only choose the candidates, whose logits come from the exact kernel. The bound is the difference of
    the two activation roundings (``i8_screen_coefficient``) times sum_b |d_b| sum |c_b| absmax_b, taken
    as the least of two rank-one bounds (the vocabulary row's largest or summed block factor times the
    activation row's summed or largest absmax), computed in the GEMM's epilogue; nothing of size
    [rows, vocab] is stored. Real decode hidden states (qwen2.5-coder-0.5b and gemma3-270m, 512 each):
    median 2 candidates, p99 27-37, at most 143-240."""

    def __init__(self, weight: BlockWeight, kernel: ModuleType) -> None:
        self.kernel = kernel
        self.packed = gguf_i8gemm.screen_pack(kernel, weight)
        """The head packed for ``kernel``'s build, with the keyword arguments its ``i8_screen`` takes."""
        self.codes, self.scales, _ = self.packed
        codes = weight.codes
        vocab, hidden = codes.shape
        self.bound_max = torch.empty(vocab)
        """[vocab]: the largest |d_b| sum |c_b| over the row's blocks."""
        self.bound_sum = torch.empty(vocab)
        """[vocab]: their sum."""
        for start in range(0, vocab, BOUND_ROWS):   # in slices: a float64 copy of the head would be 8x its size
            rows = slice(start, start + BOUND_ROWS)
            code_sums = codes[rows].view(-1, hidden // 32, 32).to(torch.int16).abs_().sum(-1, dtype=torch.int32)
            per_block = weight.scales[rows].double().abs() * code_sums   # exact sums, one rounding each
            self.bound_max[rows] = per_block.amax(-1)
            self.bound_sum[rows] = per_block.sum(-1)
        self.coefficient = i8_screen_coefficient(hidden, gguf_i8gemm.activation_levels(self.packed))
        self.vocab = vocab
        permitted = getattr(kernel, "amx_permitted", None)
        self.amx = permitted is not None and bool(permitted())
        """Whether ``candidates`` may run the GEMM on AMX tiles (the VNNI build on a CPU with AMX-INT8)."""

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.scales.nbytes + self.bound_max.nbytes + self.bound_sum.nbytes

    def candidates(self, x: torch.Tensor, max_candidates: int, amx: bool = False) -> list[torch.Tensor]:
        """[counts, then each row's candidate ids], as the 5-bit screen's ``screen_candidates``; ``amx``: the
        GEMM on AMX tiles (where ``self.amx``; the same result)."""
        kwargs = {**self.packed.call_kwargs, **({"amx": True} if amx else {})}
        return self.kernel.i8_screen(x, self.codes, self.scales, self.vocab, self.bound_max, self.bound_sum,
                                     self.coefficient, max_candidates, **kwargs)

    def ways(self) -> tuple[str, ...]:
        """The int8 screen's ways (``head_logits``): its VNNI or AVX2 GEMM, and the AMX one where it runs."""
        return (INT8, INT8_AMX) if self.amx else (INT8,)


class LMHeadScreen:
    """The 5-bit copy of one Q8_0 LM head (and, where the int8 GEMM is built, an ``I8Screen`` for
    many rows) and the exact greedy argmax through them."""

    def __init__(self, weight: BlockWeight, kernel: ModuleType, screen_kernel: ModuleType,
                 max_candidates: int = MAX_CANDIDATES, i8_kernel: ModuleType | None = None) -> None:
        assert weight.block == 32 and weight.offsets is None, "a Q8_0 head"
        self.weight = weight
        self.kernel = kernel
        self.screen_kernel = screen_kernel
        self.max_candidates = max_candidates
        self.code_error = CODE_ERROR + rounding_margin(weight.codes.shape[1])
        """The bound's factor of D: the code error and the float32 rounding margin."""
        self.packed = on_huge_pages(screen_kernel.pack_screen(weight.codes))
        """[ceil(vocab / T), hidden / 32 * T * 20] uint8: the 5-bit codes in tiles of T vocabulary rows
        (T = ``screen_kernel.TILE``: 16 in the AVX-512 build, 8 in the AVX2 one; lm_head_screen.cpp), on huge
        pages (``on_huge_pages``: read whole every step)."""
        self.tiled_scales = screen_kernel.pack_scales(compact_values(weight.scales, None))
        """[ceil(vocab / T), hidden / 32, T]: the Q8_0 scales in the same tiles, fp16 where each is an
        fp16 value (a GGUF's d; half the bytes a step reads), else float32."""
        self.max_rows = MAX_SCREEN_ROWS_AVX2 if getattr(screen_kernel, "ISA", "") == "avx2" else MAX_SCREEN_ROWS
        """Most argmax rows in a step this build takes (``screen_way``; never above
        MAX_SCREEN_ROWS, which benchmarks/step_ab.py sets to 0 to turn the screen off)."""
        self.stats = ScreenStats()
        self.is_enabled = True
        """False once the screen stopped paying for this model (``ScreenStats.is_paying``)."""
        self.choice = ScreenChoice()
        """Screen or full head, per number of argmax rows, by measured time (``head_logits``)."""
        self.i8 = I8Screen(weight, i8_kernel) if i8_kernel is not None else None
        """The screen for more rows than the 5-bit one takes (``screen_way``), or None."""

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes + self.tiled_scales.nbytes + (self.i8.nbytes if self.i8 is not None else 0)

    def forget_rows(self) -> None:
        """Start the statistics afresh, with the screen on. For the start-up warm-up (engine/warmup.py):
        its rows are hidden states of garbage K/V (gemma3-270m: 32 of 32 over the candidate limit,
        ~21k candidates each), half a window of fallbacks that turned the screen off for the server's
        life after a few real rows (issue 16: the served engine ran the full head, the in-process one
        the screen). Its times go too: a warm-up step is colder than serving."""
        self.stats = ScreenStats()
        self.is_enabled = True
        self.choice.forget()

    def bounds(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``hidden [m, K]`` -> (approximate logits, bound) ``[m, vocab]`` each: the full head's
        logit of every row lies within approximate +- bound."""
        approx, factor = self.screen_kernel.screen_logits(hidden.float().contiguous(), self.packed,
                                                          self.tiled_scales, self.weight.codes.shape[0])
        return approx, factor.mul_(self.code_error)

    def exact(self, hidden: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """The full head's logits ``[m, len(rows)]`` of vocabulary ``rows`` only (same kernel)."""
        w = self.weight
        return self.kernel.block_linear_a16(hidden.float().contiguous(), w.codes.index_select(0, rows),
                                            w.scales.index_select(0, rows), None, w.block)

    def logits(self, head: nn.Module, hidden: torch.Tensor, argmax_rows: list[int], way: str = FIVE_BITS,
               tokens: dict[int, int] | None = None) -> torch.Tensor:
        """float32 logits ``[n, vocab]`` for ``hidden [n, K]``. An ``argmax_rows`` row holds only its
        candidates' exact logits (``-inf`` elsewhere), whose argmax is that of the head's int16
        kernel on the row (a row over the candidate limit: that kernel's logits of every token);
        the other rows get the full head's logits of those rows alone (``head`` on them). ``way``:
        the candidates from the 5-bit copy (FIVE_BITS) or the int8 GEMM (INT8, ``self.i8``; INT8_AMX on AMX tiles).
        ``tokens`` (when given) receives, for each screened row that kept its candidates, that
        argmax: ``tokens[row] == int(logits[row].argmax())`` (ties to the lowest id)."""
        n = hidden.shape[0]
        vocab = self.weight.codes.shape[0]
        screened_set = set(argmax_rows)
        screened = sorted(screened_set)
        assert screened and screened[-1] < n, "argmax rows index the logits rows"
        # every row (one decode row): hidden itself where it is already the kernel's float32 rows
        x = hidden if len(screened) == n and hidden.dtype == torch.float32 and hidden.is_contiguous() \
            else hidden[screened].float().contiguous()
        if way == KERNEL_ONLY:
            out = torch.empty((n, vocab), dtype=torch.float32)
            return self._unscreened(out, head, hidden, x, screened, list(range(len(screened))))
        if way in (INT8, INT8_AMX):
            assert self.i8 is not None, "the int8 screen is built"
            counts_tensor, *row_candidates = self.i8.candidates(x, self.max_candidates, amx=way == INT8_AMX)
        else:
            counts_tensor, *row_candidates = self.screen_kernel.screen_candidates(
                x, self.packed, self.tiled_scales, vocab, self.code_error, self.max_candidates)
        counts: list[int] = counts_tensor.tolist()
        out = torch.full((n, vocab), float("-inf"), dtype=torch.float32)
        if n == 1 and 0 < counts[0] <= self.max_candidates:
            # one decode row (the one-stream step): its candidates are already ascending and unique,
            # so they index the logits directly (the union, repeat and search below cost ~0.5 ms)
            ids = row_candidates[0]
            values = self.exact(x, ids)[0]
            out[0].index_copy_(0, ids, values)
            if tokens is not None:   # torch.argmax's first largest; a NaN row is left to the sampler
                best = int(values.argmax())
                if values[best] == values[best]:
                    tokens[0] = int(ids[best])
            self.stats.record(counts, [False])
            return out
        # no candidates: a row with a value that is not finite (the kernel's count 0)
        fallbacks = [count > self.max_candidates or count == 0 for count in counts]
        kept = [position for position, fallback in enumerate(fallbacks) if not fallback]
        if kept:   # the exact logits of every kept row's candidates, in one call on their union
            ids = [row_candidates[position] for position in kept]
            flat = torch.cat(ids)
            union = torch.unique(flat)
            index = torch.tensor(kept)
            exact = self.exact(x.index_select(0, index).contiguous(), union)
            at_row = torch.repeat_interleave(torch.arange(len(kept)), torch.tensor([len(i) for i in ids]))
            values = exact[at_row, torch.searchsorted(union, flat)]
            out[torch.tensor(screened)[index][at_row], flat] = values
            if tokens is not None:
                _first_largest(tokens, [screened[position] for position in kept], flat, values, at_row)
        self.stats.record(counts, fallbacks)
        if self.is_enabled and not self.stats.is_paying:
            self.is_enabled = False
            logger.warning("LM-head screen: off from now on: %d of the last %d greedy rows had more than %d "
                           "candidates (the bound is too loose for this model's hidden states), so they "
                           "paid for the screen and the full head", sum(self.stats.recent_fallbacks),
                           len(self.stats.recent_fallbacks), self.max_candidates)
        return self._unscreened(out, head, hidden, x, screened,
                                [position for position, fallback in enumerate(fallbacks) if fallback])

    def _unscreened(self, out: torch.Tensor, head: nn.Module, hidden: torch.Tensor, x: torch.Tensor,
                    screened: list[int], fallen: list[int]) -> torch.Tensor:
        """``out`` with the int16 kernel's logits of every token in the rows ``screened[fallen]``
        (``x``'s rows ``fallen``) and the full head's in the rows that are not argmax rows."""
        if fallen:   # the int16 kernel on every token: the same argmax the screen would give
            w = self.weight
            index = torch.tensor(fallen)
            out[torch.tensor(screened)[index]] = self.kernel.block_linear_a16(
                x.index_select(0, index).contiguous(), w.codes, w.scales, None, w.block)
        screened_set = set(screened)
        full_rows = [i for i in range(hidden.shape[0]) if i not in screened_set]
        if full_rows:
            index = torch.tensor(full_rows)
            out[index] = head(hidden.index_select(0, index)).float()
        return out


def build_screen(model: nn.Module, activations: str | None, *, disabled: bool, tp_size: int,
                 pp_size: int, device: torch.device) -> tuple[LMHeadScreen | None, str]:
    """The screen for ``model``'s LM head where it is exact and pays, else None; and why."""
    if disabled:
        return None, "off (--disable-lm-head-screen)"
    head = getattr(model, "lm_head", None)
    method = getattr(head, "linear_method", None)
    weight: BlockWeight | None = getattr(head, "gguf_weight", None)
    if tp_size > 1 or pp_size > 1:
        return None, "off (tensor or pipeline parallel: the head is sharded or on another stage)"
    if device.type != "cpu" or weight is None or method is None or getattr(method, "name", "") != "gguf":
        return None, "off (the LM head is not a GGUF block weight on CPU)"
    routes = getattr(head, "gguf_routes", None)
    if activations != "int16" or routes is None or Route.BLOCK not in routes.held:
        return None, "off (the head does not run the int16 block kernel: --quantization gguf only)"
    if weight.block != 32 or weight.offsets is not None or int(weight.codes.min()) < -127:
        return None, "off (the LM head is not Q8_0)"
    if getattr(head, "final_softcap", None) is not None:
        return None, "off (logit softcapping could tie rows the screen separates)"
    if weight.codes.shape[1] % 32:
        return None, "off (hidden size not a multiple of 32)"
    kernel = getattr(method, "kernel", None)
    if kernel is None:
        return None, "off (the head has no block kernel)"
    build = screen_build()
    screen_kernel = build.load()
    if screen_kernel is None:
        return None, f"off ({build.description}: {build.status()})"
    i8_kernel = gguf_i8gemm.load_gemm()
    screen = LMHeadScreen(weight, kernel, screen_kernel, i8_kernel=i8_kernel)
    many = (f"for more greedy rows than that copy takes, an int8 GEMM on a copy of the head finds them "
            f"({gguf_i8gemm.GEMM_BUILDS.first().description})"
            if screen.i8 is not None else f"no screen above {min(screen.max_rows, MAX_SCREEN_ROWS)} greedy rows "
            f"(the int8 GEMM: {gguf_i8gemm.gemm_status()})")
    return screen, (f"on ({build.description}): greedy rows read a 5-bit copy of the Q8_0 head and compute "
                    f"exactly only the rows that can be the argmax ({many}; {screen.nbytes / 2 ** 20:.0f} MiB); "
                    "--disable-lm-head-screen turns it off")


MAX_SCREEN_ROWS = HEAD_SCREEN_ROWS
"""Most argmax rows in a step the screen takes (benchmarks/lm_head_screen.py, gemma3-270m, 1 thread,
thread clock, row-blocked kernel; benchmarks/RESULTS.md "The LM head's screen for many rows"): it
reads the 5-bit copy once per call, so it takes 4.9 ms at one row against the full head's 9.1 and
16.7 against 27.6 at eight; from ~4 rows on it is bound by arithmetic (two VNNI products per 64
inputs, as many as the int16 kernel) at ~1.5 ms a row, and at 32 rows (53 ms) it loses to the
dense bf16 GEMM the head runs above its kernel's 16 rows (41 ms). The head's own limit
(``MAX_SCREEN_ROWS``) caps the step's logits rows as well, and the head's route for them must be a row-by-row kernel."""

MAX_SCREEN_ROWS_AVX2 = 3
"""``MAX_SCREEN_ROWS`` of the AVX2 build (no VNNI: two vpmaddubsw per 4 inputs and row against the
int16 kernel's one vpmaddwd per 2, so more rows are bound by arithmetic sooner). Zen 3 VM, 1 thread,
thread clock, load ~5 (shared machine), qwen2.5-coder-0.5b's real Q8_0 head (151,936 x 896) on real
decode hidden states, ``logits`` (the candidates pass and the exact rescoring) against the full
head's int16 kernel, interleaved, medians of 15: 11.9 / 16.6 / 23.9 / 30.9 ms at 1 / 2 / 3 / 4 rows
against 24.1 / 19.2 / 26.6 / 32.5 (an earlier run of 9: 12.2 / 15.4 / 21.4 / 29.2 against 25.9 /
17.6 / 25.5 / 30.5). Four rows gain ~5%, within what a quiet two-thread run could reverse: three.
(Session 19, a random head, no rescoring: 10.4 / 16.5 / 25.7 / 29.5 against 16.2 / 19.4 / 23.3 / 28.6.)"""

MAX_SCREEN_ROWS_GEMM = 4
"""The same limit for a head that runs the rows kernel's GEMM (gguf_rows.rows_gemm: a bf16 model, a
CPU with AVX512-BF16; its ``rows`` route), never above ``MAX_SCREEN_ROWS``. Same benchmark (noisy,
shared machine; benchmarks/RESULTS.md "A GEMM micro-kernel for 1-48 rows"): the screen takes 4.9 ms
at one row, 5.0 at two, 6.1 at four and 13.3 at eight; the GEMM head 7.0-7.9 ms from one to eight
rows (bound by reading its 1-byte codes) and 14.6 at sixteen, against the screen's 28.3."""


def setup_screen(model: nn.Module, disabled: bool, parallel: object, device: torch.device,
                 task: str) -> LMHeadScreen | None:
    """The runner's screen (``build_screen``), with its decision logged where the head is GGUF."""
    if task != "generate":
        return None
    head = getattr(model, "lm_head", None)
    method = getattr(head, "linear_method", None)
    screen, reason = build_screen(model, getattr(method, "activations", None), disabled=disabled,
                                  tp_size=getattr(parallel, "tp_size", 1), pp_size=getattr(parallel, "pp_size", 1),
                                  device=device)
    if getattr(head, "gguf_weight", None) is not None or screen is not None:
        logger.info("LM-head screen %s", reason)
    return screen


MAX_I8_SCREEN_ROWS = 512
"""Most argmax rows in a step the int8 screen takes (its per-row state grows with them)."""


def screen_way(screen: LMHeadScreen | None, model: nn.Module, hidden: torch.Tensor,
               argmax_rows: list[int]) -> str | None:
    """How the screen takes the step, or None where it does not suit the step:

    - FIVE_BITS: some argmax rows, at most ``screen.max_rows`` (and MAX_SCREEN_ROWS) of them, and no
      more logits rows than the head's kernel takes (above, the full head runs its dense GEMM, whose
      logits round differently: the screen's argmax is the int16 kernel's, and the rows split off must
      be the rows the full head gives);
    - INT8 (``screen.i8``, more argmax rows, up to MAX_I8_SCREEN_ROWS): every logits row an argmax
      row, or the rows split off take the same row-by-row route alone as the full head takes with all
      rows (their logits are then those the full head gives them).
    Either way an argmax row's token is the int16 kernel's argmax."""
    if (screen is None or not screen.is_enabled or not argmax_rows or hidden.device.type != "cpu"
            or MAX_SCREEN_ROWS == 0):
        return None
    routes = model.lm_head.gguf_routes
    bf16 = hidden.dtype == torch.bfloat16
    count, rows = len(argmax_rows), hidden.shape[0]
    # the full head's route for these rows (its logits rows are generation rows)
    route = routes.pick(rows, bf16, False)
    five_bit_rows = min(screen.max_rows, MAX_SCREEN_ROWS, MAX_SCREEN_ROWS_GEMM if route is Route.ROWS else rows)
    if route in (Route.BLOCK, Route.ROWS) and rows <= MAX_SCREEN_ROWS and count <= five_bit_rows:
        return FIVE_BITS
    return INT8 if int8_screen_suits(screen, model, hidden, argmax_rows) else None


def int8_screen_suits(screen: LMHeadScreen, model: nn.Module, hidden: torch.Tensor, argmax_rows: list[int]) -> bool:
    """Whether the int8 screen (``screen.i8``) can take the step (``screen_way``'s INT8; a step the 5-bit
    screen takes may suit it too: ``head_logits`` then measures both)."""
    routes = model.lm_head.gguf_routes
    bf16 = hidden.dtype == torch.bfloat16
    count, rows = len(argmax_rows), hidden.shape[0]
    route = routes.pick(rows, bf16, False)
    return screen.i8 is not None and count <= MAX_I8_SCREEN_ROWS and (
        count == rows or (route in ROW_INDEPENDENT and routes.pick(rows - count, bf16, False) is route))


def _first_largest(tokens: dict[int, int], rows: list[int], ids: torch.Tensor, values: torch.Tensor,
                   at_row: torch.Tensor) -> None:
    """tokens[rows[r]] = the lowest of ``ids`` whose ``values`` entry is its row's largest, where
    ``at_row`` gives each entry's row r (``torch.argmax``'s answer on the logits row: ties to the
    lowest id); a row whose largest value is NaN gets none (the sampler searches its row)."""
    largest = torch.full((len(rows),), float("-inf")).scatter_reduce(0, at_row, values, "amax")
    reached = values == largest[at_row]
    lowest = torch.full((len(rows),), torch.iinfo(torch.int64).max).scatter_reduce(
        0, at_row[reached], ids[reached], "amin")
    for row, token, top in zip(rows, lowest.tolist(), largest.tolist()):
        if top == top and token != torch.iinfo(torch.int64).max:   # not NaN, and some entry reached it
            tokens[row] = token


def head_logits(screen: LMHeadScreen | None, model: nn.Module, rows: torch.Tensor, argmax_rows: list[int],
                head_rows: object, tokens: dict[int, int] | None = None) -> torch.Tensor:
    """The step's float32 logits of ``rows``: through the screen where it applies
    (``screen_way``) and ``screen.choice`` finds it the faster way at this many argmax
    rows, else the full head (``model.compute_logits``), whose argmax rows get the int16 kernel's
    logits (``KERNEL_ONLY``) where the head's own route at this many rows is another kernel (the rows
    kernel, the dense copy: they round differently, and a near tie could then go the other way). Either
    way a greedy row's argmax is the same token, so the measured choice changes only speed; ``tokens``
    (when given) receives it for the rows the screen took (``LMHeadScreen.logits``)."""
    def full() -> torch.Tensor:
        return model.compute_logits(rows, head_rows).float()

    way = screen_way(screen, model, rows, argmax_rows)
    if screen is None or way is None:
        return full()
    count = len(argmax_rows)
    # where both screens take the step, every way of both is measured (the same token either way)
    if way == FIVE_BITS:
        int8_ways = screen.i8.ways() if int8_screen_suits(screen, model, rows, argmax_rows) else ()  # type: ignore[union-attr]
        ways: tuple[str, ...] = (FIVE_BITS, *int8_ways, FULL_HEAD)
    else:
        ways = (*screen.i8.ways(), FULL_HEAD)  # type: ignore[union-attr]
    taken = screen.choice.pick(count, ways)
    start = time.perf_counter()
    if taken != FULL_HEAD:
        logits = screen.logits(model.lm_head, rows, argmax_rows, taken, tokens)
    elif model.lm_head.gguf_routes.pick(rows.shape[0], rows.dtype == torch.bfloat16, False) is Route.BLOCK:
        logits = full()
    else:   # the head's route rounds differently: its argmax may not be the screen's, in a near tie
        logits = screen.logits(model.lm_head, rows, argmax_rows, KERNEL_ONLY)
    screen.choice.record(count, taken, time.perf_counter() - start)
    return logits
