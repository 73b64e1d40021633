"""oneDNN's primitive cache size for this process (--onednn-primitive-cache-capacity).

On CPU, torch runs bf16 (and some float32) linears through oneDNN, which builds one primitive
per distinct problem shape and keeps up to 1024 of them (its default). A server sees a new shape
for nearly every batch size and chunk length, so under varied load the cache fills with
primitives that are rarely used again and the engine's RSS climbs by hundreds of MB before it
levels off (issue 19's hostile load test: 1952 -> 2309 MiB over four rounds). A smaller cache
bounds that growth; a steady decode step uses only a handful of shapes (one per linear weight
shape at the current batch size), so a few dozen entries keep every hot primitive.

Invariants:
- oneDNN reads ``ONEDNN_PRIMITIVE_CACHE_CAPACITY`` once, when it builds its first primitive
  (checked: setting it after one linear has run changes nothing), and torch offers no call to
  change it, so ``configure_onednn_cache`` runs at the top of ``ModelRunner.__init__``, before any
  weight is loaded or op is run, in every process that runs the model (engine, each rank).
- The flag is the only writer; it is logged, and an environment value it replaces is named in a
  warning. ``None`` leaves oneDNN's own setting (the environment or 1024) alone.
- It bounds torch's second per-shape cache as well: ideep (torch's oneDNN wrapper) keeps its own
  LRU of matmul computations, primitive plus buffers, sized by ``LRU_CACHE_CAPACITY`` (default
  1024, read at its first matmul). oneDNN's capacity alone left that one growing by ~1 MiB per
  new batch size over SmolLM2's four linear shapes (the engine's RSS rose 5-10 MiB a round of
  fresh requests without levelling off; benchmarks/RESULTS.md, issue 19). ideep crashes
  (SIGSEGV) with a capacity of 0, so it gets at least 1.
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)

ENV_VAR = "ONEDNN_PRIMITIVE_CACHE_CAPACITY"
IDEEP_ENV_VAR = "LRU_CACHE_CAPACITY"
"""ideep's matmul computation cache (torch's oneDNN wrapper), set with the same capacity."""


def configure_onednn_cache(capacity: int | None) -> None:
    """Set oneDNN's primitive cache capacity, and ideep's computation cache to match, for this
    process (before its first primitive)."""
    if capacity is None:
        logger.debug("oneDNN primitive cache: %s", os.environ.get(ENV_VAR, "1024 (oneDNN default)"))
        return
    for name, value in ((ENV_VAR, capacity), (IDEEP_ENV_VAR, max(1, capacity))):
        previous = os.environ.get(name)
        if previous is not None and previous != str(value):
            logger.warning("%s=%s in the environment replaced by --onednn-primitive-cache-capacity %d",
                           name, previous, capacity)
        os.environ[name] = str(value)
    logger.info("oneDNN primitive cache: %d primitives (--onednn-primitive-cache-capacity; "
                "oneDNN's default is 1024)", capacity)
