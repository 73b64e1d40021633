"""Parsers of model text: reasoning (<think>...</think>) and tool calls, streaming or not.

Each parser is an incremental state machine: ``feed(delta)`` returns what can be emitted now and
``finish()`` the rest. A non-streamed response is ``feed(whole text)`` then ``finish()``, so the
concatenated stream equals the non-streamed result for any chunking.
"""
