"""The paged KV cache: keys and values in blocks of BLOCK positions, handed to a sequence as its
tokens arrive and taken back when it ends, so the memory a server holds follows the tokens it holds,
not max_batch x context (vLLM's PagedAttention layout; llama.cpp keeps cells in one ring instead).

One block holds BLOCK positions of every layer's K and V ([layers, 2, kv heads, BLOCK, head size],
contiguous), so a freed block is one range to hand back to the OS. The pool is reserved as virtual
memory and the OS supplies pages when a block is first written (on a GPU the pool is allocated
whole). Each sequence has a block table: its i-th block holds positions [i * BLOCK, (i + 1) * BLOCK).

Two readers: the model's attention modules (`LayerKV.update`: writes the new positions, gathers the
sequence's keys and values so far) and the fused C++ decode stack, which reads the blocks in place
through the block table (hardy.infer.fused_decode).
"""
from __future__ import annotations

import heapq
import mmap
from dataclasses import dataclass

import torch

from hardy.devices import DTYPES
from hardy.errors import HardyError

BLOCK = 32  # positions per block: a 64-wide bf16 head's keys for one block are one 4 KB page
KV_DTYPES = DTYPES  # "fp32" / "bf16" / "fp16" (hardy.devices: the one name map)
MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000)  # Linux: no swap reserved for untouched pages


@dataclass(frozen=True)
class KVLayout:
    layers: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def bytes_per_token(self) -> int:
        return self.layers * 2 * self.kv_heads * self.head_dim * self.dtype.itemsize

    @property
    def block_bytes(self) -> int:
        return BLOCK * self.bytes_per_token


def kv_layout(model, dtype: torch.dtype) -> KVLayout:
    heads = set(model.local_kv_heads())
    if len(heads) != 1:
        raise HardyError(f"the paged KV cache needs one KV head count for every layer (this model: {sorted(heads)})")
    return KVLayout(len(model.layers), heads.pop(), model.layers[0].attention.head_dim, dtype)


def _reserve(nbytes: int, dtype: torch.dtype, device: torch.device):
    """(tensor of nbytes, its mapping): virtual memory the OS backs page by page as it is written."""
    if device.type != "cpu":
        return torch.empty(nbytes // dtype.itemsize, dtype=dtype, device=device), None
    region = mmap.mmap(-1, max(nbytes, mmap.PAGESIZE), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_NORESERVE)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        region.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(region, dtype=dtype, count=nbytes // dtype.itemsize), region


class KVPool:
    """`capacity` blocks for `sequences` sequences of up to `max_len` positions each."""

    def __init__(self, layout: KVLayout, sequences: int, max_len: int, capacity: int, device="cpu"):
        self.layout, self.sequences, self.max_len = layout, sequences, max_len
        self.capacity = capacity
        self.device = torch.device(device)
        flat, self._region = _reserve(capacity * layout.block_bytes, layout.dtype, self.device)
        # [block, layer, k/v, kv head, position in block, head size]
        self.blocks = flat.view(capacity, layout.layers, 2, layout.kv_heads, BLOCK, layout.head_dim)
        self.per_sequence = -(-max_len // BLOCK)
        self.tables = torch.zeros(sequences, self.per_sequence, dtype=torch.int32)  # on the CPU: the kernels' index
        self.held: list[list[int]] = [[] for _ in range(sequences)]
        self._free = list(range(capacity))  # a heap: the lowest free block first, so touched memory stays compact
        self._tables_on_device = None

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    def positions(self, seq: int) -> int:
        """Positions sequence `seq` has blocks for."""
        return len(self.held[seq]) * BLOCK

    def reserve(self, seq: int, length: int) -> None:
        """Blocks for positions [0, length) of sequence `seq` (taking only the ones it lacks)."""
        if length > self.max_len:
            raise HardyError(f"a sequence of {length} positions exceeds the KV cache's {self.max_len}")
        need = -(-length // BLOCK) - len(self.held[seq])
        if need <= 0:
            return
        if need > len(self._free):
            raise HardyError(f"the KV cache is full: {need} more blocks needed, {len(self._free)} free of {self.capacity}")
        for _ in range(need):
            block = heapq.heappop(self._free)
            self.tables[seq, len(self.held[seq])] = block
            self.held[seq].append(block)
        self._tables_on_device = None

    def release(self, seq: int) -> None:
        """Give sequence `seq`'s blocks back (their memory to the OS)."""
        for block in self.held[seq]:
            heapq.heappush(self._free, block)
            self._discard(block)
        self.held[seq] = []

    def _discard(self, block: int) -> None:
        if self._region is None:
            return
        size, page = self.layout.block_bytes, mmap.PAGESIZE
        begin, end = -(-block * size // page) * page, (block + 1) * size // page * page  # whole pages inside
        if end > begin:
            self._region.madvise(mmap.MADV_DONTNEED, begin, end - begin)

    def device_tables(self) -> torch.Tensor:
        if self._tables_on_device is None:
            self._tables_on_device = self.tables.to(self.device, dtype=torch.long)
        return self._tables_on_device


class LayerKV:
    """One layer's view of the pool for the model's attention (`Attention.kv_cache`): the rows of the
    current forward pass are the pool sequences in `cache.rows`."""

    def __init__(self, cache: "PagedKVCache", layer: int):
        self.cache, self.layer = cache, layer

    def update(self, start: int | torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k/v [rows, heads, new, head size] at positions `start` ... (an int for all rows, or one
        position per row); return each row's keys and values from position 0 to the last written, in
        k's dtype (rows shorter than the longest are padded; the caller's mask hides it)."""
        pool = self.cache.pool
        rows = self.cache.rows
        tables = pool.device_tables()[rows]  # [rows, blocks per sequence]
        if isinstance(start, torch.Tensor):
            positions = start[:, None].to(torch.long)  # [rows, 1]
        else:
            positions = torch.arange(start, start + k.shape[2], device=k.device)[None, :].expand(k.shape[0], -1)
        end = int(positions.max()) + 1
        block = tables.gather(1, positions // BLOCK)  # [rows, new]
        offset = positions % BLOCK
        blocks = pool.blocks[:, self.layer]  # [block, k/v, heads, BLOCK, head size]
        dtype = pool.layout.dtype
        blocks[block, 0, :, offset] = k.transpose(1, 2).to(dtype)  # [rows, new, heads, head size]
        blocks[block, 1, :, offset] = v.transpose(1, 2).to(dtype)
        used = tables[:, :-(-end // BLOCK)]  # [rows, blocks in use]
        kv = blocks[used]  # [rows, used, k/v, heads, BLOCK, head size]
        kv = kv.permute(2, 0, 3, 1, 4, 5).reshape(2, k.shape[0], kv.shape[3], -1, kv.shape[-1])[:, :, :, :end]
        return kv[0].to(k.dtype), kv[1].to(k.dtype)


class PagedKVCache:
    """The pool attached to a model's attention modules; `rows` says which sequences the next forward
    pass's batch rows are."""

    def __init__(self, model, sequences: int, max_len: int, dtype: torch.dtype = torch.bfloat16,
                 capacity_tokens: int | None = None):
        self.model = model
        layout = kv_layout(model, dtype)
        capacity = -(-(capacity_tokens or sequences * max_len) // BLOCK)
        device = model.rope_cos.device
        self.pool = KVPool(layout, sequences, max_len, capacity, device)
        self.rows = torch.arange(1, device=device)
        for i, layer in enumerate(model.layers):
            layer.attention._modules.pop("kv_cache", None)  # a static cache (an nn.Module) held before
            layer.attention.kv_cache = LayerKV(self, i)
        if model._rope_len < max_len:
            model.reset_rope(max_len)

    def use(self, sequences: list[int] | torch.Tensor) -> None:
        """The pool sequences of the next pass's rows, in order."""
        self.rows = torch.as_tensor(sequences, dtype=torch.long, device=self.pool.device)

    def close(self) -> None:
        self.model.clear_kv_cache()


GiB = 2 ** 30
HEADROOM = 512 * 2 ** 20  # left to the process's own growth (activations, logits, the server) and the OS


def size(nbytes: float) -> str:
    return f"{nbytes / GiB:.2f} GiB" if nbytes >= GiB else f"{nbytes / 2 ** 20:.1f} MiB"


def available_memory(device) -> int:
    """Bytes the KV cache may take on `device`: free GPU memory, or the host's available memory."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0] - HEADROOM
    import psutil  # start-up: only cache sizing reads it

    return psutil.virtual_memory().available - HEADROOM


def model_bytes(model) -> int:
    """What the model's weights hold in memory (parameters and buffers, shared ones once)."""
    seen, total = set(), 0
    for t in [*model.parameters(), *model.buffers()]:
        t = t.to_local() if hasattr(t, "to_local") else t  # a tensor-parallel shard: this process's part
        if t.device.type == "meta":
            continue
        key = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        if key not in seen:
            seen.add(key)
            total += key[1]
    return total


@dataclass(frozen=True)
class KVBudget:
    capacity: int  # tokens the pool holds, over every sequence
    sequences: int
    context: int
    layout: KVLayout

    @property
    def line(self) -> str:
        total = size(self.capacity * self.layout.bytes_per_token)
        dtype = {v: k for k, v in KV_DTYPES.items()}[self.layout.dtype]
        full = self.sequences * self.context
        fewer = "" if self.capacity >= full else (
            f"; memory holds {self.capacity} of the {full} tokens {self.sequences} requests of {self.context} could: "
            "a request waits for blocks while the rest are in use")
        return (f"KV cache {dtype} ({self.layout.bytes_per_token / 1024:.1f} KiB per token): up to {total} for "
                f"{self.capacity} tokens, taken in blocks of {BLOCK} as tokens arrive{fewer}")

    def check(self) -> "KVBudget":
        """This budget, or a one-line error (exit 2) when it cannot hold one request's full context."""
        if self.capacity < self.context:
            per = self.layout.bytes_per_token
            raise HardyError(
                f"the KV cache for one request of {self.context} tokens needs {size(self.context * per)} "
                f"({per / 1024:.1f} KiB per token); memory beside the model holds {size(self.capacity * per)} of it: "
                "lower --context, or use --kv-dtype bf16/fp16")
        return self


def kv_budget(model, sequences: int, context: int, dtype: torch.dtype, available: int | None = None) -> KVBudget:
    """The pool for `sequences` x `context` positions, as much of it as memory allows (`check()` refuses
    one that cannot hold even one sequence's full context: never an out-of-memory kill later)."""
    layout = kv_layout(model, dtype)
    if available is None:
        available = available_memory(model.rope_cos.device)
    fits = max(0, available) // layout.bytes_per_token // BLOCK * BLOCK
    return KVBudget(min(sequences * context, fits), sequences, context, layout)
