"""Saved-activation offload: what chosen decoder layers keep for their backward waits in pinned host memory.

A layer run through `ActivationOffload.run` has every tensor autograd saves inside it copied to pinned
host memory on a side stream the moment it is saved; the device copy is released once that copy is done
(the caching allocator waits for the side stream before it reuses the memory). In the backward, when the
gradient reaches a later layer named as the trigger, the layer's tensors are copied back on a second
stream while that later layer's backward runs, so the compute stream waits only where the host link is
slower than the layers in between. A tensor needed before its prefetch (no trigger, or the copy is late)
is fetched on the compute stream. Parameters, tensors already on the host and tensors under `MIN_BYTES`
stay where they are. The pinned buffers of one step serve the next (a layer's buffers are handed back when
it runs its forward again), so host memory is pinned once, and exactly: each buffer is page-locked in place
(`pinned_buffer`), not taken from torch's pinned-memory cache, which rounds every block up to a power of two (a
70B layer's input at 73,728 tokens, 1.125 GiB, took 2 GiB there: the host ran out at about half the budget).

Whole storages move, so views, transposes and tensors sharing a storage come back exactly as they were
saved, and a storage saved several times in one layer (the normed input read by three projections) moves
once. On the CPU (tests) the same bookkeeping runs with plain synchronous copies.
"""

from __future__ import annotations

import functools
import weakref

import torch

MIN_BYTES = 1 << 20


def pinned_buffer(nbytes: int) -> torch.Tensor:
    """`nbytes` of page-locked host memory (uint8), registered with the GPU runtime in place and unregistered when
    the tensor is freed."""
    buffer = torch.empty(nbytes, dtype=torch.uint8)
    if nbytes:
        cudart = torch.cuda.cudart()
        status = cudart.cudaHostRegister(buffer.data_ptr(), nbytes, 0)
        if int(status) != 0:
            raise torch.OutOfMemoryError(f"could not page-lock {nbytes / 2**30:.2f} GiB of host memory (runtime error {int(status)})")
        weakref.finalize(buffer, cudart.cudaHostUnregister, buffer.data_ptr())
    return buffer


class _Offloaded:
    """One storage on its way to, in, or back from host memory, and how to view it as the saved tensor."""

    __slots__ = ("host", "copied", "device", "ready", "read", "uses")

    def __init__(self, host: torch.Tensor, copied):
        self.host = host  # uint8, the storage's bytes
        self.copied = copied  # event: host copy done (None on the CPU)
        self.device = None  # uint8 on the device once fetched
        self.ready = None  # event: device copy done, until the last saved tensor on it is unpacked
        self.read = None  # event: the latest copy back done; the host buffer may be reused after it
        self.uses = 0  # saved tensors still to be unpacked


class _View:
    """A saved tensor as a view (dtype, offset, shape, stride) of an offloaded storage."""

    __slots__ = ("storage", "dtype", "offset", "shape", "stride")

    def __init__(self, storage: _Offloaded, tensor: torch.Tensor):
        self.storage = storage
        self.dtype, self.offset = tensor.dtype, tensor.storage_offset()
        self.shape, self.stride = tensor.shape, tensor.stride()


class ActivationOffload:
    """Offloads the tensors saved inside chosen decoder layers and brings them back ahead of their backward."""

    def __init__(self, device: torch.device, parameters):
        self.device = device
        self.on_gpu = device.type == "cuda"
        self.parameter_storages = {p.untyped_storage().data_ptr() for p in parameters}
        self.to_host = torch.cuda.Stream(device) if self.on_gpu else None
        self.to_device = torch.cuda.Stream(device) if self.on_gpu else None
        self.layers: dict[int, list[_Offloaded]] = {}  # layer index -> its storages, from its last forward
        self.spare: dict[int, list[tuple[torch.Tensor, object]]] = {}  # pinned buffers by size, with their last read
        self.bytes_offloaded = 0  # in the last forward of each layer, summed
        self.late_fetches = 0  # storages the compute stream had to fetch itself (not prefetched in time to start)

    def run(self, index: int, fn, *args):
        """`fn(*args)` (a layer's forward, or a checkpoint of it) with what autograd saves sent to the host."""
        for storage in self.layers.pop(index, []):  # the previous step's: their buffers serve this one
            self.bytes_offloaded -= storage.host.numel()
            self.spare.setdefault(storage.host.numel(), []).append((storage.host, storage.read))
        self.layers[index] = []
        # each device storage stays referenced until the layer's forward ends, so that no address is reused
        # (and mistaken for one already saved) before then; autograd keeps the pack hook, so empty it after
        in_this_layer: dict[int, tuple[torch.Tensor, _Offloaded]] = {}
        pack = functools.partial(self._pack, self.layers[index], in_this_layer)
        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, self._unpack):
                return fn(*args)
        finally:
            in_this_layer.clear()

    def prefetch(self, index: int) -> None:
        """Start copying layer `index`'s saved tensors back to the device (no-op for storages already there)."""
        for storage in self.layers.get(index, []):
            if storage.device is not None or storage.uses == 0:
                continue
            if not self.on_gpu:
                storage.device = storage.host.clone()
                continue
            compute = torch.cuda.current_stream(self.device)
            storage.device = torch.empty_like(storage.host, device=self.device)  # allocated for the compute stream
            self.to_device.wait_stream(compute)
            self.to_device.wait_event(storage.copied)
            with torch.cuda.stream(self.to_device):
                storage.device.copy_(storage.host, non_blocking=True)
                storage.ready = torch.cuda.Event()
                storage.ready.record(self.to_device)
                storage.read = storage.ready
            storage.device.record_stream(self.to_device)

    def _offloadable(self, tensor: torch.Tensor) -> bool:
        return (tensor.device == self.device and tensor.layout == torch.strided
                and tensor.untyped_storage().nbytes() >= MIN_BYTES
                and tensor.untyped_storage().data_ptr() not in self.parameter_storages)  # fmt: skip

    def _pack(self, layer: list[_Offloaded], in_this_layer: dict, tensor: torch.Tensor):
        if not self._offloadable(tensor):
            return tensor
        key = tensor.untyped_storage().data_ptr()
        if key not in in_this_layer:
            in_this_layer[key] = (tensor, self._copy_out(tensor))
            layer.append(in_this_layer[key][1])
            self.bytes_offloaded += in_this_layer[key][1].host.numel()
        storage = in_this_layer[key][1]
        storage.uses += 1
        return _View(storage, tensor)

    def _copy_out(self, tensor: torch.Tensor) -> _Offloaded:
        raw = torch.empty(0, dtype=torch.uint8, device=self.device).set_(tensor.untyped_storage())
        spare = self.spare.get(raw.numel())
        # pinning host memory is slow: each buffer is allocated in the first step and reused after
        if spare:
            host, last_read = spare.pop()
        else:
            host = pinned_buffer(raw.numel()) if self.on_gpu else torch.empty(raw.numel(), dtype=torch.uint8)
            last_read = None
        if not self.on_gpu:
            host.copy_(raw)
            return _Offloaded(host, None)
        self.to_host.wait_stream(torch.cuda.current_stream(self.device))
        if last_read is not None:
            self.to_host.wait_event(last_read)
        with torch.cuda.stream(self.to_host):
            host.copy_(raw, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(self.to_host)
        raw.record_stream(self.to_host)
        return _Offloaded(host, copied)

    def _unpack(self, saved):
        if isinstance(saved, torch.Tensor):
            return saved
        storage = saved.storage
        if storage.device is None:  # not prefetched (or unpacked again after its last use): fetch now
            self.late_fetches += 1
            if self.on_gpu:
                torch.cuda.current_stream(self.device).wait_event(storage.copied)
            raw = storage.host.to(self.device, non_blocking=True)
            if self.on_gpu:
                storage.read = torch.cuda.Event()
                storage.read.record(torch.cuda.current_stream(self.device))
        else:
            if storage.ready is not None:
                torch.cuda.current_stream(self.device).wait_event(storage.ready)
            raw = storage.device
        storage.uses -= 1
        if storage.uses <= 0:  # the last saved tensor on this storage: the device copy goes with its user
            storage.device, storage.ready = None, None
        view = torch.empty(0, dtype=saved.dtype, device=self.device)
        return view.set_(raw.untyped_storage(), saved.offset, saved.shape, saved.stride)
