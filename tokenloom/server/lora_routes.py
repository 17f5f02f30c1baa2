"""LoRA adapters on the server, as vLLM serves them: `--lora-modules`, the adapters listed in
`GET /v1/models` with `parent` set to the base, a request choosing one by its `model`, and run-time
`POST /v1/load_lora_adapter` / `POST /v1/unload_lora_adapter`.

Run-time loading makes the server read a directory a client names, so it needs
`--allow-runtime-lora-updating` (vLLM: VLLM_ALLOW_RUNTIME_LORA_UPDATING) on top of `--enable-lora`, and
like every route it is behind `--api-key`. Loads and unloads take turns (one lock); an adapter's
files are read off the event loop and off the engine thread.

The adapter manager (engine/lora_manager.py) owns each name's state. An unload of a name that requests
run under, or that a request is being admitted for, answers 409 `adapter_in_use` (it does not wait
for them to drain: retry once they finish); nothing a request does registers a name again after its
unload. A load's failures are 400s naming the file and the field; `/v1/models` lists adapters by
name (their paths only for the operator's --metrics-token).
"""

from __future__ import annotations

import asyncio
import itertools
import json

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict, Field

from ..engine.lora_manager import AdapterBusy
from ..model.lora import LoRARequest
from .errors import APIError
from .protocol import Text, _utf8
from .state import ServerState


def parse_lora_modules(values: list[str] | None) -> list[LoRARequest]:
    """`name=path` or vLLM's JSON form `{"name": ..., "path": ..., "base_model_name": ...}`, each a new id."""
    out: list[LoRARequest] = []
    for i, value in enumerate(values or [], start=1):
        if value.lstrip().startswith("{"):
            try:
                spec = json.loads(value)
                name, path = spec["name"], spec["path"]
            except (json.JSONDecodeError, KeyError, TypeError):
                raise ValueError(f"--lora-modules: {value!r} is not {{\"name\": ..., \"path\": ...}}") from None
        else:
            name, sep, path = value.partition("=")
            if not sep:
                raise ValueError(f"--lora-modules: {value!r} is not name=path")
        if any(r.lora_name == name for r in out):
            raise ValueError(f"--lora-modules: {name!r} is given twice")
        try:  # argv's undecodable bytes arrive as lone surrogates: protocol's check for request text
            valid = bool(name) and name.isprintable() and _utf8(name) == name
        except ValueError:
            valid = False
        if not valid:
            raise ValueError(f"--lora-modules: the name {name!r} is empty, unprintable or not valid Unicode")
        out.append(LoRARequest(name, i, path))
    return out


class LoadLoRAAdapterRequest(BaseModel):
    # Text: a name with a lone surrogate would be listed by /v1/models, whose JSON could then not be encoded
    model_config = ConfigDict(extra="forbid", strict=True)
    lora_name: Text = Field(min_length=1, max_length=256)
    lora_path: Text = Field(min_length=1, max_length=4096)


class UnloadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)  # vLLM's clients may send lora_int_id too
    lora_name: Text = Field(min_length=1, max_length=256)


def add_lora_routes(app: FastAPI, state: ServerState, allow_runtime_updating: bool) -> None:
    turn = asyncio.Lock()
    ids = itertools.count(max((r.lora_int_id for r in state.loras.values()), default=0) + 1)

    def check_allowed() -> None:
        if state.adapters is None:
            raise APIError(400, "LoRA adapters are not enabled (start the server with --enable-lora)",
                           param="lora_name")
        if not allow_runtime_updating:
            raise APIError(400, "loading adapters at run time is off (--allow-runtime-lora-updating)",
                           param="lora_name")

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoRAAdapterRequest):
        check_allowed()
        async with turn:
            name = body.lora_name
            if name in state.loras or name in state.served_model_names:
                raise APIError(400, f"The lora adapter '{name}' has already been loaded.", param="lora_name")
            request = LoRARequest(name, next(ids), body.lora_path)
            try:
                await state.run_off_loop(state.adapters.load, request)
            except ValueError as exc:
                raise APIError(400, str(exc), param="lora_path") from None
            state.loras[name] = request
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest):
        check_allowed()
        async with turn:
            name = body.lora_name
            if name not in state.loras:
                raise APIError(404, f"The lora adapter '{name}' cannot be found.", "invalid_request_error",
                               "lora_name", "model_not_found")
            try:
                state.adapters.unregister(name)  # under the lock requests pin it with
            except AdapterBusy as exc:  # requests in flight or being admitted run under it
                raise APIError(409, str(exc), param="lora_name", code="adapter_in_use") from None
            except KeyError:
                pass  # gone from the manager already: only the listing is left to drop
            del state.loras[name]
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")
