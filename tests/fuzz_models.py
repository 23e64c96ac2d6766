"""Malformed model files for the reader fuzz tests: a map of a GGUF header's sections (written here,
independently of hardy's reader), variants of a real file damaged inside each section, and a worker
that loads each variant in a fresh process and reports what happened, how long it took and the peak
memory it needed."""
from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from conftest import REPO

SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
HUGE = 2 ** 62
READ_KEYS = {"general.architecture", "tokenizer.ggml.model", "tokenizer.ggml.tokens", "tokenizer.ggml.merges",
             "tokenizer.ggml.token_type", "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id"}


@dataclass
class Entry:
    """One key/value or tensor info: where its parts start (absolute byte positions)."""
    kind: str  # "kv" or "tensor"
    name: str
    start: int
    parts: dict = field(default_factory=dict)  # part name -> byte position
    end: int = 0


def gguf_map(data: bytes) -> tuple[list[Entry], int]:
    """Every key/value and tensor info of a GGUF header, and where the header ends."""
    pos = 24
    n_tensors, n_kv = struct.unpack_from("<QQ", data, 8)

    def string(at):
        n = struct.unpack_from("<Q", data, at)[0]
        return data[at + 8:at + 8 + n].decode("utf-8", "replace"), at + 8 + n

    def skip_value(vtype, at):
        if vtype in SIZES:
            return at + SIZES[vtype]
        if vtype == 8:
            return string(at)[1]
        etype, count = struct.unpack_from("<IQ", data, at)
        at += 12
        if etype in SIZES:
            return at + count * SIZES[etype]
        for _ in range(count):
            at = skip_value(etype, at)
        return at

    entries = []
    for _ in range(n_kv):
        e = Entry("kv", "", pos)
        e.name, after_key = string(pos)
        vtype = struct.unpack_from("<I", data, after_key)[0]
        e.parts = {"key": pos, "type": after_key, "value": after_key + 4}
        if vtype == 9:
            e.parts.update(array_type=after_key + 4, array_count=after_key + 8, elements=after_key + 16)
        e.end = skip_value(vtype, after_key + 4)
        entries.append(e)
        pos = e.end
    for _ in range(n_tensors):
        e = Entry("tensor", "", pos)
        e.name, after_name = string(pos)
        n_dims = struct.unpack_from("<I", data, after_name)[0]
        e.parts = {"name": pos, "n_dims": after_name, "dims": after_name + 4,
                   "type": after_name + 4 + 8 * n_dims, "offset": after_name + 8 + 8 * n_dims}
        e.end = after_name + 16 + 8 * n_dims
        entries.append(e)
        pos = e.end
    return entries, pos


def put(data: bytes, at: int, fmt: str, value) -> bytes:
    return data[:at] + struct.pack(fmt, value) + data[at + struct.calcsize(fmt):]


def flip(data: bytes, at: int) -> bytes:
    return data[:at] + bytes([data[at] ^ 0xFF]) + data[at + 1:]


def gguf_variants(data: bytes, every_tensor: int = 1) -> dict[str, tuple[bytes, int]]:
    """name -> (header bytes, file size). The file is the header followed by zeros up to the size, so
    a variant of a 270 MB file costs its header on disk (the rest is sparse)."""
    entries, header_end = gguf_map(data)
    size = len(data)
    head = data[:header_end + 4096]
    out = {"cut in the fixed header": (data[:13], 13),
           "tensor count absurd": (put(head, 8, "<Q", HUGE), size),
           "key count absurd": (put(head, 16, "<Q", HUGE), size),
           "version 9": (put(head, 4, "<I", 9), size),
           "cut in the data": (head, header_end + 4096),
           "cut half way": (head, size // 2)}
    tensors = [e for e in entries if e.kind == "tensor"]
    for e in [e for e in entries if e.kind == "kv"] + tensors[::every_tensor]:
        label = f"{e.kind} {e.name}"
        for part, at in e.parts.items():  # truncated inside each part
            out[f"cut in {label} {part}"] = (data[:at + 2], at + 2)
        # keys that only describe the file (general.*, optional tokenizer ids): damage there leaves a
        # loadable model, a slow case that shows nothing new
        model_key = e.kind == "tensor" or e.name.startswith("llama.") or e.name in READ_KEYS
        if model_key:
            out[f"flip in {label} {'key' if e.kind == 'kv' else 'name'}"] = (flip(head, e.start + 9), size)
        if e.kind == "kv":
            vtype = struct.unpack_from("<I", data, e.parts["type"])[0]
            out[f"{label}: unknown value type"] = (put(head, e.parts["type"], "<I", 0xFFFF), size)
            if model_key:
                out[f"{label}: flip in the value"] = (flip(head, e.parts["value"]), size)
            if vtype in (4, 5) and model_key:
                out[f"{label}: value absurd"] = (put(head, e.parts["value"], "<I", 0xFFFFFFFF), size)
                out[f"{label}: value 0"] = (put(head, e.parts["value"], "<I", 0), size)
            if vtype == 8:
                out[f"{label}: as a string, cut inside"] = (data[:e.parts["value"] + 12], e.parts["value"] + 12)
            out[f"{label}: string length absurd"] = (put(head, e.start, "<Q", HUGE), size)
            if "array_count" in e.parts:
                out[f"{label}: element count absurd"] = (put(head, e.parts["array_count"], "<Q", HUGE), size)
                out[f"{label}: element type unknown"] = (put(head, e.parts["array_type"], "<I", 0xFFFF), size)
                out[f"{label}: element count one more"] = (
                    put(head, e.parts["array_count"], "<Q", struct.unpack_from("<Q", data, e.parts["array_count"])[0] + 1),
                    size)
                out[f"{label}: flip in an element"] = (flip(head, min(e.parts["elements"] + 9, e.end - 1)), size)
        else:
            out[f"{label}: dimensions 0"] = (put(head, e.parts["n_dims"], "<I", 0), size)
            out[f"{label}: dimensions 9"] = (put(head, e.parts["n_dims"], "<I", 9), size)
            out[f"{label}: dimension absurd"] = (put(head, e.parts["dims"], "<Q", HUGE), size)
            out[f"{label}: dimension 1"] = (put(head, e.parts["dims"], "<Q", 1), size)
            out[f"{label}: type unknown"] = (put(head, e.parts["type"], "<I", 99), size)
            if e is tensors[0]:  # F32 in place of a quantized type: bigger, and it may overlap the next tensor
                out[f"{label}: type F32"] = (put(head, e.parts["type"], "<I", 0), size)
            out[f"{label}: offset absurd"] = (put(head, e.parts["offset"], "<Q", HUGE), size)
            out[f"{label}: offset misaligned"] = (
                put(head, e.parts["offset"], "<Q", struct.unpack_from("<Q", data, e.parts["offset"])[0] + 1), size)
    return out


def write_variant(path: Path, head: bytes, size: int) -> None:
    with open(path, "wb") as f:
        f.write(head[:size])
        f.truncate(size)  # the rest reads as zeros and takes no disk


WORKER = r"""
import json, sys, time, traceback
import psutil
from hardy.errors import HardyError
from hardy.loading.load import load_model

jobs = json.loads(open(sys.argv[1]).read())
out = open(sys.argv[2], "w")
for job in jobs:
    open("/proc/self/clear_refs", "w").write("5")  # reset the peak (VmHWM) to now
    base = psutil.Process().memory_info().rss
    start = time.monotonic()
    try:
        loaded = load_model(job["path"], gguf=job.get("gguf", "float"))
        outcome, detail = "loaded", ""
        del loaded
    except HardyError as e:
        outcome, detail = "error", str(e)
    except BaseException as e:
        outcome, detail = "crash", "".join(traceback.format_exception(e))[-2000:]
    hwm = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM"))
    out.write(json.dumps({**job, "outcome": outcome, "detail": detail, "seconds": time.monotonic() - start,
                          "peak": hwm * 1024 - base}) + "\n")
    out.flush()
"""


def load_each(jobs: list[dict], workdir: Path, timeout: float = 900) -> list[dict]:
    """Load every job's path in one fresh process (one torch import); a report per job."""
    jobs_file, report = workdir / "jobs.json", workdir / "report.jsonl"
    jobs_file.write_text(json.dumps(jobs))
    proc = subprocess.run([sys.executable, "-c", WORKER, str(jobs_file), str(report)], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, HARDY_NO_KERNELS="1"))  # the loaders, not the kernels' re-layout
    results = [json.loads(line) for line in report.read_text().splitlines()] if report.exists() else []
    assert len(results) == len(jobs), f"the worker stopped after {len(results)} of {len(jobs)}: {proc.stderr[-3000:]}"
    return results
