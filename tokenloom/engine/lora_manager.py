"""Which LoRA adapters exist and are loaded, by name: one state machine per name, owned here, and vLLM's
`max_cpu_loras` cache with its least recently used eviction, never evicting one a request pins.

A name's states (`state(name)`):

    gone --register--> registered --(first pin reads its files)--> loading --> ready
    ready --(evicted past max_cpu_loras, unpinned)--> registered  (a later pin reads the files again)
    registered / ready --unregister, no pins, not loading--> gone

A pin (`pin`, `acquire`) is taken under the same lock `unregister` checks: the server pins an adapter
when it admits a request for it (`admit`, before the request reaches the engine), the engine pins it
again when it adds the request (`acquire`) and releases it when the request goes; the server then drops
its admission pin. `unregister` of a name with any pin or a load under way raises `AdapterBusy` (the
server's 409): unloading never waits for requests to drain, so there is no draining state. One name is
one adapter (asking for it again with another id or path is an error). With `auto_register` off (the
server), only `register` / `load` add a name: nothing a request does registers a name the operator
unloaded. Offline (`LLM`, `LLMEngine.add_request`) the engine's `acquire` registers new names itself.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import torch

from ..model.config import ModelConfig
from ..model.lora import LoRARequest, LoRAWeights, load_adapter

GONE, REGISTERED, LOADING, READY = "gone", "registered", "loading", "ready"


class AdapterBusy(ValueError):
    """Unregistering a name that requests pin or whose files are being read (the server's 409)."""


class AdapterGone(ValueError):
    """A name that is not (or no longer) registered, where registering it is not this caller's to do."""


class AdapterManager:
    def __init__(self, model_config: ModelConfig, max_cpu_loras: int, max_lora_rank: int,
                 dtype: torch.dtype = torch.float32, auto_register: bool = True):
        self.model_config, self.max_cpu_loras, self.max_lora_rank, self.dtype = (
            model_config, max_cpu_loras, max_lora_rank, dtype)
        self.auto_register = auto_register
        self.registered: dict[str, LoRARequest] = {}
        self.loaded: OrderedDict[str, LoRAWeights] = OrderedDict()  # least recently used first
        self.pins: dict[str, int] = {}
        self.loading: dict[str, int] = {}  # name -> readers of its files now
        self.num_loads = 0
        self._lock = threading.Lock()  # the server admits and loads off the engine thread

    def state(self, name: str) -> str:
        with self._lock:
            return self._state(name)

    def _state(self, name: str) -> str:
        if name not in self.registered:
            return GONE
        if name in self.loaded:
            return READY
        return LOADING if self.loading.get(name) else REGISTERED

    def register(self, request: LoRARequest) -> bool:
        """Whether the name is new (False: registered before, as the same adapter)."""
        with self._lock:
            return self._register(request)

    def _register(self, request: LoRARequest) -> bool:
        known = self.registered.get(request.lora_name)
        if known is not None and known != request:
            raise ValueError(f"lora_name: {request.lora_name!r} is already registered as id {known.lora_int_id}")
        if known is None:
            for other in self.registered.values():
                if other.lora_int_id == request.lora_int_id:
                    raise ValueError(f"lora_int_id: {request.lora_int_id} is already {other.lora_name!r}")
            self.registered[request.lora_name] = request
        return known is None

    def unregister(self, name: str) -> None:
        """registered / ready -> gone; KeyError if gone already, AdapterBusy if pinned or loading."""
        with self._lock:
            if name not in self.registered:
                raise KeyError(name)
            if self.loading.get(name):
                raise AdapterBusy(f"lora adapter {name!r} is being loaded; retry when it is ready")
            if self.pins.get(name):
                raise AdapterBusy(f"lora adapter {name!r} has {self.pins[name]} request(s) in flight or being "
                                  "admitted; retry when they have finished")
            del self.registered[name]
            self.loaded.pop(name, None)

    def load(self, request: LoRARequest) -> LoRAWeights:
        """The operator's load: register and read an adapter without leaving it pinned (the server does
        this off the engine thread, so a request's `acquire` finds it loaded). A new name whose files do
        not load is not left registered."""
        with self._lock:
            new = self._register(request)
            self._pin(request.lora_name)
        try:
            return self._weights(request, new)
        finally:
            self.release(request.lora_name)

    def admit(self, name: str) -> LoRARequest:
        """Pin a registered name for a request being admitted (the server, before the engine has it);
        AdapterGone if it is not registered. `release` ends it."""
        with self._lock:
            request = self.registered.get(name)
            if request is None:
                raise AdapterGone(f"lora adapter {name!r} is not loaded (it was unloaded)")
            self._pin(name)
            return request

    def ensure_loaded(self, name: str) -> LoRAWeights:
        """The weights of a name the caller pins (`admit`), read from its files if not in memory."""
        with self._lock:
            request = self.registered[name]
        return self._weights(request, False)

    def acquire(self, request: LoRARequest) -> LoRAWeights:
        """The adapter's weights, loaded if needed, pinned until `release` (the engine, per request)."""
        with self._lock:
            known = self.registered.get(request.lora_name)
            if known is None and not self.auto_register:
                raise AdapterGone(f"lora adapter {request.lora_name!r} is not loaded (it was unloaded)")
            new = self._register(request)
            self._pin(request.lora_name)
        try:
            return self._weights(request, new)
        except BaseException:
            self.release(request.lora_name)
            raise

    def _pin(self, name: str) -> None:
        self.pins[name] = self.pins.get(name, 0) + 1

    def _weights(self, request: LoRARequest, new: bool) -> LoRAWeights:
        """The pinned adapter's weights; its files are read outside the lock (the engine's lookups must not
        wait on a file), and while they are it is `loading`."""
        name = request.lora_name
        with self._lock:
            weights = self.loaded.get(name)
            if weights is not None:
                self.loaded.move_to_end(name)
                return weights
            self.loading[name] = self.loading.get(name, 0) + 1
        try:
            weights = load_adapter(request.lora_path, name, self.model_config, self.max_lora_rank, self.dtype)
        except BaseException:
            with self._lock:
                self._done_loading(name)
                if new and self.pins.get(name, 0) <= 1 and not self.loading.get(name):
                    self.registered.pop(name, None)  # an adapter that does not load is not registered either
            raise
        with self._lock:
            self._done_loading(name)
            stored = self.loaded.setdefault(name, weights)
            self.num_loads += stored is weights
            self.loaded.move_to_end(name)
            self._evict()
            return stored

    def _done_loading(self, name: str) -> None:
        self.loading[name] -= 1
        if not self.loading[name]:
            del self.loading[name]

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
