"""A model runner that needs no weights but checks the KV-cache contract like a real one.

It stores each computed token in its slot, reads a sequence's whole context back through its
block table, and predicts ``(sum(context) * 31 + len(context)) % vocab``. Wrong block ids, stale
slots or a bad start position therefore change the output, as they would with a real model.
"""

from __future__ import annotations

import torch

from servelm.model.forward_batch import BatchPlan


class FakeRunner:
    task = "generate"
    pooler = None

    def __init__(self, num_blocks: int = 64, block_size: int = 4, vocab_size: int = 97) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.kv_cache_bytes = 0
        self.hidden_size = 0
        self.device = torch.device("cpu")
        self.slots: list[int | None] = [None] * (num_blocks * block_size)
        self.num_forward_tokens = 0
        self.max_batch_tokens = 0

    def rank_kv_capacity_blocks(self) -> list[int]:
        return [self.num_blocks]

    def init_kv_cache(self, num_blocks: int) -> None:
        assert num_blocks == self.num_blocks

    def layout(self) -> dict[str, object]:
        return {"tp_size": 1}

    def shutdown(self) -> None:
        pass

    def _slot(self, block_ids: list[int], position: int) -> int:
        return block_ids[position // self.block_size] * self.block_size + position % self.block_size

    def predict(self, context: list[int]) -> int:
        return (sum(context) * 31 + len(context)) % self.vocab_size

    def execute(self, plan: BatchPlan) -> torch.Tensor:
        rows = []
        self.max_batch_tokens = max(self.max_batch_tokens, plan.num_tokens)
        for source, destination in plan.block_copies:  # copy-on-write before anything is written
            size = self.block_size
            self.slots[destination * size:(destination + 1) * size] = self.slots[source * size:(source + 1) * size]
        for source, destination in plan.slot_copies:
            self.slots[destination] = self.slots[source]
        for seq in plan.sequences:
            end = seq.start_position + len(seq.token_ids)
            assert len(seq.block_ids) * self.block_size >= end, "blocks do not cover the tokens"
            assert len(set(seq.block_ids)) == len(seq.block_ids)
            for offset, token in enumerate(seq.token_ids):
                self.slots[self._slot(seq.block_ids, seq.start_position + offset)] = token
            context = [self.slots[self._slot(seq.block_ids, p)] for p in range(end)]
            assert None not in context, "a position below start_position has no K/V"
            for position in range(end - seq.num_logits, end):
                logits = torch.full((self.vocab_size,), -10.0)
                logits[self.predict(context[:position + 1])] = 10.0
                rows.append(logits)
            self.num_forward_tokens += len(seq.token_ids)
        if not rows:
            return torch.empty(0, self.vocab_size)
        return torch.stack(rows)

    def reference(self, prompt: list[int], max_tokens: int, stop_ids: set[int] = frozenset()) -> list[int]:
        tokens = list(prompt)
        out = []
        for _ in range(max_tokens):
            token = self.predict(tokens)
            out.append(token)
            tokens.append(token)
            if token in stop_ids:
                break
        return out
