"""A GGUF header reader: metadata decoded into Python values, tensors as views of one memory map.

Why not `gguf.GGUFReader`: it builds a numpy memmap view for every part of every field, so a
49k-token vocabulary (SmolLM2) takes ~9 s to open and Llama 3's 128k tokens far longer, where
llama.cpp opens either in well under a second. This reader does the same parsing with `struct` on
the mapped bytes (milliseconds for the vocabulary) and hands out the same tensor views the `gguf`
package's dequantizers take. The `gguf` package stays the writer and the reference kernels.

Layout (little-endian; docs: ggml/docs/gguf.md): magic "GGUF", uint32 version (2 or 3), uint64
tensor count, uint64 key/value count; key/values (string key, uint32 type, value; arrays are uint32
element type + uint64 count + elements); tensor infos (string name, uint32 dims, uint64 × dims
innermost first, uint32 type, uint64 offset); data from the next multiple of general.alignment.
"""
from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

from hardy.errors import HardyError

MAGIC = b"GGUF"
MAX_DIMS = 4  # GGML_MAX_DIMS
FOLIO_REACH = 2 << 20  # the largest page-cache folio a read fault maps whole (one PMD on x86-64)
STRING_CHUNK = 1 << 22
# value type -> (struct format, size); 8 = string, 9 = array
SCALARS = {0: ("<B", 1), 1: ("<b", 1), 2: ("<H", 2), 3: ("<h", 2), 4: ("<I", 4), 5: ("<i", 4), 6: ("<f", 4),
           7: ("<?", 1), 10: ("<Q", 8), 11: ("<q", 8), 12: ("<d", 8)}
NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
         7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
PLAIN_TYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8, "I16": np.int16,
               "I32": np.int32, "I64": np.int64}


@dataclass
class TensorInfo:
    name: str
    tensor_type: object  # gguf.GGMLQuantizationType
    shape: np.ndarray  # dims, innermost first (as GGUF and the gguf package list them)
    data_offset: int  # absolute, in the file
    n_bytes: int
    data: np.ndarray  # a view of the memory map: values (float/int types) or [rows..., row bytes]


class TensorRows:
    """A matrix's mapped pages by rows, for a converter that reads it in parts: each part's pages
    mapped before it is read and dropped after it is written, so a large matrix never holds all of
    its file pages and its converted copy at once."""

    def __init__(self, reader: "GGUFFile", t: TensorInfo):
        self.reader, self.t = reader, t
        self.row_bytes = t.n_bytes // max(1, int(np.prod([int(d) for d in t.shape[1:]])))

    def prefetch(self, r0: int, r1: int) -> None:
        self.reader.prefetch(self.t, r0 * self.row_bytes, r1 * self.row_bytes)

    def release(self, r0: int, r1: int) -> None:
        self.reader.release(self.t, r0 * self.row_bytes, r1 * self.row_bytes)


class _Cursor:
    def __init__(self, buf, path: Path):
        self.buf, self.pos, self.path = buf, 0, path

    def fail(self, what: str):
        raise HardyError(f"{self.path}: not a readable GGUF file ({what} at byte {self.pos})")

    def take(self, n: int):
        if n < 0 or self.pos + n > len(self.buf):
            self.fail("truncated header")
        out = self.buf[self.pos:self.pos + n]
        self.pos += n
        return out

    def scalar(self, vtype: int):
        fmt, size = SCALARS[vtype]
        return struct.unpack(fmt, self.take(size))[0]

    def u32(self) -> int:
        return self.scalar(4)

    def u64(self) -> int:
        return self.scalar(10)

    def string(self) -> str:
        raw = bytes(self.take(self.u64()))
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return raw.decode("utf-8", errors="replace")  # llama.cpp's byte tokens can be lone bytes

    def value(self, vtype: int, depth: int = 0):
        if vtype in SCALARS:
            return self.scalar(vtype)
        if vtype == 8:
            return self.string()
        if vtype != 9 or depth > 2:
            self.fail(f"unknown value type {vtype}")
        etype, count = self.u32(), self.u64()
        if etype in NUMPY:
            size = SCALARS[etype][1]
            if count * size > len(self.buf) - self.pos:
                self.fail(f"array of {count} values past the end")
            return np.frombuffer(self.take(count * size), dtype=NUMPY[etype]).tolist()
        if count > len(self.buf) - self.pos:  # every element takes at least one byte
            self.fail(f"array of {count} elements past the end")
        if etype == 8:
            return self._strings(count)
        return [self.value(etype, depth + 1) for _ in range(count)]

    def _strings(self, count: int) -> list[str]:
        """An array of strings (a vocabulary, merges): the same parsing as `string`, in one tight loop
        over bytes copied from the map a few MB at a time (slicing the map per string costs more)."""
        buf, pos, end, out = self.buf, self.pos, len(self.buf), []
        length = struct.Struct("<Q").unpack_from
        base, chunk = pos, b""
        for _ in range(count):
            if pos + 8 > base + len(chunk):
                base, chunk = pos, bytes(buf[pos:pos + STRING_CHUNK])
                if len(chunk) < 8:
                    self.pos = pos
                    self.fail("truncated header")
            n = length(chunk, pos - base)[0]
            pos += 8
            if n > end - pos:
                self.pos = pos
                self.fail("truncated header")
            if pos + n > base + len(chunk):
                base, chunk = pos, bytes(buf[pos:pos + max(n, STRING_CHUNK)])
            raw = chunk[pos - base:pos - base + n]
            pos += n
            try:
                out.append(raw.decode("utf-8"))
            except UnicodeDecodeError:
                out.append(raw.decode("utf-8", errors="replace"))  # as in `string`
        self.pos = pos
        return out


class GGUFFile:
    """`fields`: {key: value} (str, int, float, bool or lists); `tensors`: TensorInfo in file order."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_file():
            raise HardyError(f"model file not found: {self.path}")
        try:
            self.mmap = np.memmap(self.path, dtype=np.uint8, mode="r")
        except (OSError, ValueError) as e:
            raise HardyError(f"{self.path}: cannot map the file ({e})") from None
        c = _Cursor(memoryview(self.mmap), self.path)
        if bytes(c.take(4)) != MAGIC:
            c.fail("no GGUF magic")
        version = c.u32()
        if version not in (2, 3):
            c.fail(f"unsupported GGUF version {version} (big-endian files are not supported)")
        n_tensors, n_kv = c.u64(), c.u64()
        if n_tensors > len(self.mmap) or n_kv > len(self.mmap):
            c.fail(f"absurd counts ({n_tensors} tensors, {n_kv} keys)")
        self.fields = {}
        for _ in range(n_kv):
            key = c.string()
            self.fields[key] = c.value(c.u32())
        infos = []
        for _ in range(n_tensors):
            name, n_dims = c.string(), c.u32()
            if not 1 <= n_dims <= MAX_DIMS:
                c.fail(f"tensor {name} has {n_dims} dimensions")
            dims = [c.u64() for _ in range(n_dims)]
            type_id, offset = c.u32(), c.u64()
            try:
                qtype = gguf.GGMLQuantizationType(type_id)
            except ValueError:
                c.fail(f"tensor {name} has unknown type {type_id}")
            infos.append((name, dims, qtype, offset))
        alignment = self.fields.get("general.alignment", 32)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            c.fail(f"bad general.alignment {alignment!r}")
        start = -(-c.pos // alignment) * alignment
        for name, _, _, offset in infos:  # llama.cpp refuses these too
            if offset % alignment:
                raise HardyError(f"{self.path}: tensor {name} starts at offset {offset}, not a multiple of the "
                                 f"alignment {alignment}")
        self.tensors = [self._tensor(gguf, start, *info) for info in infos]

    def prefetch(self, t: TensorInfo, begin: int = 0, end: int | None = None) -> None:
        """Map a tensor's pages (or those of its bytes [begin, end)) in one call before they are read
        (MADV_POPULATE_READ, Linux 5.14+), instead of one page fault per 4 KB; where the kernel lacks
        it, reading faults them in as before."""
        raw = getattr(self.mmap, "_mmap", None)
        if raw is None or not hasattr(raw, "madvise"):
            return
        first, length = self._pages(t, begin, end)
        try:
            if length:
                raw.madvise(getattr(mmap, "MADV_POPULATE_READ", 22), first, length)
        except OSError:
            pass

    def rows(self, t: TensorInfo) -> "TensorRows":
        return TensorRows(self, t)

    def _pages(self, t: TensorInfo, begin: int = 0, end: int | None = None) -> tuple[int, int]:
        """The whole pages holding bytes [begin, end) of the tensor's data (all of it by default)."""
        page = mmap.PAGESIZE
        first = (t.data_offset + begin) // page * page
        last = min(len(self.mmap), -(-(t.data_offset + (t.n_bytes if end is None else end)) // page) * page)
        return first, max(0, last - first)

    def release(self, t: TensorInfo, begin: int = 0, end: int | None = None) -> None:
        """Drop a tensor's pages (or those of its bytes [begin, end)) from this process once they have
        been copied out (they stay in the page cache): a loader that re-lays tensor by tensor then
        holds one copy of the weights, not two. A page shared with a neighbour's bytes is dropped too:
        it is read back from the page cache if touched again."""
        self._drop(*self._pages(t, begin, end))

    def release_read(self, t: TensorInfo) -> None:
        """Drop a converted tensor's pages and those that reading it mapped again behind it: a read
        fault maps the page cache's neighbouring pages too (fault-around, or a whole large folio: at
        most FOLIO_REACH, naturally aligned), reaching back into tensors released before."""
        first, length = self._pages(t)
        start = first // FOLIO_REACH * FOLIO_REACH
        self._drop(start, first + length - start)

    def _drop(self, first: int, length: int) -> None:
        raw = getattr(self.mmap, "_mmap", None)
        if length and raw is not None and hasattr(raw, "madvise") and hasattr(mmap, "MADV_DONTNEED"):
            raw.madvise(mmap.MADV_DONTNEED, first, length)

    def _tensor(self, gguf, start: int, name: str, dims: list[int], qtype, offset: int) -> TensorInfo:
        block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
        elements = 1
        for d in dims:
            if d <= 0 or d > len(self.mmap) * 8:
                raise HardyError(f"{self.path}: tensor {name} has dimension {d}")
            elements *= d
        if dims[0] % block:
            raise HardyError(f"{self.path}: tensor {name}: {dims[0]} values per row are not whole "
                             f"{qtype.name} blocks of {block}")
        n_bytes = elements // block * block_bytes
        begin = start + offset
        if begin + n_bytes > len(self.mmap):
            raise HardyError(f"{self.path}: truncated GGUF file (tensor {name} ends at byte {begin + n_bytes}, "
                             f"file has {len(self.mmap)})")
        raw = self.mmap[begin:begin + n_bytes]
        shape = tuple(reversed(dims))
        plain = PLAIN_TYPES.get(qtype.name)
        if plain is not None:
            data = raw.view(plain).reshape(shape)
        else:  # quantized (and BF16): bytes per row, as the gguf package's dequantizers expect
            data = raw.reshape(*shape[:-1], dims[0] // block * block_bytes)
        return TensorInfo(name=name, tensor_type=qtype, shape=np.array(dims, dtype=np.uint64), data_offset=begin,
                          n_bytes=n_bytes, data=data)
