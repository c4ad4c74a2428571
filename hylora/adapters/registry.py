"""Adapters by name: validated at load, kept in a CPU LRU cache, placed into device slots on use.

Device side: every LoRA-capable linear — of the text decoder and, when the model has one, of the
vision tower — gets a `LoRAStack` of `max_loras` slots padded to `max_lora_rank`; an adapter's
decoder and tower LoRA share its one slot. A request acquires a lease on the adapter *version*
current when it starts; reload under the same name makes a new version for new requests while
running ones keep theirs, and unload hides the name at once but frees the slot only when the last
lease is released. So neither ever changes the weights under a running request.

File I/O never happens on the engine thread: `prepare` (called from a worker thread) reads an
adapter evicted from the CPU cache back from disk, and the request carries the tensors until
`acquire` places them. A file that changed or vanished since loading marks the version broken:
requests for it fail with a clear error until it is loaded again.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import torch

from hylora.adapters.files import (
    AdapterError,
    LoRAAdapter,
    LoRAWeight,
    max_adapter_bytes,
    parse_adapter,
    read_adapter_files,
)
from hylora.lora import LoRAStack
from hylora.model.decoder import HybridDecoder
from hylora.model.layers import Linear
from hylora.model.packing import locate
from hylora.model.vision import VisionLinear

log = logging.getLogger(__name__)


class UnknownAdapter(KeyError):
    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])


class NoFreeLoRASlot(RuntimeError):
    """Every device slot is held by running requests; retry when one finishes."""


class AdapterBroken(AdapterError):
    """The adapter's files changed or disappeared after it was loaded; load it again."""


@dataclass(eq=False)
class AdapterVersion:
    name: str
    version: int
    path: Path
    digest: str  # sha256 of the weights file, to re-read it safely after CPU eviction
    max_rank: int
    # LoRA on the vision tower: its tower outputs differ from the base tower's (encoder-cache key)
    has_tower_lora: bool = False
    pinned: bool = False
    leases: int = 0
    slot: int | None = None
    retired: bool = False  # replaced by a reload or unloaded
    unloaded: bool = False  # removed by name: requests that have not started on it fail
    broken: str | None = None  # why its files can no longer be read


@dataclass
class PreparedAdapter:
    """An adapter version with its tensors in host memory, ready to be placed without I/O."""

    version: AdapterVersion
    adapter: LoRAAdapter


@dataclass
class AdapterLease:
    version: AdapterVersion
    released: bool = field(default=False)

    @property
    def slot(self) -> int:
        assert self.version.slot is not None, "a leased adapter always has a device slot"
        return self.version.slot

    @property
    def name(self) -> str:
        return self.version.name

    @property
    def tower_slot(self) -> int:
        """The slot to pass the vision tower for this request's media: -1 (the base tower) unless
        the adapter has tower LoRA."""
        return self.slot if self.version.has_tower_lora else -1


class AdapterRegistry:
    def __init__(
        self,
        model: HybridDecoder,
        max_loras: int = 4,
        max_lora_rank: int = 64,
        max_cpu_loras: int | None = None,
    ):
        if max_loras < 1 or max_lora_rank < 1:
            raise ValueError("max_loras and max_lora_rank must be at least 1")
        self.model = model
        self.config = model.config
        self.max_loras, self.max_lora_rank = max_loras, max_lora_rank
        self.max_cpu_loras = max(max_cpu_loras or 2 * max_loras, 1)
        self._lock = threading.RLock()
        self._current: dict[str, AdapterVersion] = {}
        self._slots: list[AdapterVersion | None] = [None] * max_loras
        self._slot_lru: OrderedDict[int, None] = OrderedDict()  # least recently used slot first
        self._cpu: OrderedDict[int, LoRAAdapter] = OrderedDict()  # id(version) → tensors, LRU
        self._versions = 0
        self._max_file_bytes = max_adapter_bytes(self.config, max_lora_rank)
        # every LoRA-capable module by its name in the model: `layers.0.mlp.gate_up_proj`, `visual.blocks.0.attn.qkv`
        # (not the MTP layer's: speculation drafts on the base weights, model/mtp.py)
        self._linears: dict[str, Linear | VisionLinear] = {
            name: m
            for name, m in model.named_modules()
            if isinstance(m, Linear | VisionLinear) and not name.startswith("mtp.")
        }
        for linear in self._linears.values():
            linear.lora = self._new_stack(linear)
            if linear.weight.is_cuda:
                # Linear.stack_lora_a moved the weight into a larger buffer: hand its first home back
                # to the driver now, before the caching allocator splits it for the next stacks and
                # keeps most of a second copy of the weights out of the KV cache's reach.
                torch.cuda.empty_cache()

    # --- loading ---------------------------------------------------------------------------
    def load(self, name: str, path: str | Path, pin: bool = False) -> AdapterVersion:
        """Read and validate an adapter and register it under `name`. Loading a name that exists
        is a reload: new requests get the new version, running ones finish on the old."""
        path = Path(path)
        files = read_adapter_files(path, self._max_file_bytes)
        adapter = parse_adapter(files, self.config, name)
        if adapter.max_rank > self.max_lora_rank:
            raise AdapterError(
                f"adapter {name!r} has rank {adapter.max_rank}, above max_lora_rank {self.max_lora_rank}; "
                "start the server with a larger --max-lora-rank"
            )
        if adapter.has_tower and self.model.visual is None:
            log.info(
                "adapter %r has LoRA on the vision tower; this model was loaded without its tower (text only), "
                "so only its decoder LoRA can ever apply",
                name,
            )
        with self._lock:
            self._versions += 1
            version = AdapterVersion(
                name=name,
                version=self._versions,
                path=path,
                digest=files.digest,
                max_rank=adapter.max_rank,
                has_tower_lora=adapter.has_tower,
                pinned=pin,
            )
            old = self._current.get(name)
            self._current[name] = version
            self._cache(version, adapter)
            if old is not None:
                self._retire(old)
            return version

    def unload(self, name: str) -> None:
        """Remove `name` for new requests; requests already running on it finish normally."""
        with self._lock:
            version = self._current.pop(name, None)
            if version is None:
                raise UnknownAdapter(f"no adapter named {name!r} is loaded")
            version.unloaded = True
            self._retire(version)

    def pin(self, name: str, pinned: bool = True) -> None:
        """A pinned adapter is never evicted from the CPU cache or from its device slot."""
        with self._lock:
            self.get(name).pinned = pinned

    def get(self, name: str) -> AdapterVersion:
        with self._lock:
            if name not in self._current:
                known = ", ".join(sorted(self._current)) or "none"
                raise UnknownAdapter(f"no adapter named {name!r} is loaded (loaded: {known})")
            return self._current[name]

    def names(self) -> list[str]:
        with self._lock:
            return sorted(self._current)

    # --- use by requests -------------------------------------------------------------------
    def prepare(self, name: str) -> PreparedAdapter:
        """The current version of `name` with its tensors in host memory. May read the file again
        (after CPU-cache eviction), so call it off the engine thread."""
        with self._lock:
            version = self.get(name)
            if version.broken:
                raise AdapterBroken(version.broken)
            adapter = self._cpu.get(id(version))
            if adapter is not None:
                self._cpu.move_to_end(id(version))
                return PreparedAdapter(version, adapter)
        try:
            files = read_adapter_files(version.path, self._max_file_bytes)
            if files.digest != version.digest:
                raise AdapterError(f"{version.path} changed on disk since it was loaded")
            adapter = parse_adapter(files, self.config, name)
        except AdapterError as e:
            with self._lock:
                version.broken = (
                    f"adapter {name!r} cannot be served any more: {e}; load it again "
                    "(/v1/load_lora_adapter) to serve the files now on disk"
                )
            raise AdapterBroken(version.broken) from None
        with self._lock:
            self._cache(version, adapter)
        return PreparedAdapter(version, adapter)

    def acquire(self, adapter: str | PreparedAdapter) -> AdapterLease:
        """Lease an adapter version for one request and make sure it is on the device. Given a
        name, the current version is prepared first (file I/O: tests and offline use only)."""
        prepared = self.prepare(adapter) if isinstance(adapter, str) else adapter
        with self._lock:
            version = prepared.version
            if version.unloaded:
                raise UnknownAdapter(f"adapter {version.name!r} was unloaded before this request started")
            if version.slot is None:
                self._place(version, prepared.adapter)
            version.leases += 1
            self._slot_lru.move_to_end(version.slot)  # type: ignore[arg-type]
            return AdapterLease(version)

    def release(self, lease: AdapterLease) -> None:
        with self._lock:
            if lease.released:
                return
            lease.released = True
            version = lease.version
            version.leases -= 1
            if version.retired and version.leases == 0:
                self._evict_slot(version)

    # --- introspection ---------------------------------------------------------------------
    def stats(self) -> dict[str, object]:
        with self._lock:
            on_device = [v.name for v in self._slots if v is not None and not v.retired]
            return {
                "loaded": sorted(self._current),
                "on_device": sorted(on_device),
                "on_cpu": len(self._cpu),
                "slots_total": self.max_loras,
                "slots_used": sum(v is not None for v in self._slots),
                "leases": {v.name: v.leases for v in self._current.values()},
            }

    def slot_of(self, name: str) -> int | None:
        with self._lock:
            return self.get(name).slot

    # --- internals -------------------------------------------------------------------------
    def _new_stack(self, linear: Linear | VisionLinear) -> LoRAStack:
        dev, r = linear.weight.device, self.max_lora_rank
        dtype = linear.dtype if isinstance(linear, Linear) else linear.weight.dtype
        offsets = linear.slice_offsets if isinstance(linear, Linear) else [(0, linear.out_features)]
        if isinstance(linear, Linear):  # A stacked under the base weight: decode's shrink rides in its GEMM
            a = linear.stack_lora_a(self.max_loras, r)
        else:
            a = [torch.zeros(self.max_loras, r, linear.in_features, device=dev, dtype=dtype) for _ in offsets]
        return LoRAStack(
            a=a,
            b=[torch.zeros(self.max_loras, r, rows, device=dev, dtype=dtype) for _, rows in offsets],
            offsets=offsets,
            present=[[False] * len(offsets) for _ in range(self.max_loras)],
        )

    def _retire(self, version: AdapterVersion) -> None:
        version.retired = True
        self._cpu.pop(id(version), None)
        if version.leases == 0:
            self._evict_slot(version)

    def _cache(self, version: AdapterVersion, adapter: LoRAAdapter) -> None:
        self._cpu[id(version)] = adapter
        self._cpu.move_to_end(id(version))
        self._trim_cpu(keep=id(version))

    def _trim_cpu(self, keep: int | None = None) -> None:
        """Drop least recently used tensors beyond max_cpu_loras; pinned and on-device versions stay
        (a request for them then never needs the disk)."""
        kept = {id(v) for v in self._current.values() if v.pinned} | {id(v) for v in self._slots if v is not None}
        for key in list(self._cpu):
            if len(self._cpu) <= self.max_cpu_loras:
                break
            if key not in kept and key != keep:
                del self._cpu[key]

    def _place(self, version: AdapterVersion, adapter: LoRAAdapter) -> None:
        slot = next((i for i, v in enumerate(self._slots) if v is None), None)
        if slot is None:
            slot = next(
                (s for s in self._slot_lru if (v := self._slots[s]) is not None and v.leases == 0 and not v.pinned),
                None,
            )
            if slot is None:
                raise NoFreeLoRASlot(
                    f"all {self.max_loras} LoRA slots hold adapters of running requests or pinned adapters"
                )
            self._evict_slot(self._slots[slot])  # type: ignore[arg-type]
        for (layer, sub, module), w in adapter.weights.items():
            fused, index = locate(sub, module)
            self._write(f"layers.{layer}.{sub}.{fused}", index, slot, w)
        if self.model.visual is not None:  # without a tower no media are encoded: nothing to place
            for module, w in adapter.tower.items():
                self._write(f"visual.{module}", 0, slot, w)
        self._slots[slot] = version
        version.slot = slot
        self._slot_lru[slot] = None

    def _write(self, module: str, index: int, slot: int, w: LoRAWeight) -> None:
        stack = self._linears[module].lora
        assert stack is not None
        r = w.a.shape[0]
        stack.a[index][slot].zero_()  # the slot was cleared on eviction; zero the padding anyway
        stack.b[index][slot].zero_()
        stack.a[index][slot, :r] = w.a.to(stack.a[index].dtype)
        stack.b[index][slot, :r] = (w.b * w.scale).T.to(stack.b[index].dtype)
        stack.present[slot][index] = True

    def _evict_slot(self, version: AdapterVersion) -> None:
        slot = version.slot
        if slot is None:
            return
        for linear in self._linears.values():
            if linear.lora is not None and any(linear.lora.present[slot]):
                linear.lora.clear_slot(slot)
        self._slots[slot] = None
        self._slot_lru.pop(slot, None)
        version.slot = None
        self._trim_cpu()
