"""A request's transfer, as the client (or a router) asked for it.

Two protocols name the same thing:
- SGLang: the same request goes to the prefill and the decode server, both carrying
  ``bootstrap_host``, ``bootstrap_port`` and ``bootstrap_room``. The engine request of choice i
  (n > 1) is keyed ``room/i`` on both sides.
- vLLM: the prefill call carries ``kv_transfer_params: {"do_remote_decode": true}`` and its
  response returns the params the decode call sends back (``do_remote_prefill``, remote host,
  port and request id); the key is the prefill server's engine request id.

Invariant: a ``KVTransfer`` reaching the engine is well formed for the server's mode; everything
the client got wrong is a 400 here (``TransferRequestError``), before any engine work.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


class TransferRequestError(ValueError):
    """The request's transfer fields are wrong for this server (a 400 naming ``param``)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True, slots=True)
class KVTransfer:
    """One engine request's part in a transfer."""

    role: str
    """prefill: this server computes the prompt and parks its K/V for a pull; decode: this server
    pulls the K/V from ``host:port`` and decodes."""
    key: str | None
    """The transfer's name on both sides; None on a vLLM prefill (its engine request id is used)."""
    host: str | None = None
    """decode: the prefill server's bootstrap host."""
    port: int | None = None
    """decode: the prefill server's bootstrap port."""
    is_vllm: bool = False
    """prefill: the response carries ``kv_transfer_params`` (vLLM's two-call flow)."""


SGLANG_FIELDS = ("bootstrap_host", "bootstrap_port", "bootstrap_room")


def _room(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise TransferRequestError(f"bootstrap_room must be a non-negative integer, got {value!r}",
                                   "bootstrap_room")
    return value


def _port(value: Any, param: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value < 65536:
        raise TransferRequestError(f"{param} must be a TCP port, got {value!r}", param)
    return value


def parse_transfers(extra: dict[str, Any], mode: str, num_choices: int) -> list[KVTransfer | None]:
    """Each engine request's transfer (choice order), from a request body's extra fields.

    ``mode`` is the server's --disaggregation-mode. A request without transfer fields runs
    co-located on any server; with them on a null-mode server it is refused.
    """
    vllm = extra.get("kv_transfer_params")
    sglang = {name: extra.get(name) for name in SGLANG_FIELDS if extra.get(name) is not None}
    if vllm is not None and sglang:
        raise TransferRequestError("give kv_transfer_params (vLLM) or bootstrap_* (SGLang), not both",
                                   "kv_transfer_params")
    if vllm is not None:
        return [_vllm_transfer(vllm, mode, num_choices)] * num_choices
    if not sglang:
        return [None] * num_choices
    if mode == "null":
        raise TransferRequestError("this server runs co-located (--disaggregation-mode null); "
                                   "bootstrap_* fields are for prefill and decode servers",
                                   "bootstrap_room")
    if any(isinstance(value, list) for value in sglang.values()):
        return _batch(sglang, mode, num_choices)
    if "bootstrap_room" not in sglang:
        raise TransferRequestError("bootstrap_room is required with bootstrap_host/bootstrap_port",
                                   "bootstrap_room")
    room = _room(sglang["bootstrap_room"])
    if mode == "prefill":
        return [KVTransfer("prefill", f"{room}/{i}") for i in range(num_choices)]
    host = sglang.get("bootstrap_host")
    if not isinstance(host, str) or not host:
        raise TransferRequestError("bootstrap_host (the prefill server's host) is required on a "
                                   "decode server", "bootstrap_host")
    port = _port(sglang.get("bootstrap_port", 8998), "bootstrap_port")
    return [KVTransfer("decode", f"{room}/{i}", host, port) for i in range(num_choices)]


def _batch(sglang: dict[str, Any], mode: str, num_prompts: int) -> list[KVTransfer | None]:
    """A batch /generate: sglang-router gives one host, port and room per prompt (lists)."""
    values = {}
    for name in SGLANG_FIELDS:
        value = sglang.get(name)
        if not isinstance(value, list) or len(value) != num_prompts:
            raise TransferRequestError(f"{name} must be a list of {num_prompts} values (one per "
                                       "prompt, n = 1) in a batch", name)
        values[name] = value
    return [parse_transfers({name: values[name][i] for name in SGLANG_FIELDS}, mode, 1)[0]
            for i in range(num_prompts)]


def _check_vllm_side(field: str, side: str, mode: str, num_choices: int) -> None:
    """``kv_transfer_params.<field>`` asks for a ``side`` server and one choice."""
    if mode != side:
        raise TransferRequestError(f"{field} needs a {side} server "
                                   f"(this one runs --disaggregation-mode {mode})", "kv_transfer_params")
    if num_choices != 1:
        raise TransferRequestError("kv_transfer_params works with n = 1 and one prompt",
                                   "kv_transfer_params")


def _vllm_transfer(params: Any, mode: str, num_choices: int) -> KVTransfer | None:
    if not isinstance(params, dict):
        raise TransferRequestError("kv_transfer_params must be an object", "kv_transfer_params")
    if params.get("do_remote_decode"):
        _check_vllm_side("do_remote_decode", "prefill", mode, num_choices)
        return KVTransfer("prefill", None, is_vllm=True)
    if params.get("do_remote_prefill"):
        _check_vllm_side("do_remote_prefill", "decode", mode, num_choices)
        host, key = params.get("remote_host"), params.get("remote_request_id")
        if not isinstance(host, str) or not host or not isinstance(key, str) or not key:
            raise TransferRequestError("do_remote_prefill needs remote_host and remote_request_id "
                                       "(the prefill response's kv_transfer_params)",
                                       "kv_transfer_params")
        return KVTransfer("decode", key, host, _port(params.get("remote_port"),
                                                     "kv_transfer_params.remote_port"))
    return None  # vLLM sends {} or both false for a plain request
