"""The engine's adapters: loaded into host memory (kept least recently used up to
``max_cpu_loras``) and into the model's ``max_loras`` slots for the steps that use them.

An adapter some unfinished request uses is never evicted from host memory (its rows would have
nothing to run with), so host memory holds more than ``max_cpu_loras`` only while more adapters
than that have requests in the engine.
"""

from __future__ import annotations

from collections import Counter, OrderedDict

import torch

from bulkinfer.engine.errors import LoRAAdapterError
from bulkinfer.engine.lora.adapter_config import read_adapter_config
from bulkinfer.engine.lora.request import LoRARequest
from bulkinfer.engine.lora.rows import NO_ADAPTER
from bulkinfer.engine.lora.slots import LoRASlots
from bulkinfer.engine.lora.targets import lora_targets, projection_modules
from bulkinfer.engine.lora.weights import LoadedAdapter, load_adapter
from bulkinfer.engine.models.llama import LlamaForCausalLM


class LoRAManager:
    def __init__(self, model: LlamaForCausalLM, max_loras: int, max_lora_rank: int,
                 max_cpu_loras: int, dtype: torch.dtype, device: torch.device) -> None:
        self.max_loras = max_loras
        self.max_lora_rank = max_lora_rank
        self.max_cpu_loras = max_cpu_loras
        self.dtype = dtype
        self.targets = lora_targets(model)
        modules = projection_modules(model, self.targets)
        fused = Counter(target.projection for target in self.targets.values())
        self.slots: dict[str, LoRASlots] = {}
        for path, linear in modules.items():
            slots = LoRASlots(max_loras, fused[path] * max_lora_rank, linear.in_features, linear.out_features,
                              dtype, device, model.step_rows)
            linear.lora_slots = slots
            slots.use_kernels(model.cpu_kernels)
            self.slots[path] = slots
        # Steps with adapter rows take the native decode path where it can apply the updates.
        if model.native_decode is not None:
            model.native_decode.attach_lora(self.slots)
        self._out_features = {path: linear.out_features for path, linear in modules.items()}
        self._host: OrderedDict[int, LoadedAdapter] = OrderedDict()  # least recently used first
        self._live = Counter[int]()  # unfinished requests per adapter id
        self._slot_of: dict[int, int] = {}
        self._slot_adapter: list[int | None] = [None] * max_loras
        self._slot_used: list[int] = [0] * max_loras  # step number of its last use (slot LRU)
        self._step = 0
        self._step_slots: set[int] = set()  # slots this step's rows read
        # Async scheduling: the step in flight still reads its slots while the next one is prepared,
        # so those are not reloaded either (the engine sets this where steps overlap).
        self.keep_in_flight_slots = False
        self._in_flight_slots: set[int] = set()

    # ---- host memory -----------------------------------------------------------------------------

    def load(self, request: LoRARequest) -> LoadedAdapter:
        """The adapter in host memory (read and validated on first use); raises LoRAAdapterError."""
        adapter = self._host.get(request.lora_int_id)
        if adapter is not None:
            if (adapter.name, adapter.path) != (request.lora_name, request.lora_path):
                raise LoRAAdapterError(
                    f"LoRA adapter {request.lora_name!r}: lora_int_id {request.lora_int_id} already names "
                    f"adapter {adapter.name!r} ({adapter.path}) in this engine")
            self._host.move_to_end(request.lora_int_id)
            return adapter
        config = read_adapter_config(request.lora_path)
        adapter = load_adapter(request.lora_name, request.lora_int_id, config, self.targets,
                               self._out_features, self.max_lora_rank, self.dtype)
        self._host[request.lora_int_id] = adapter
        self._evict_host(keep=request.lora_int_id)
        return adapter

    def acquire(self, request: LoRARequest) -> None:
        """A request with this adapter entered the engine: load it and keep it until release()."""
        self.load(request)
        self._live[request.lora_int_id] += 1

    def release(self, request: LoRARequest) -> None:
        self._live[request.lora_int_id] -= 1
        if self._live[request.lora_int_id] <= 0:
            del self._live[request.lora_int_id]
            self._evict_host()

    @property
    def host_adapter_ids(self) -> list[int]:
        """Adapters in host memory, least recently used first."""
        return list(self._host)

    def _evict_host(self, keep: int | None = None) -> None:
        """Least recently used first, adapters in no slot before slotted ones; never `keep` (the one
        being loaded) nor one a live request uses."""
        for lora_id in list(self._host):
            if len(self._host) <= self.max_cpu_loras:
                return
            if lora_id not in self._live and lora_id not in self._slot_of and lora_id != keep:
                del self._host[lora_id]
        # A slotted adapter no request uses may leave too: its slot is rewritten before reuse.
        for lora_id in list(self._host):
            if len(self._host) <= self.max_cpu_loras:
                return
            if lora_id not in self._live and lora_id != keep:
                self._free_slot(lora_id)
                del self._host[lora_id]

    # ---- slots -----------------------------------------------------------------------------------

    def begin_step(self) -> None:
        self._step += 1
        self._in_flight_slots = self._step_slots if self.keep_in_flight_slots else set()
        self._step_slots = set()

    def slot_of(self, request: LoRARequest | None) -> int:
        """This step's slot for the adapter (loading it into the least recently used slot not used
        by this step, nor by the step in flight, where it has none); NO_ADAPTER for the base model."""
        if request is None:
            return NO_ADAPTER
        lora_id = request.lora_int_id
        slot = self._slot_of.get(lora_id)
        if slot is None:
            busy = self._step_slots | self._in_flight_slots
            free = [s for s in range(self.max_loras) if s not in busy]
            if not free:  # the scheduler admits at most max_loras adapters (in flight counted): a bug
                raise RuntimeError(f"more than max_loras={self.max_loras} adapters in one step")
            slot = min(free, key=lambda s: (self._slot_adapter[s] is not None, self._slot_used[s]))
            previous = self._slot_adapter[slot]
            if previous is not None:
                del self._slot_of[previous]
            adapter = self.load(request)
            for path, slots in self.slots.items():
                slots.load(slot, adapter.projections.get(path))
            self._slot_of[lora_id], self._slot_adapter[slot] = slot, lora_id
        self._step_slots.add(slot)
        self._slot_used[slot] = self._step
        return slot

    def _free_slot(self, lora_id: int) -> None:
        slot = self._slot_of.pop(lora_id, None)
        if slot is not None:
            self._slot_adapter[slot] = None
