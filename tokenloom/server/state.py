"""What every route needs: the AsyncLLM, the served names, ids and timestamps."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

from ..engine.async_llm import AsyncLLM
from .errors import APIError


@dataclass
class ServerState:
    async_llm: AsyncLLM
    served_model_names: list[str]
    model_path: str | None = None
    metrics: object | None = None  # EngineMetrics

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]

    @property
    def tokenizer(self):
        return self.async_llm.tokenizer

    def check_model(self, name: str | None) -> str:
        if name is None or name in self.served_model_names:
            return self.model_name if name is None else name
        raise APIError(
            404, f"The model `{name}` does not exist. Served: {', '.join(self.served_model_names)}",
            "invalid_request_error", "model", "model_not_found",
        )


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now_s() -> int:
    return int(time.time())
