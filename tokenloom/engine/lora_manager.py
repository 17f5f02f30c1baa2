"""Which LoRA adapters are loaded, by name: vLLM's `max_cpu_loras` cache with its least recently used
eviction, never evicting one that a request in flight runs under.

An adapter is registered under its name (`LoRARequest.lora_name`) with its id and path; asking for a
name again with another id or path is an error (one name, one adapter). `acquire` loads it if needed
(model/lora.py checks it against the model) and pins it for a request; `release` unpins it. Past
`max_cpu_loras` the least recently used unpinned adapters are dropped from memory (their registration
stays: a later request loads them again from their path).
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import torch

from ..model.config import ModelConfig
from ..model.lora import LoRARequest, LoRAWeights, load_adapter


class AdapterManager:
    def __init__(self, model_config: ModelConfig, max_cpu_loras: int, max_lora_rank: int,
                 dtype: torch.dtype = torch.float32):
        self.model_config, self.max_cpu_loras, self.max_lora_rank, self.dtype = (
            model_config, max_cpu_loras, max_lora_rank, dtype)
        self.registered: dict[str, LoRARequest] = {}
        self.loaded: OrderedDict[str, LoRAWeights] = OrderedDict()  # least recently used first
        self.pins: dict[str, int] = {}
        self.num_loads = 0
        self._lock = threading.Lock()  # the server loads adapters off the engine thread

    def register(self, request: LoRARequest) -> bool:
        """Whether the name is new (False: registered before, as the same adapter)."""
        with self._lock:
            known = self.registered.get(request.lora_name)
            if known is not None and known != request:
                raise ValueError(f"lora_name: {request.lora_name!r} is already registered as "
                                 f"id {known.lora_int_id} at {known.lora_path!r}")
            if known is None:
                for other in self.registered.values():
                    if other.lora_int_id == request.lora_int_id:
                        raise ValueError(f"lora_int_id: {request.lora_int_id} is already {other.lora_name!r}")
            self.registered[request.lora_name] = request
            return known is None

    def unregister(self, name: str) -> None:
        with self._lock:
            if name not in self.registered:
                raise KeyError(name)
            if self.pins.get(name):
                raise ValueError(f"lora adapter {name!r} has {self.pins[name]} request(s) in flight")
            del self.registered[name]
            self.loaded.pop(name, None)

    def load(self, request: LoRARequest) -> LoRAWeights:
        """Register and load an adapter without pinning it (the server does this off the engine thread,
        so the request's `acquire` finds it loaded and the engine never waits on a file)."""
        weights = self.acquire(request)
        self.release(request.lora_name)
        return weights

    def acquire(self, request: LoRARequest) -> LoRAWeights:
        """The adapter's weights, loaded if needed, pinned until `release`."""
        new = self.register(request)
        with self._lock:
            weights = self.loaded.get(request.lora_name)
        fresh = weights is None
        if fresh:  # loaded outside the lock: reading files must not hold up the engine's lookups
            try:
                weights = load_adapter(request.lora_path, request.lora_name, self.model_config, self.max_lora_rank,
                                       self.dtype)
            except Exception:
                if new:  # an adapter that does not load is not registered either
                    with self._lock:
                        self.registered.pop(request.lora_name, None)
                raise
        with self._lock:
            stored = self.loaded.setdefault(request.lora_name, weights)
            self.num_loads += fresh and stored is weights
            weights = stored
            self.loaded.move_to_end(request.lora_name)
            self.pins[request.lora_name] = self.pins.get(request.lora_name, 0) + 1
            self._evict()
            return weights

    def release(self, name: str) -> None:
        with self._lock:
            self.pins[name] -= 1
            if not self.pins[name]:
                del self.pins[name]
            self._evict()

    def _evict(self) -> None:
        for name in list(self.loaded):
            if len(self.loaded) <= self.max_cpu_loras:
                break
            if not self.pins.get(name):
                del self.loaded[name]
