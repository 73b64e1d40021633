"""Answers shaped for other servers' own clients (llama.cpp's web UI), from servelm's figures."""

from __future__ import annotations

from typing import Any

from servelm.server.serving import ServingContext


def llama_cpp_props(ctx: ServingContext) -> dict[str, Any]:
    """llama.cpp's ``GET /props``: what its UI shows before the first request. Fields that have
    no servelm meaning (slot ids, build flags) are left out rather than invented."""
    template = ctx.chat_template or getattr(ctx.tokenizer, "chat_template", None)
    return {
        "default_generation_settings": {"n_ctx": ctx.context_length},
        "total_slots": ctx.config.scheduler.max_running_requests,
        "model_path": ctx.config.model.model,
        "model_alias": ctx.served_model_name,
        "chat_template": template if isinstance(template, str) else "",
        "modalities": {"vision": ctx.multimodal.accepts_images, "audio": False},
        "build_info": "servelm",
        "is_sleeping": False,
    }
