"""Rendering request-supplied chat templates in a worker process with a time and memory budget.

A chat template is Jinja code. The server's own template (the tokenizer's or --chat-template) is
trusted and rendered on the tokenizer thread; a template sent in a request is refused unless
--trust-request-chat-template, and then rendered here.

Invariants:
- The worker is a spawned process that dies with the front end (``die_with_parent``). It renders
  with transformers' sandboxed Jinja environment (no attribute access to Python internals) under
  an address-space limit, so a template that allocates without bound fails there, not here.
- A render that takes longer than ``budget_s`` kills the worker (the only way to stop a Jinja
  loop) and is a 400; the next render starts a new worker. The event loop never waits on Jinja.
- One render at a time: templates from requests queue behind each other, never behind the
  server's own template or any other request.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
from multiprocessing.connection import Connection
from typing import Any

from servelm.errors import InvalidRequestError

logger = logging.getLogger(__name__)

RENDER_BUDGET_S = 2.0
"""Longest render of a request's template. Real templates render in milliseconds."""
WORKER_MEMORY_BYTES = 1 << 30
"""Address space the worker may add beyond what it has after start-up (imports)."""
_WORKER_START_S = 120.0


def _worker_main(parent_pid: int, connection: Connection) -> None:
    from servelm.distributed.lifetime import die_with_parent, limit_address_space

    die_with_parent(parent_pid)
    from transformers.utils.chat_template_utils import render_jinja_template

    limit_address_space(WORKER_MEMORY_BYTES)
    connection.send(("ready", None))
    while True:
        job = connection.recv()
        try:
            rendered, _ = render_jinja_template(
                conversations=[job["messages"]], tools=job["tools"], documents=None,
                chat_template=job["template"],
                continue_final_message=job["continue_final_message"],
                add_generation_prompt=job["add_generation_prompt"], **job["kwargs"])
            connection.send(("ok", rendered[0]))
        except MemoryError:
            connection.send(("error", "the template used more memory than allowed"))
        except Exception as error:  # the template's own failure: reported to the client
            connection.send(("error", f"{type(error).__name__}: {error}"))


class TemplateSandbox:
    """One worker process rendering untrusted chat templates, one at a time."""

    def __init__(self, budget_s: float = RENDER_BUDGET_S) -> None:
        self.budget_s = budget_s
        self._process: multiprocessing.process.BaseProcess | None = None
        self._connection: Connection | None = None
        self._lock = asyncio.Lock()

    def _start(self) -> None:
        """Spawn the worker and wait until its imports are done (not counted in the budget)."""
        context = multiprocessing.get_context("spawn")
        ours, theirs = context.Pipe()
        process = context.Process(target=_worker_main, args=(os.getpid(), theirs),
                                  name="servelm-template", daemon=True)
        process.start()
        theirs.close()
        if not ours.poll(_WORKER_START_S):
            process.kill()
            raise RuntimeError("the chat-template worker did not start")
        ours.recv()
        self._process, self._connection = process, ours

    def _stop(self) -> None:
        if self._process is not None:
            self._process.kill()
            self._process.join(5)
        if self._connection is not None:
            self._connection.close()
        self._process = self._connection = None

    async def render(self, job: dict[str, Any]) -> str:
        """The template's text for ``job``; a failing or over-budget template is a 400."""
        async with self._lock:
            if self._process is None or not self._process.is_alive():
                self._stop()
                await asyncio.to_thread(self._start)
            connection = self._connection
            assert connection is not None
            connection.send(job)
            is_done = await asyncio.to_thread(connection.poll, self.budget_s)
            if not is_done:
                self._stop()
                raise InvalidRequestError(f"chat_template: rendering took longer than "
                                          f"{self.budget_s:g} s and was stopped", "chat_template")
            try:
                status, value = connection.recv()
            except (EOFError, OSError):  # the worker died (memory limit, signal)
                self._stop()
                raise InvalidRequestError("chat_template: rendering failed (the template exceeded "
                                          "its memory budget)", "chat_template") from None
        if status != "ok":
            raise InvalidRequestError(f"chat template failed: {value}", "chat_template")
        return str(value)

    def close(self) -> None:
        self._stop()
