"""The adapters of one engine: registered on the host, a bounded number resident in device slots.

Every registered adapter's weights stay in host memory; `max_loras` of them at a time are copied
into the device slots of the model's `LoRALinear` layers. A step that needs an adapter that is not
resident evicts the least recently used resident one that the step does not need (paging in costs a
copy of the adapter's matrices, about `2 * rank * (in + out)` numbers per projection). The scheduler
never runs more distinct adapters at once than there are slots (`Scheduler.max_adapters`).

An adapter removed while requests still use it stays until the last of them finishes: unloading
never breaks a generation in flight. Not thread-safe: the engine thread owns it.
"""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch import nn

from backends.torch_llm.lora.layers import LoRABatch, LoRALinear
from backends.torch_llm.lora.weights import TARGETABLE, LoRAAdapter


def wrap_projections(
    model: nn.Module, *, num_slots: int, max_rank: int
) -> tuple[LoRABatch, dict[str, LoRALinear]]:
    """Wrap every targetable projection of the decoder in a `LoRALinear` sharing one `LoRABatch`."""
    batch = LoRABatch()
    wrapped: dict[str, LoRALinear] = {}
    for layer_index, layer in enumerate(model.model.layers):
        for part_name in ("self_attn", "mlp"):
            part = getattr(layer, part_name)
            for proj in TARGETABLE:
                base = getattr(part, proj, None)
                if base is None:
                    continue
                lora = LoRALinear(
                    base,
                    base.in_features,
                    base.out_features,
                    num_slots=num_slots,
                    max_rank=max_rank,
                    batch=batch,
                )
                setattr(part, proj, lora)
                wrapped[f"model.layers.{layer_index}.{part_name}.{proj}"] = lora
    return batch, wrapped


class LoRAPool:
    """Adapters by name, their device slots and how many requests use each.

    Args:
        model: the loaded model; its projections are wrapped here.
        max_loras: adapters resident on the device at once.
        max_rank: the largest rank an adapter may have.
    """

    def __init__(self, model: nn.Module, *, max_loras: int, max_rank: int) -> None:
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.batch, self._layers = wrap_projections(model, num_slots=max_loras + 1, max_rank=max_rank)
        self._adapters: dict[str, LoRAAdapter] = {}
        self._removed: set[str] = set()
        self._users: dict[str, int] = {}
        #: resident adapter -> slot, least recently used first
        self._resident: OrderedDict[str, int] = OrderedDict()
        #: bumped on every (re)registration, so a reloaded adapter never reuses another's cached KV
        self._versions: dict[str, int] = {}
        self._next_version = 0
        self.num_page_ins = 0

    # --- registry ------------------------------------------------------------------------------

    def names(self) -> list[str]:
        """Adapters new requests may use (removed ones still finishing are not listed)."""
        return sorted(n for n in self._adapters if n not in self._removed)

    def has(self, name: str) -> bool:
        return name in self._adapters and name not in self._removed

    def add(self, adapter: LoRAAdapter) -> None:
        """Register an adapter under a name no registered adapter holds.

        Replacing weights in place would change requests in flight mid-generation (their KV was
        computed with the old weights), so a name is free again only once it was removed and its last
        request ended.
        """
        if adapter.name in self._adapters:
            state = (
                "is loaded" if self.has(adapter.name) else "was unloaded but still serves requests in flight"
            )
            raise ValueError(
                f"adapter {adapter.name!r} {state}; unload it and load it again once its requests end"
            )
        if adapter.max_rank > self.max_rank:
            raise ValueError(
                f"adapter {adapter.name!r} has rank {adapter.max_rank} > max_lora_rank {self.max_rank}"
            )
        unknown = sorted(set(adapter.weights) - set(self._layers))
        if unknown:
            raise ValueError(
                f"adapter {adapter.name!r} adapts modules the model does not have: {unknown[:3]}"
            )
        self._adapters[adapter.name] = adapter
        self._next_version += 1
        self._versions[adapter.name] = self._next_version

    def cache_scope(self, name: str) -> str:
        """The prefix-cache namespace of `name`'s current weights (KV of one adapter is another's miss)."""
        return f"lora:{name}#{self._versions[name]}"

    def remove(self, name: str) -> bool:
        """Stop new requests from using `name`; its weights go once no request uses them."""
        if not self.has(name):
            return False
        self._removed.add(name)
        self._drop_if_unused(name)
        return True

    # --- requests ------------------------------------------------------------------------------

    def acquire(self, name: str) -> None:
        """A request starts using `name` (which must be registered and not removed)."""
        if not self.has(name):
            raise ValueError(f"adapter {name!r} is not loaded")
        self._users[name] = self._users.get(name, 0) + 1

    def release(self, name: str) -> None:
        left = self._users.get(name, 0) - 1
        if left > 0:
            self._users[name] = left
        else:
            self._users.pop(name, None)
            self._drop_if_unused(name)

    def _drop_if_unused(self, name: str) -> None:
        if name in self._removed and not self._users.get(name):
            self._adapters.pop(name, None)
            self._removed.discard(name)
            slot = self._resident.pop(name, None)
            if slot is not None:
                for layer in self._layers.values():
                    layer.set_slot(slot, None)

    # --- device slots --------------------------------------------------------------------------

    def activate(self, names: set[str]) -> dict[str, int]:
        """Make `names` resident (paging in and evicting as needed) and return their slots.

        Raises:
            ValueError: more adapters than slots (the scheduler prevents it).
        """
        if len(names) > self.max_loras:
            raise ValueError(f"{len(names)} adapters in one step; only {self.max_loras} fit the device")
        slots: dict[str, int] = {}
        for name in names:
            slot = self._resident.get(name)
            if slot is None:
                slot = self._free_slot(names)
                self._page_in(name, slot)
            self._resident.move_to_end(name)
            slots[name] = slot
        return slots

    def _free_slot(self, keep: set[str]) -> int:
        used = set(self._resident.values())
        for slot in range(1, self.max_loras + 1):
            if slot not in used:
                return slot
        for name in self._resident:  # least recently used first
            if name not in keep:
                return self._resident.pop(name)
        raise AssertionError("no slot to evict although the step needs fewer adapters than slots")

    def _page_in(self, name: str, slot: int) -> None:
        weights = self._adapters[name].weights
        for module, layer in self._layers.items():
            given = weights.get(module)
            layer.set_slot(slot, None if given is None else _to(given, layer.a_slots))
        self._resident[name] = slot
        self.num_page_ins += 1

    def rank_of(self, names: set[str]) -> int:
        return max((self._adapters[n].max_rank for n in names), default=0)


def _to(
    weights: tuple[torch.Tensor, torch.Tensor, float], like: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, float]:
    a, b, scaling = weights
    return (
        a.to(like.device, like.dtype, non_blocking=True),
        b.to(like.device, like.dtype, non_blocking=True),
        scaling,
    )
