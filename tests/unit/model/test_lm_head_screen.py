"""The greedy LM-head screen (servelm/model/gguf/lm_head_screen.py) is exact.

Kernel level, on random Q8_0 heads: the bound holds for every row and vector (random and
adversarial ones, whose signs follow the screen's rounding error); a row's exact logit is
bit-identical whether computed in the full head or in a gathered subset; the screened argmax is
the full head's, ties included; rows over the candidate limit take the full head; rows that are not
argmax rows get the full head's logits. Engine level, on the packaged Q8_0-headed models: greedy
tokens with the screen equal those without it, and a mixed batch (greedy, seeded sampling,
logprobs) gives the same tokens and logprobs either way.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest
import torch

from servelm.config import EngineConfig
from servelm.distributed.parallel import ParallelContext
from servelm.engine.engine import LLMEngine
from servelm.model.layers.embedding import LMHead
from servelm.model.gguf.gguf_blocks import BlockWeight
from servelm.model.gguf import gguf_kernel
from servelm.model.gguf.gguf_linear import GGUFBlockLinearMethod
from servelm.engine.executor import argmax_rows
from servelm.engine.request import Request
from servelm.engine.scheduler import ScheduledRequest, SchedulerOutput
from servelm.model.eagle_checkpoint import main as write_head
from servelm.model.gguf import gguf_i8gemm, lm_head_screen
from servelm.model.gguf.gguf_routes import Route
from servelm.model.gguf.lm_head_screen import (CHOICE_SAMPLES, CHOICE_WINDOW, CLEAR_MARGIN, EXPLORE_EVERY,
                                               EXPLORE_EVERY_CLEAR, FIVE_BITS, INT8, KERNEL_ONLY, WINDOW_ROWS,
                                               LMHeadScreen, ScreenChoice, build_screen, head_logits,
                                               i8_screen_coefficient,
                                               screen_build, screen_way)
from servelm.sampling.params import SamplingParams

BUILDS = [pytest.param((block, screen), id=f"{block.name}+{screen.name}") for block, screen in
          [(gguf_kernel.KERNEL, lm_head_screen.KERNEL), (gguf_kernel.AVX2_KERNEL, lm_head_screen.AVX2_KERNEL),
           (gguf_kernel.AVX2_KERNEL, lm_head_screen.KERNEL)]
          if not screen.missing_cpu_flags() and not block.missing_cpu_flags()]
"""Every build pair (the head's block kernel, the screen beside it) this CPU runs: on an AVX-512
machine the AVX2 pair is forced too, as on an AVX2-only one it is the one that runs, and the
AVX-512 screen beside the AVX2 block kernel (where block_builds.py measures that build faster)."""
Kernels = tuple[ModuleType, ModuleType]

pytestmark = pytest.mark.skipif(not BUILDS, reason="needs AVX2+FMA or AVX512-VNNI")


@pytest.fixture(params=BUILDS)
def kernels(request: pytest.FixtureRequest) -> Kernels:
    block, screen = request.param
    block_module, screen_module = block.load(), screen.load()
    if block_module is None or screen_module is None:
        pytest.skip(f"{block.status()}; {screen.status()}")
    return block_module, screen_module


def q8_head(kernels: Kernels, vocab: int, hidden: int, seed: int = 0) -> tuple[LMHead, BlockWeight]:
    generator = torch.Generator().manual_seed(seed)
    codes = torch.randint(-127, 128, (vocab, hidden), dtype=torch.int8, generator=generator)
    scales = torch.rand(vocab, hidden // 32, generator=generator) * 0.02 + 1e-4
    weight = BlockWeight(codes, scales, None, 32, "Q8_0")
    head = LMHead(vocab, hidden)
    GGUFBlockLinearMethod(kernels[0], torch.float32).process(head, weight, float_output=True)
    return head, weight


def screen_for(kernels: Kernels, weight: BlockWeight, max_candidates: int = 4096) -> LMHeadScreen:
    """The screen on ``weight``, with the int8 screen where this CPU builds the int8 GEMM (VNNI, else AVX2)."""
    return LMHeadScreen(weight, kernels[0], kernels[1], max_candidates, i8_kernel=gguf_i8gemm.load_gemm())


needs_i8 = pytest.mark.skipif(bool(gguf_i8gemm.gemm_missing_flags()), reason="the int8 screen needs AVX2+FMA or VNNI")


def test_bound_holds_for_random_and_adversarial_vectors(kernels: Kernels) -> None:
    head, weight = q8_head(kernels, 3000, 256)
    screen = screen_for(kernels, weight)
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(24, 256, generator=generator) * torch.rand(24, 256, generator=generator).pow(4) * 50
    # adversarial: each vector's signs follow one row's screen error (c - c'), every input near full size
    codes = weight.codes[:8].int()
    error = codes - (8 * (codes >> 3) + 3.5)
    adversarial = torch.sign(error) * torch.rand(8, 256, generator=generator).add(0.9)
    x = torch.cat([x, adversarial, torch.zeros(1, 256)])
    exact = head(x)
    approx, bound = screen.bounds(x)
    assert ((exact - approx).abs() <= bound).all()
    # the adversarial rows come close to the bound: it is tight, not a loose guess
    ratio = (exact[24:32].diagonal() - approx[24:32].diagonal()).abs() / bound[24:32].diagonal()
    assert ratio.min() > 0.5


def test_the_bound_is_tight_cut_by_one_percent_it_loses_the_argmax(kernels: Kernels) -> None:
    """Token 0's codes all 7 (its screen code 3.5 below), token 1's all 8 (3.5 above), token 1's
    scale a hair under 7/8 of token 0's: token 0 wins by 1e-4 of its logit, the screen's
    approximations rank them the other way by ~6.5 D, and only a code error of (nearly) 3.5 keeps
    token 0 a candidate."""
    hidden, vocab = 128, 37
    codes = torch.zeros(vocab, hidden, dtype=torch.int8)
    codes[0], codes[1] = 7, 8
    scales = torch.full((vocab, hidden // 32), 0.01)
    scales[1] = 0.01 * 7 / 8 * (1 - 1e-4)
    weight = BlockWeight(codes, scales, None, 32, "Q8_0")
    head = LMHead(vocab, hidden)
    GGUFBlockLinearMethod(kernels[0], torch.float32).process(head, weight, float_output=True)
    screen = screen_for(kernels, weight)
    x = torch.ones(1, hidden)
    assert head(x).argmax() == 0
    assert screen.logits(head, x, [0]).argmax() == 0
    screen.code_error = 0.99 * lm_head_screen.CODE_ERROR
    assert screen.logits(head, x, [0]).argmax() == 1   # a cut bound drops the true argmax


def test_a_gathered_row_is_bit_identical_to_the_full_head(kernels: Kernels) -> None:
    head, weight = q8_head(kernels, 500, 128)
    screen = screen_for(kernels, weight)
    x = torch.randn(7, 128)
    full = head(x)   # 7 rows: the kernel's tiles of 4 and 3
    rows = torch.tensor([0, 3, 77, 250, 499])
    for m in range(1, 8):
        assert torch.equal(screen.exact(x[:m], rows), full[:m, rows])


def test_screened_argmax_is_the_full_heads_with_ties_to_the_lowest_id(kernels: Kernels) -> None:
    head, weight = q8_head(kernels, 2000, 128, seed=2)
    # an exact tie: token 1500 is token 900's row repeated; a near-tie: token 901 is 900 with one code moved
    weight.codes[1500] = weight.codes[900]
    weight.scales[1500] = weight.scales[900]
    weight.codes[901] = weight.codes[900]
    weight.scales[901] = weight.scales[900]
    weight.codes[901, 5] += 1 if weight.codes[901, 5] < 127 else -1
    screen = screen_for(kernels, weight)
    row900 = weight.dequantize()[900]
    x = torch.cat([torch.randn(5, 128), (row900 * 40).unsqueeze(0), (row900 * 40 + 0.01).unsqueeze(0)])
    full = head(x)
    logits = screen.logits(head, x, list(range(len(x))))
    assert torch.equal(logits.argmax(-1), full.argmax(-1))
    assert logits[5].argmax() in (900, 901)
    assert full[5, 1500] == full[5, 900]   # the tie is real; the screen kept both, argmax took 900
    finite = torch.isfinite(logits)
    assert torch.equal(logits[finite], full[finite])   # candidates carry the full head's logits
    assert screen.stats.rows == len(x) and screen.stats.fallbacks == 0
    # one row alone (the one-stream step's own path) gives what it gets among the others, both ways;
    # the argmax the screen hands the sampler (``tokens``) is torch.argmax's on each row, ties included
    for way in (FIVE_BITS, INT8) if screen.i8 is not None else (FIVE_BITS,):
        tokens: dict[int, int] = {}
        many = screen.logits(head, x, list(range(len(x))), way, tokens)
        assert tokens == {i: int(full[i].argmax()) for i in range(len(x))} and tokens[5] == 900
        for i in range(len(x)):
            alone: dict[int, int] = {}
            assert torch.equal(screen.logits(head, x[i:i + 1], [0], way, alone), many[i:i + 1])
            assert alone == {0: tokens[i]}
        # only the screened rows get one, under their own row numbers
        some: dict[int, int] = {}
        screen.logits(head, x, [1, 5, 6], way, some)
        assert some == {1: tokens[1], 5: 900, 6: tokens[6]}
    assert screen.stats.fallbacks == 0


def test_too_many_candidates_fall_back_to_the_full_head(kernels: Kernels) -> None:
    head, weight = q8_head(kernels, 1000, 128, seed=3)
    screen = screen_for(kernels, weight, max_candidates=0)   # every row has at least one candidate
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(0))
    tokens: dict[int, int] = {}
    logits = screen.logits(head, x, [0, 2], tokens=tokens)
    assert torch.equal(logits, head(x))
    assert tokens == {}   # a row that fell back is searched by the sampler as before
    assert screen.stats.fallbacks == 2
    # a model whose rows keep falling back turns the screen off (after a full window of rows)
    while screen.is_enabled:
        screen.logits(head, x, [0, 1, 2])
    assert screen.stats.rows >= WINDOW_ROWS


def test_a_row_that_is_not_finite_takes_the_full_head(kernels: Kernels) -> None:
    head, weight = q8_head(kernels, 1000, 128, seed=5)
    screen = screen_for(kernels, weight)
    x = torch.randn(4, 128, generator=torch.Generator().manual_seed(1))
    x[1, 7], x[2, 100] = float("nan"), float("inf")
    counts, *_ = kernels[1].screen_candidates(x, screen.packed, screen.tiled_scales, 1000, screen.code_error, 4096)
    assert counts[0] > 0 and counts[1] == 0 and counts[2] == 0 and counts[3] > 0   # no bound, no candidates
    logits = screen.logits(head, x, [0, 1, 2, 3])
    full = head(x)
    torch.testing.assert_close(logits[1:3], full[1:3], rtol=0, atol=0, equal_nan=True)   # the full head's rows
    assert torch.equal(logits[[0, 3]].argmax(-1), full[[0, 3]].argmax(-1))
    assert screen.stats.fallbacks == 2


def test_rows_that_are_not_argmax_rows_get_the_full_head(kernels: Kernels) -> None:
    head, weight = q8_head(kernels, 1000, 128, seed=4)
    screen = screen_for(kernels, weight)
    x = torch.randn(4, 128)
    logits = screen.logits(head, x, [1, 3])
    full = head(x)
    assert torch.equal(logits[[0, 2]], full[[0, 2]])
    assert torch.isinf(logits[[1, 3]]).sum() > 0


def test_the_full_heads_way_gives_argmax_rows_the_int16_kernels_logits(kernels: Kernels,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Where a step could take the screen and the choice takes the full head, an argmax row gets the
    int16 kernel's logits of every token (the screen's argmax is that kernel's) when the head's own
    route at that many rows is another kernel (here its dense copy, whose logits round differently),
    and the head's own logits when that route is the int16 kernel; other rows the head's either way."""
    head, weight = q8_head(kernels, 1000, 128, seed=6)
    screen = screen_for(kernels, weight)
    x = near_tie_rows(weight, 4, seed=3)
    block = screen.kernel.block_linear_a16(x, weight.codes, weight.scales, None, 32)
    only = screen.logits(head, x, [1, 3], KERNEL_ONLY)
    assert torch.equal(only[[1, 3]], block[[1, 3]]) and torch.equal(only[[0, 2]], head(x)[[0, 2]])
    routes = head.gguf_routes
    head.gguf_dense = weight.codes.float() * weight.scales.repeat_interleave(32, 1)
    model = SimpleNamespace(lm_head=head, compute_logits=lambda rows, _: head(rows))
    monkeypatch.setattr(lm_head_screen, "screen_way", lambda *_: FIVE_BITS)
    screen.choice.pinned = False
    for route in (Route.BLOCK, Route.DENSE):
        by_rows = tuple(tuple(tuple(route for _ in side) for side in sides) for sides in routes.by_rows)
        head.gguf_routes = dataclasses.replace(routes, by_rows=by_rows, held=routes.held | {route})
        logits = head_logits(screen, model, x, [1, 3], None)
        assert torch.equal(logits[[0, 2]], head(x)[[0, 2]])
        assert torch.equal(logits[[1, 3]], block[[1, 3]] if route is Route.DENSE else head(x)[[1, 3]])
    assert not torch.equal(head(x), block)   # the dense copy's logits are not the int16 kernel's


def test_built_only_where_exact(kernels: Kernels) -> None:
    head, weight = q8_head(kernels, 100, 128)
    model = torch.nn.Module()
    model.lm_head = head
    cpu = torch.device("cpu")
    screen, reason = build_screen(model, "int16", disabled=False, tp_size=1, pp_size=1, device=cpu)
    # the CPU's best screen build whatever the head's block kernel's build, named in the log line
    assert screen is not None and screen.screen_kernel is screen_build().load()
    assert screen_build().description in reason
    assert screen_build() is lm_head_screen.KERNELS[0 if not lm_head_screen.KERNEL.missing_cpu_flags() else 1]
    assert "disable-lm-head-screen" in build_screen(model, "int16", disabled=True, tp_size=1, pp_size=1,
                                                    device=cpu)[1]
    assert build_screen(model, "int16", disabled=False, tp_size=2, pp_size=1, device=cpu)[0] is None
    assert build_screen(model, "int8", disabled=False, tp_size=1, pp_size=1, device=cpu)[0] is None
    head.final_softcap = 30.0
    assert build_screen(model, "int16", disabled=False, tp_size=1, pp_size=1, device=cpu)[0] is None
    head.final_softcap = None
    head.gguf_weight = BlockWeight(weight.codes, weight.scales.repeat_interleave(2, 1), None, 16, "Q6_K")
    assert build_screen(model, "int16", disabled=False, tp_size=1, pp_size=1, device=cpu)[0] is None
    assert ParallelContext.single().tp_size == 1


def near_tie_rows(weight: BlockWeight, m: int, seed: int) -> torch.Tensor:
    """``m`` activation rows of which every third is random, the others point along a vocabulary row
    (near-ties with its neighbours) or follow the signs of one row's screen error (adversarial)."""
    generator = torch.Generator().manual_seed(seed)
    hidden = weight.codes.shape[1]
    dense = weight.dequantize()
    codes = weight.codes.int()
    rows = []
    for i in range(m):
        token = int(torch.randint(0, weight.codes.shape[0], (1,), generator=generator))
        if i % 3 == 0:
            rows.append(torch.randn(hidden, generator=generator) * 3)
        elif i % 3 == 1:
            rows.append(dense[token] * 40 + torch.randn(hidden, generator=generator) * 0.01)
        else:
            error = codes[token] - (8 * (codes[token] >> 3) + 3.5)
            rows.append(torch.sign(error) * torch.rand(hidden, generator=generator).add(0.9))
    return torch.stack(rows)


def tie_case(kernels: Kernels, m: int, seed: int) -> tuple[LMHead, BlockWeight, LMHeadScreen, torch.Tensor,
                                                            torch.Tensor]:
    """A 2,999-token head where tokens 900 and 1500 tie exactly, ``m`` near-tie rows whose first points
    along token 900, the screen, and the int16 kernel's logits of the rows."""
    head, weight = q8_head(kernels, 2999, 192, seed=seed)
    weight.codes[1500] = weight.codes[900]   # an exact tie between two tokens
    weight.scales[1500] = weight.scales[900]
    screen = screen_for(kernels, weight)
    x = near_tie_rows(weight, m, seed=m)
    x[0] = weight.dequantize()[900] * 40
    return head, weight, screen, x, screen.kernel.block_linear_a16(x, weight.codes, weight.scales, None, 32)


@pytest.mark.parametrize("m", [1, 3, 4, 5, 8, 13, 16, 33])
def test_many_rows_screened_at_once_give_each_rows_exact_argmax(kernels: Kernels, m: int) -> None:
    """The row-blocked kernel (register blocks of 4 rows, a vocabulary not a multiple of its tiles
    of 16): each row's argmax is the int16 kernel's on that row, and its candidates carry that
    kernel's logits."""
    head, weight, screen, x, full = tie_case(kernels, m, seed=10 + m)
    logits = screen.logits(head, x, list(range(m)))
    assert torch.equal(logits.argmax(-1), full.argmax(-1))
    assert logits[0].argmax() == 900 and full[0, 1500] == full[0, 900]
    finite = torch.isfinite(logits)
    assert torch.equal(logits[finite], full[finite])
    approx, bound = screen.bounds(x)
    assert ((full - approx).abs() <= bound).all()


def test_candidates_do_not_depend_on_the_rows_beside_them_or_the_threads(kernels: Kernels) -> None:
    head, weight = q8_head(kernels, 5003, 256, seed=6)
    screen = screen_for(kernels, weight)
    x = near_tie_rows(weight, 11, seed=3)
    kernel = screen.screen_kernel
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        together = kernel.screen_candidates(x, screen.packed, screen.tiled_scales, 5003, 3.505, 4096)
        alone = [kernel.screen_candidates(x[i:i + 1].contiguous(), screen.packed, screen.tiled_scales, 5003,
                                          3.505, 4096) for i in range(11)]
        torch.set_num_threads(2)
        parallel = kernel.screen_candidates(x, screen.packed, screen.tiled_scales, 5003, 3.505, 4096)
    finally:
        torch.set_num_threads(threads)
    for i in range(11):
        assert torch.equal(together[i + 1], alone[i][1]) and torch.equal(together[i + 1], parallel[i + 1])
    assert torch.equal(together[0], parallel[0])


def test_fp16_scales_give_the_float32_scales_bounds_bit_for_bit(kernels: Kernels) -> None:
    """A head whose scales are fp16 values (a GGUF's d) keeps them tiled as fp16 (half the bytes), and
    the screen's S and D and candidates are those of the same scales tiled as float32."""
    head, weight = q8_head(kernels, 1003, 256, seed=8)
    weight.scales.copy_(weight.scales.half().float())
    screen = screen_for(kernels, weight)
    assert screen.tiled_scales.dtype == torch.float16
    as_float32 = screen.screen_kernel.pack_scales(weight.scales)
    assert as_float32.dtype == torch.float32 and torch.equal(as_float32, screen.tiled_scales.float())
    x = near_tie_rows(weight, 5, seed=2)
    kernel = screen.screen_kernel
    for compact, full in zip(kernel.screen_logits(x, screen.packed, screen.tiled_scales, 1003),
                             kernel.screen_logits(x, screen.packed, as_float32, 1003)):
        assert torch.equal(compact, full)
    for compact, full in zip(kernel.screen_candidates(x, screen.packed, screen.tiled_scales, 1003, 3.505, 4096),
                             kernel.screen_candidates(x, screen.packed, as_float32, 1003, 3.505, 4096)):
        assert torch.equal(compact, full)


def scheduled(request_id: str, params: SamplingParams, drafts: list[int], num_logits: int | None = None,
              prompt_logprob_rows: int = 0) -> ScheduledRequest:
    request = Request(request_id, [1, 2, 3], params, [0], 100, output_token_ids=[5])
    return ScheduledRequest(request, 1 + len(drafts), num_logits or 1 + len(drafts), True, prompt_logprob_rows,
                            draft_token_ids=drafts)


def test_a_greedy_requests_draft_rows_are_argmax_rows() -> None:
    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    output = SchedulerOutput(scheduled=[
        scheduled("a", greedy, [7, 8, 9]),                                           # rows 0-3
        scheduled("b", SamplingParams(temperature=0.7, seed=1, max_tokens=8), [7]),  # rows 4-5
        scheduled("c", greedy, []),                                                  # row 6
        scheduled("d", SamplingParams(temperature=0.0, logprobs=1, max_tokens=8), [4, 4]),   # rows 7-9
        scheduled("e", greedy, [3, 3], num_logits=5, prompt_logprob_rows=2),          # rows 10-14
        scheduled("f", SamplingParams(temperature=0.0, min_tokens=3, max_tokens=8), [2]),   # rows 15-16
        scheduled("g", greedy, [1, 2]),                                              # rows 17-19
    ])
    assert argmax_rows(output) == [0, 1, 2, 3, 6, 17, 18, 19]


# -- engine level, on the packaged models -------------------------------------------------------

PROMPTS = ["def fibonacci(n):", "The capital of France is", "Once upon a time, in a land far away,"]


# SmolLM2's 49k-row head in the default run (its engine loads in seconds); Gemma 3's 262k rows and
# the default model's head with -m slow
@pytest.fixture(scope="module", params=["smollm2-135m", pytest.param("gemma3-270m", marks=pytest.mark.slow),
                                        pytest.param("qwen2.5-coder-0.5b", marks=pytest.mark.slow)])
def engine(request: pytest.FixtureRequest):
    engine = LLMEngine(EngineConfig.from_flat({"model": request.param, "num_threads": 1,
                                               "disable_radix_cache": True}))
    assert engine.runner.lm_head_screen is not None, "the packaged models have a Q8_0 head"
    engine.runner.lm_head_screen.choice.pinned = True   # screened rows counted below: never the full head's turn
    yield engine
    engine.shutdown()


def run(engine: LLMEngine, requests: list[tuple[list[int], SamplingParams]], screen_on: bool | None,
        one_at_a_time: bool = False) -> dict[str, tuple[list[int], list]]:
    """Every request's tokens and logprobs, the screen's choice measured (``screen_on`` None), pinned
    to the screen (True) or to the full head's way: at a step the screen could take, the full head's logits, its argmax
    rows the int16 kernel's where the head's own route there is another kernel (whose logits round
    differently from the int16 kernel's, which the screen's argmax is: ``head_logits``)."""
    choice = engine.runner.lm_head_screen.choice
    saved = choice.pinned
    choice.pinned = screen_on
    outputs: dict[str, tuple[list[int], list]] = {}
    try:
        batches = [[r] for r in enumerate(requests)] if one_at_a_time else [list(enumerate(requests))]
        for batch in batches:
            for index, (prompt, params) in batch:
                assert engine.add_request(str(index), prompt, params) is None
            while engine.has_unfinished():
                for output in engine.step():
                    tokens, logprobs = outputs.setdefault(output.request_id, ([], []))
                    tokens.extend(output.new_token_ids)
                    logprobs.extend(output.logprobs or [])
    finally:
        choice.pinned = saved
    return outputs


def test_greedy_tokens_are_the_same_with_and_without_the_screen(engine: LLMEngine) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    requests = [(engine.tokenizer.encode(p), params) for p in PROMPTS]
    screen = engine.runner.lm_head_screen
    before = screen.stats.rows
    on = run(engine, requests, True, one_at_a_time=True)
    assert screen.stats.rows - before >= 3 * 15   # every decode row was screened
    assert on == run(engine, requests, False, one_at_a_time=True)
    # two rows in a step, both screened (the body rounds a batch differently from single rows:
    # compare batched with batched)
    before = screen.stats.rows
    assert run(engine, requests[:2], True) == run(engine, requests[:2], False)
    assert screen.stats.rows - before >= 2 * 15 and screen.is_enabled


@needs_i8
def test_a_batch_of_many_greedy_rows_takes_the_int8_screen_with_the_same_tokens(engine: LLMEngine) -> None:
    """24 greedy requests decoding together: more argmax rows than the 5-bit screen takes, so the
    int8 screen takes them, and the tokens are those of the full head."""
    prompts = [engine.tokenizer.encode(f"{p} {i}") for i in range(8) for p in PROMPTS]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    requests = [(prompt, params) for prompt in prompts]
    screen = engine.runner.lm_head_screen
    ways = []
    logits = screen.logits
    screen.logits = lambda head, hidden, rows, way=FIVE_BITS, tokens=None: (
        ways.append((len(rows), way)), logits(head, hidden, rows, way, tokens))[1]
    sampler = engine.executor.sampler
    known = []   # how many rows' argmax the sampler was given (the screen's), per call

    class Counting(type(sampler)):  # type: ignore[misc]
        def __call__(self, logits, rows, argmax=None):  # type: ignore[no-untyped-def]
            known.append(len(argmax or {}))
            return super().__call__(logits, rows, argmax)

    sampler.__class__ = Counting
    try:
        on = run(engine, requests, True)
    finally:
        del screen.logits
        sampler.__class__ = Counting.__bases__[0]
    # the int8 screen's VNNI GEMM, or its AMX one where that runs and measured faster (the same candidates)
    int8_steps = [way for rows, way in ways if rows == 24 and way in screen.i8.ways()]
    assert len(int8_steps) >= 7
    assert known.count(24) >= 7   # the sampler took the screen's argmax of every row, not its own search
    assert on == run(engine, requests, False)


def test_a_mixed_batch_is_the_same_with_and_without_the_screen(engine: LLMEngine) -> None:
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS]
    requests = [(prompts[0], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)),
                (prompts[1], SamplingParams(temperature=0.8, seed=7, max_tokens=8, ignore_eos=True)),
                (prompts[2], SamplingParams(temperature=0.0, logprobs=2, max_tokens=8, ignore_eos=True)),
                (prompts[0], SamplingParams(temperature=0.0, repetition_penalty=1.3, max_tokens=8,
                                            ignore_eos=True))]
    assert run(engine, requests, True) == run(engine, requests, False)


def test_real_hidden_states_at_several_row_counts(engine: LLMEngine) -> None:
    """The hidden states the LM head saw while decoding real prompts, screened 1 to 16 at a time:
    each row's argmax is the head's int16 kernel's."""
    from servelm.model import runner as runner_module

    model = engine.runner.model
    captured: list[torch.Tensor] = []
    head_logits_of = runner_module.head_logits   # the rows the LM head gets, whichever way takes them

    def capturing(screen, model, rows, *rest, **kwargs):
        captured.append(rows.detach().clone())
        return head_logits_of(screen, model, rows, *rest, **kwargs)

    runner_module.head_logits = capturing
    try:
        run(engine, [(engine.tokenizer.encode(p), SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
                     for p in PROMPTS], False)
    finally:
        runner_module.head_logits = head_logits_of
    hidden = torch.cat(captured).float()
    screen = engine.runner.lm_head_screen
    weight = screen.weight
    with torch.inference_mode():
        for m in (1, 5, 8, 16):
            x = hidden[:m].contiguous()
            full = screen.kernel.block_linear_a16(x, weight.codes, weight.scales, None, 32)
            assert torch.equal(screen.logits(model.lm_head, x, list(range(m))).argmax(-1), full.argmax(-1))
        if screen.i8 is not None:   # the int8 screen, at a decode step's 32 rows and more
            for m in (8, 32, 64):
                x = hidden.repeat(m // len(hidden) + 1, 1)[:m].contiguous()
                full = screen.kernel.block_linear_a16(x, weight.codes, weight.scales, None, 32)
                for way in screen.i8.ways():   # its GEMM on VNNI, and on AMX tiles where they run
                    logits = screen.logits(model.lm_head, x, list(range(m)), way)
                    assert torch.equal(logits.argmax(-1), full.argmax(-1)), (m, way)
            assert screen.stats.fallbacks == 0


@pytest.mark.parametrize("algorithm", ["NGRAM", pytest.param("EAGLE", marks=pytest.mark.slow)])
def test_speculative_verify_rows_are_screened_and_unchanged(engine: LLMEngine, algorithm: str,
                                                            tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """N-gram chains and EAGLE trees (a head written from the model: few drafts accepted) on greedy
    requests: their verify rows go through the screen and the tokens are those without it. (A head
    on the rows kernel's GEMM takes the screen up to MAX_SCREEN_ROWS_GEMM rows only, fewer than a
    verify step's: raised here to the screen's own limit.)"""
    monkeypatch.setattr(lm_head_screen, "MAX_SCREEN_ROWS_GEMM", lm_head_screen.MAX_SCREEN_ROWS)
    flat = {"model": engine.config.model.model, "num_threads": 1, "disable_radix_cache": True,
            "speculative_algorithm": algorithm, "num_speculative_tokens": 3}
    if algorithm == "EAGLE":   # a tree of 7 drafts: two requests, 16 logits rows
        write_head(["--model", engine.config.model.model, "--algorithm", "EAGLE", "--out", str(tmp_path / "head")])
        flat.update(speculative_draft_model_path=str(tmp_path / "head"), speculative_eagle_topk=4,
                    speculative_num_steps=3, num_speculative_tokens=7)
    spec = LLMEngine(EngineConfig.from_flat(flat))
    try:
        screen = spec.runner.lm_head_screen
        assert screen is not None
        screen.max_rows = lm_head_screen.MAX_SCREEN_ROWS   # the AVX2 build's limit is 3 rows
        screen.choice.pinned = True
        text = "Repeat this list exactly: apple, banana, cherry, apple, banana, cherry, apple, banana, cherry,"
        params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
        requests = [(spec.tokenizer.encode(text), params), (spec.tokenizer.encode(PROMPTS[0]), params)]
        before = screen.stats.rows
        on = run(spec, requests, True)
        # every emitted token came from a screened row (without the drafts' rows: one row a step)
        assert screen.stats.rows - before >= 2 * 24
        assert on == run(spec, requests, False)
        if algorithm == "NGRAM":
            assert spec.stats()["spec_accept_length"] > 1.0
        else:
            assert spec.stats()["spec_num_draft_tokens"] > 24
    finally:
        spec.shutdown()


@pytest.mark.slow
def test_long_greedy_outputs_are_the_same_with_and_without_the_screen(engine: LLMEngine) -> None:
    prompts = PROMPTS + ["import numpy as np\n\nx = np.", "SELECT name, email FROM users WHERE",
                         "Explain the theory of relativity in simple terms."]
    params = SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True)
    requests = [(engine.tokenizer.encode(p), params) for p in prompts]
    assert run(engine, requests, True, one_at_a_time=True) == run(engine, requests, False, one_at_a_time=True)


def test_the_kernels_candidates_are_the_bounds_candidates(kernels: Kernels) -> None:
    head, weight = q8_head(kernels, 3000, 256, seed=5)
    screen = screen_for(kernels, weight)
    x = torch.randn(3, 256) * 3
    approx, bound = screen.bounds(x)
    counts, *ids = screen.screen_kernel.screen_candidates(x, screen.packed, screen.tiled_scales, 3000, 3.505, 4096)
    for row in range(3):
        lower = (approx[row] - bound[row]).max()
        expected = ((approx[row] + bound[row]) >= lower).nonzero().squeeze(1)
        # the kernel rounds S + e D once (fma) where torch rounds twice: ids at the edge may differ
        assert abs(len(ids[row]) - len(expected)) <= 2 and int(counts[row]) == len(ids[row])
        assert torch.equal(ids[row], ids[row].sort().values)
        full_argmax = head(x[row:row + 1]).argmax()
        assert full_argmax in ids[row]


def i8_bound(screen: LMHeadScreen, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The int8 screen's S (the int8 GEMM's logits) and its bound E, in torch from its definition."""
    i8 = screen.i8
    levels = gguf_i8gemm.activation_levels(i8.packed)
    approx = i8.kernel.i8_gemm(x, i8.codes, i8.scales, None, 32, False, i8.vocab, **i8.packed.call_kwargs)
    _, d = i8.kernel.quantize(x, 32, **({"levels": levels} if levels != 127 else {}))
    amax = levels * d
    e = i8.coefficient
    bound = torch.minimum(e * amax.sum(1, keepdim=True) * i8.bound_max, e * amax.amax(1, keepdim=True) * i8.bound_sum)
    return approx, bound


@needs_i8
def test_the_int8_screens_bound_holds_and_is_approached(kernels: Kernels) -> None:
    """Random rows, near-ties and rows whose every input sits a hair off a half step of the int8
    grid (1/127, or 1/64 for the AVX2 build's fewer levels), its sign that of one vocabulary row's
    codes: the exact kernel's logit is within E of the int8 GEMM's everywhere, and on the adversarial
    rows (every block's absmax 1: the rank-one bounds are the sum over blocks) the difference reaches
    over 90% of E: the bound is tight, a coefficient cut by a tenth fails the first check."""
    head, weight = q8_head(kernels, 3001, 256, seed=21)
    screen = screen_for(kernels, weight)
    levels = gguf_i8gemm.activation_levels(screen.i8.packed)
    generator = torch.Generator().manual_seed(4)
    signs = torch.sign(weight.codes[:6].float()) + (weight.codes[:6] == 0).float()
    steps = torch.randint(0, levels - 7, (6, 256), generator=generator).float()
    adversarial = signs * (steps + 0.4999) / levels   # every block's absmax then close to 1
    adversarial[:, ::32] = signs[:, ::32]               # ... pinned to 1: the grid's step is 1/levels
    x = torch.cat([near_tie_rows(weight, 9, seed=5), adversarial]).contiguous()
    exact = screen.kernel.block_linear_a16(x, weight.codes, weight.scales, None, 32)
    approx, bound = i8_bound(screen, x)
    assert ((exact - approx).abs() <= bound).all()
    reached = ((exact - approx).abs() / bound)[9:].diagonal()
    assert reached.min() > 0.9


@needs_i8
@pytest.mark.parametrize("m", [1, 6, 17, 33, 70])
def test_the_int8_screen_gives_each_rows_exact_argmax(kernels: Kernels, m: int) -> None:
    """Row blocks of 4 and a vocabulary not a multiple of the GEMM's tiles of 32: each row's argmax is
    the int16 kernel's, ties to the lowest id, and its candidates carry that kernel's logits."""
    head, weight, screen, x, full = tie_case(kernels, m, seed=30 + m)
    logits = screen.logits(head, x, list(range(m)), INT8)
    assert torch.equal(logits.argmax(-1), full.argmax(-1))
    assert logits[0].argmax() == 900 and full[0, 1500] == full[0, 900]
    finite = torch.isfinite(logits)
    assert torch.equal(logits[finite], full[finite])
    # the candidates are those the bound gives (the kernel's roundings are the same as torch's here)
    approx, bound = i8_bound(screen, x)
    counts, *ids = screen.i8.candidates(x, 4096)
    for row in range(m):
        expected = ((approx[row] + bound[row]) >= (approx[row] - bound[row]).max()).nonzero().squeeze(1)
        assert abs(len(ids[row]) - len(expected)) <= 2 and int(counts[row]) == len(ids[row])
        assert torch.equal(ids[row], ids[row].sort().values) and full[row].argmax() in ids[row]
    assert screen.stats.fallbacks == 0


@needs_i8
def test_the_int8_screens_candidates_do_not_depend_on_the_rows_beside_them_or_the_threads(kernels: Kernels) -> None:
    head, weight = q8_head(kernels, 5003, 256, seed=6)
    screen = screen_for(kernels, weight)
    x = near_tie_rows(weight, 11, seed=3)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        together = screen.i8.candidates(x, 4096)
        alone = [screen.i8.candidates(x[i:i + 1].contiguous(), 4096) for i in range(11)]
        torch.set_num_threads(2)
        parallel = screen.i8.candidates(x, 4096)
    finally:
        torch.set_num_threads(threads)
    for i in range(11):
        assert torch.equal(together[i + 1], alone[i][1]) and torch.equal(together[i + 1], parallel[i + 1])
    assert torch.equal(together[0], parallel[0])


@needs_i8
def test_the_int8_screen_sends_rows_that_are_not_finite_and_rows_over_the_limit_to_the_full_head(
        kernels: Kernels) -> None:
    head, weight = q8_head(kernels, 1000, 128, seed=5)
    screen = screen_for(kernels, weight)
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(1))
    x[1, 7], x[2, 100] = float("nan"), float("inf")
    counts, *_ = screen.i8.candidates(x, 4096)
    assert counts[0] > 0 and counts[1] == 0 and counts[2] == 0 and counts[3] > 0
    logits = screen.logits(head, x, [0, 1, 2, 3], INT8)
    full = head(x)
    torch.testing.assert_close(logits[1:3], full[1:3], rtol=0, atol=0, equal_nan=True)
    assert torch.equal(logits[[0, 3]].argmax(-1), full[[0, 3]].argmax(-1))
    assert torch.equal(logits[4], full[4])   # not an argmax row: the full head's logits
    screen.max_candidates = 0
    assert torch.equal(screen.logits(head, x[[0, 3]], [0, 1], INT8), head(x[[0, 3]]))


@needs_i8
def test_the_way_a_step_is_screened(kernels: Kernels, monkeypatch: pytest.MonkeyPatch) -> None:
    """The 5-bit copy up to its row limit, the int8 GEMM above it; rows split off (not argmax rows)
    only where they take alone the row-by-row route the full head takes with all rows."""
    head, weight = q8_head(kernels, 1000, 128, seed=7)
    screen = screen_for(kernels, weight)
    model = torch.nn.Module()
    model.lm_head = head
    limit = min(screen.max_rows, lm_head_screen.MAX_SCREEN_ROWS)
    routes = {}
    monkeypatch.setattr(head, "gguf_routes", SimpleNamespace(pick=lambda rows, bf16, prompt: routes.get(rows, Route.BLOCK)))
    x = torch.randn(40, 128)
    assert screen_way(screen, model, x[:limit], list(range(limit))) == FIVE_BITS
    assert screen_way(screen, model, x[:limit + 1], list(range(limit + 1))) == INT8
    assert screen_way(screen, model, x, list(range(30))) == INT8          # 10 rows alone: the same route
    routes[10] = Route.DENSE
    assert screen_way(screen, model, x, list(range(30))) is None          # ... not the same route
    assert screen_way(screen, model, x[:30], list(range(30))) == INT8     # every row an argmax row
    routes[40] = routes[10] = Route.DENSE
    assert screen_way(screen, model, x, list(range(30))) is None          # a GEMM whose rows are not apart
    assert screen_way(screen, model, x, []) is None
    screen.i8 = None
    assert screen_way(screen, model, x[:30], list(range(30))) is None
    assert i8_screen_coefficient(128) > 1 / 254 and i8_screen_coefficient(128, 64) > 1 / 128


def test_the_start_up_warm_up_leaves_the_screen_on(engine: LLMEngine) -> None:
    """The warm-up's rows are hidden states of garbage K/V, nearly all over the candidate limit: it
    forgets them, so real requests are screened (issue 16: they turned the screen off in every server
    after a few real rows, and the served engine ran the full head)."""
    from servelm.engine.warmup import warm_up

    screen = engine.runner.lm_head_screen
    assert warm_up(engine) is not None
    assert screen.stats.rows == 0 and screen.is_enabled
    params = SamplingParams(temperature=0.0, max_tokens=WINDOW_ROWS + 8, ignore_eos=True)
    run(engine, [(engine.tokenizer.encode(PROMPTS[0]), params)], True)
    assert screen.stats.rows >= WINDOW_ROWS + 7 and screen.is_enabled


def test_the_screen_or_the_full_head_is_chosen_by_measured_time() -> None:
    """Per number of argmax rows: the two ways alternate until each has CHOICE_SAMPLES calls, then the
    faster median is taken, with the other way run every EXPLORE_EVERY-th call (every
    EXPLORE_EVERY_CLEAR-th where it is CLEAR_MARGIN times slower); row counts are apart."""
    choice = ScreenChoice()
    ways = (FIVE_BITS, lm_head_screen.FULL_HEAD)   # ``head_logits``' ways where one screen takes the step
    taken = []
    for _ in range(2 * CHOICE_SAMPLES):
        taken.append(choice.pick(4, ways))
        choice.record(4, taken[-1], 0.0036 if taken[-1] == FIVE_BITS else 0.003)   # at 4 rows the full head is faster
    assert taken.count(FIVE_BITS) == taken.count(lm_head_screen.FULL_HEAD) == CHOICE_SAMPLES
    later = [choice.pick(4, ways) for _ in range(3 * EXPLORE_EVERY)]
    assert later.count(FIVE_BITS) == 3 and choice.chosen() == {4: lm_head_screen.FULL_HEAD}
    for _ in range(CHOICE_WINDOW):   # the screen now clearly slower at 4 rows: it runs far more rarely
        choice.record(4, FIVE_BITS, 0.003 * CLEAR_MARGIN)
    later = [choice.pick(4, ways) for _ in range(3 * EXPLORE_EVERY_CLEAR)]
    assert later.count(FIVE_BITS) == 3 and choice.chosen() == {4: lm_head_screen.FULL_HEAD}
    for _ in range(2 * CHOICE_SAMPLES):   # one row: the screen is faster there
        screened = choice.pick(1, ways)
        choice.record(1, screened, 0.002 if screened == FIVE_BITS else 0.003)
    assert choice.pick(1, ways) == FIVE_BITS and choice.chosen() == {1: FIVE_BITS, 4: lm_head_screen.FULL_HEAD}
    choice.pinned = True
    assert choice.pick(4, ways) == FIVE_BITS
    choice.forget()
    choice.pinned = None
    assert choice.chosen() == {}


def test_a_measured_engine_gives_the_same_tokens_and_uses_both_ways(engine: LLMEngine) -> None:
    """Unpinned, the engine runs both ways at one argmax row while it measures them, and the greedy
    tokens are those of the screen alone and of the full head alone."""
    screen = engine.runner.lm_head_screen
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    requests = [(engine.tokenizer.encode(PROMPTS[0]), params)]
    pinned = run(engine, requests, True)
    screen.choice.forget()
    before = screen.stats.rows
    measured = run(engine, requests, None)
    assert CHOICE_SAMPLES <= screen.stats.rows - before < 15   # not every row, not none
    assert 1 in screen.choice.chosen()
    assert measured == pinned == run(engine, requests, False)


@needs_i8
def test_where_both_screens_take_a_step_the_fastest_way_is_measured_and_the_token_is_the_same(
        kernels: Kernels, monkeypatch: pytest.MonkeyPatch) -> None:
    """A step both the 5-bit and the int8 screen take (three argmax rows: the AVX2 build's 5-bit screen
    takes no more; the head on the int16 kernel) runs whichever of them and the full head ``choice``
    measured fastest at that many rows (all sampled first; the int8 screen's AMX GEMM too where it runs), and
    each gives the int16 kernel's
    argmax: on an Intel Xeon with AMX the int8 screen took Gemma 3's 8 rows in 16.5 ms against the
    5-bit one's 25.2 and the full head's 29.8, where the 5-bit one had been taken whenever it could."""
    head, weight = q8_head(kernels, 3000, 256, seed=4)
    screen = screen_for(kernels, weight)
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(5)) * 3
    argmax = [0, 1, 2]
    expected = screen.kernel.block_linear_a16(x, weight.codes, weight.scales, None, 32).argmax(dim=1).tolist()
    ways: list[str] = []
    fastest = [FIVE_BITS]

    def slow_unless(way: str) -> None:
        ways.append(way)
        time.sleep(0.0 if way == fastest[0] else 0.004)

    def full_head(rows: torch.Tensor, _: object) -> torch.Tensor:
        slow_unless(lm_head_screen.FULL_HEAD)
        return head(rows)

    model = SimpleNamespace(lm_head=head, compute_logits=full_head)
    assert screen_way(screen, model, x, argmax) == FIVE_BITS
    assert lm_head_screen.int8_screen_suits(screen, model, x, argmax)
    real = screen.logits

    def timed(head_module, hidden, rows, way=FIVE_BITS, tokens=None):
        slow_unless(way)
        return real(head_module, hidden, rows, way, tokens)

    monkeypatch.setattr(screen, "logits", timed)
    every = (*screen.i8.ways(), FIVE_BITS, lm_head_screen.FULL_HEAD)   # INT8_AMX too where AMX runs
    for way in every:
        fastest[0] = way
        screen.choice.forget()
        ways.clear()
        for _ in range(len(every) * CHOICE_SAMPLES + 8):
            tokens: dict[int, int] = {}
            logits = head_logits(screen, model, x, argmax, None, tokens)
            assert logits.argmax(dim=1).tolist() == expected
            if ways[-1] != lm_head_screen.FULL_HEAD:   # a screen's step gives the sampler its tokens
                assert [tokens[row] for row in argmax] == expected
        assert sorted(set(ways[:len(every) * CHOICE_SAMPLES])) == sorted(every)
        assert ways[len(every) * CHOICE_SAMPLES:] == [way] * 8 and screen.choice.chosen() == {3: way}
