"""Training checkpoints: Distributed Checkpoint (DCP) + JSON side files + checksum manifest.

Layout of RUN_DIR/checkpoints/step_%08d/:
    .metadata, __R_0.distcp   DCP: model and optimizer state (sharded as trained, loadable on any layout)
    trainer.json              step, scheduler, loss scaler, counters, resolved config (rank 0)
    rank_%05d.json            per-rank RNG state and data-loader position
    manifest.json             checksum (XXH3-128; SHA-256 in older saves) and size of every file above
    COMPLETE                  written last; a directory without it is ignored

A save is written into `.step_%08d.partial`, renamed when every rank has finished, and marked
COMPLETE afterwards. A checkpoint is loaded only after its manifest verifies, and DCP's `.metadata`
(a pickle) only through the allow-list of `hardy.checkpoint.safe_metadata`: a run directory received
from someone else cannot run code when it is resumed or exported.
"""
from __future__ import annotations

import base64
import contextlib
import errno
import hashlib
import heapq
import json
import logging
import os
import re
import shutil
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
import xxhash

from hardy.checkpoint.safe_metadata import SafeFileSystemReader, check_dcp_metadata
from hardy.errors import HardyError
from hardy.fsio import fsync_path, write_json_atomic
from hardy.parallel.distributed import barrier, gather_strings, share_from_main

log = logging.getLogger(__name__)

MANIFEST, COMPLETE, TRAINER = "manifest.json", "COMPLETE", "trainer.json"
_HASHES = ".hashes_rank_"  # per-rank checksums, merged into the manifest and removed
_STEP_DIR = re.compile(r"step_(\d{8})$")
VERIFY_TIMEOUT_S = 6 * 3600  # how long ranks wait for each other's checksums (a rank that dies ends the attempt)


@contextlib.contextmanager
def _quiet_single_process():
    """Without a process group DCP warns on every save/load that it runs in one process: expected here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        yield


class CheckpointCorrupt(Exception):
    pass


class SaveFailed(HardyError):
    """A checkpoint was not written (on some rank); its partial directory is removed and the newest
    complete checkpoint stays the resume point. `disk_full`: the write ran out of space."""

    def __init__(self, message: str, disk_full: bool):
        super().__init__(message)
        self.disk_full = disk_full


def _errors_of(error: BaseException):
    """The error and those it wraps: causes, contexts, and DCP's per-rank failures."""
    seen, todo = set(), [error]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        todo += [e.__cause__, e.__context__]
        if isinstance(e, CheckpointException):
            todo += [pair[0] for pair in e.failures.values()]


def _disk_full(error: BaseException | None) -> bool:
    return error is not None and any(isinstance(e, OSError) and e.errno == errno.ENOSPC for e in _errors_of(error))


def _state_bytes(state) -> int:
    """Bytes of this rank's tensors in a (nested) state dict: DTensors by their local shard."""
    if isinstance(state, dict):
        return sum(_state_bytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(_state_bytes(v) for v in state)
    if isinstance(state, torch.Tensor):
        local = state.to_local() if hasattr(state, "to_local") else state
        return local.numel() * local.element_size()
    return 0


def _size(n: float) -> str:
    return f"{n / 2 ** 30:.2f} GiB" if n >= 2 ** 30 else f"{n / 2 ** 20:.1f} MiB"


HASH_BLOCK = 8 << 20


# Corruption detection, not authentication: XXH3-128 hashes at several GiB/s per core, so verifying a
# checkpoint costs about one read of it (SHA-256, at ~1.5 GiB/s per core, made it CPU-bound). Manifests
# written before name their checksum "sha256" and still verify.
CHECKSUMS = {"xxh3_128": xxhash.xxh3_128, "sha256": hashlib.sha256}
CHECKSUM = "xxh3_128"


def checksum_file(path: Path, algorithm: str = CHECKSUM) -> str:
    """The file's checksum, reading the next block while this one is hashed (the read releases the GIL),
    so verification runs at the disk's rate."""
    h = CHECKSUMS[algorithm]()
    blocks = [bytearray(HASH_BLOCK), bytearray(HASH_BLOCK)]
    with open(path, "rb", buffering=0) as f, ThreadPoolExecutor(1, thread_name_prefix="hardy-read") as reader:
        pending, i = reader.submit(f.readinto, blocks[0]), 0
        while n := pending.result():
            pending = reader.submit(f.readinto, blocks[1 - i])
            h.update(memoryview(blocks[i])[:n])
            i = 1 - i
    return h.hexdigest()


def _owned_files(directory: Path, rank: int) -> list[Path]:
    """The files of a partial checkpoint that `rank` writes: its DCP shards (`__{rank}_*.distcp`,
    FileSystemWriter's naming) and side state; rank 0 also DCP's `.metadata` and trainer.json."""
    names = {f"rank_{rank:05d}.json"} | ({".metadata", TRAINER} if rank == 0 else set())
    return sorted(f for f in directory.iterdir()
                  if f.is_file() and (f.name in names or (f.name.startswith(f"__{rank}_") and f.suffix == ".distcp")))


def _file_entry(f: Path) -> dict:
    fsync_path(f)
    return {CHECKSUM: checksum_file(f), "bytes": f.stat().st_size}


def hash_own_files(directory: Path, rank: int) -> None:
    """fsync and checksum this rank's files; the result goes to a per-rank JSON file that rank 0
    merges into the manifest. Runs in the background writer for asynchronous saves, so hashing
    gigabytes never stalls training."""
    entries = {f.name: _file_entry(f) for f in _owned_files(directory, rank)}
    write_json_atomic(directory / f"{_HASHES}{rank:05d}.json", entries)


def write_manifest(directory: Path) -> None:
    """Merge the per-rank checksums; a file no rank claimed (an unexpected DCP file name) is hashed here."""
    files = {}
    for part in sorted(directory.glob(f"{_HASHES}*.json")):
        files.update(json.loads(part.read_text()))
        part.unlink()
    for f in sorted(directory.rglob("*")):
        name = str(f.relative_to(directory))
        if f.is_file() and f.name not in (MANIFEST, COMPLETE) and name not in files:
            files[name] = _file_entry(f)
    write_json_atomic(directory / MANIFEST, {"version": 2, "files": files})
    fsync_path(directory)


def verify_manifest(directory: Path, rank: int = 0, world: int = 1) -> None:
    """Raise CheckpointCorrupt naming the first file that is missing, truncated or altered. With `world`
    > 1, this rank checksums only its share of the bytes (`share`); every rank checks names and sizes."""
    files = _listed_files(directory)
    for name in share(files, rank, world):
        algorithm = next(a for a in CHECKSUMS if a in files[name])  # _listed_files checked there is one
        if checksum_file(directory / name, algorithm) != files[name][algorithm]:
            raise CheckpointCorrupt(f"{directory / name}: checksum mismatch (corrupted)")


def share(files: dict, rank: int, world: int) -> list[str]:
    """This rank's files to checksum: the largest first, each to the rank with the fewest bytes so far
    (ties to the lower rank), so every rank reads about 1/world of the checkpoint; the same on all."""
    least, mine = [(0, r) for r in range(world)], []  # a heap of (bytes so far, rank)
    for name in sorted(files, key=lambda n: (-files[n]["bytes"], n)):
        load, target = heapq.heappop(least)
        heapq.heappush(least, (load + files[name]["bytes"], target))
        if target == rank:
            mine.append(name)
    return mine


def _listed_files(directory: Path) -> dict:
    """The manifest's files, after checking that each is present at its size and nothing else is."""
    manifest_file = directory / MANIFEST
    try:
        manifest = json.loads(manifest_file.read_text())
        files = manifest["files"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointCorrupt(f"{manifest_file}: unreadable manifest ({e})") from None
    if not isinstance(files, dict):
        raise CheckpointCorrupt(f"{manifest_file}: unreadable manifest (its files are not an object)")
    root = directory.resolve()
    for name in files:  # a manifest must not make the loader read (or checksum) files anywhere else
        target = (directory / name).resolve()
        if Path(name).is_absolute() or target == root or not target.is_relative_to(root):
            raise CheckpointCorrupt(f"{manifest_file}: {name!r} is outside the checkpoint directory")
    present = {str(f.relative_to(directory)) for f in directory.rglob("*") if f.is_file()} - {MANIFEST, COMPLETE}
    extra = sorted(present - set(files))
    if extra:
        raise CheckpointCorrupt(f"{directory / extra[0]}: file not listed in the manifest")
    for name, info in files.items():
        f = directory / name
        if not f.is_file():
            raise CheckpointCorrupt(f"{f}: missing")
        if not (isinstance(info, dict) and isinstance(info.get("bytes"), int) and any(a in info for a in CHECKSUMS)):
            raise CheckpointCorrupt(f"{manifest_file}: the entry of {name} needs bytes and a checksum "
                                    f"({' or '.join(CHECKSUMS)})")
        if f.stat().st_size != info["bytes"]:
            raise CheckpointCorrupt(f"{f}: {f.stat().st_size} bytes, manifest says {info['bytes']} (truncated?)")
    return files


def _attempt(work) -> BaseException | None:
    """Run `work`; the write error it raised (a failed save is agreed on by all ranks before it is raised)."""
    try:
        work()
    except (OSError, CheckpointException) as e:
        return e
    return None


def _one_line(error: BaseException) -> str:
    """The innermost error's own message: DCP wraps it in a multi-line report with tracebacks."""
    inner = [e for e in _errors_of(error) if not isinstance(e, CheckpointException)]
    e = inner[-1] if inner else error
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"


def rng_state() -> dict:
    state = {"torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode()}
    if torch.cuda.is_available():
        state["cuda"] = base64.b64encode(torch.cuda.get_rng_state().numpy().tobytes()).decode()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(torch.frombuffer(bytearray(base64.b64decode(state["torch"])), dtype=torch.uint8))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(torch.frombuffer(bytearray(base64.b64decode(state["cuda"])), dtype=torch.uint8))


def step_dirs(ckpt_root: Path) -> list[tuple[int, Path]]:
    """Complete checkpoint directories, newest first."""
    if not ckpt_root.is_dir():
        return []
    found = []
    for d in ckpt_root.iterdir():
        m = _STEP_DIR.match(d.name)
        if m and d.is_dir() and (d / COMPLETE).is_file():
            found.append((int(m.group(1)), d))
    return sorted(found, reverse=True)


@dataclass
class PendingSave:
    """An asynchronous save in flight: written in the background, COMPLETE once every rank's write is done."""
    step: int
    partial: Path
    final: Path
    written: Future


class CheckpointManager:
    def __init__(self, run_dir: Path, keep: int, rank: int, device: torch.device):
        self.root = Path(run_dir) / "checkpoints"
        self.keep, self.rank, self.device = keep, rank, device
        self._needed = 0  # bytes of the last save's state, for the disk-full message
        self._pool: ThreadPoolExecutor | None = None  # checksums of asynchronous saves, deletions
        self._stager_obj: DefaultStager | None = None
        self._staging: Future | None = None  # the in-flight asynchronous save's copy of the state
        self._pending: PendingSave | None = None
        self._group = None  # the asynchronous saves' own process group
        self._searches = 0  # resume searches so far: each has its own keys on the rendezvous store

    def save(self, step: int, model, optimizer, trainer_state: dict, rank_state: dict, written=None,
             asynchronous: bool = False) -> Path:
        """Collective: every rank calls it. `written()` runs once this rank's files are on disk
        (asynchronous: in the background writer), before the checkpoint is COMPLETE; an OSError it
        raises fails the save like a failed write.

        Synchronous saves are complete on return. Asynchronous ones stage the state in memory, write
        it in a background thread, and become COMPLETE in `poll()`/`wait()` once every rank's
        write has finished; one save is in flight at a time.
        """
        self.wait()
        final = self.root / f"step_{step:08d}"
        partial = self.root / f".step_{step:08d}.partial"
        if self.rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(partial, ignore_errors=True)
            shutil.rmtree(final, ignore_errors=True)  # a stale, incomplete copy of this step
            partial.mkdir()
        barrier()
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        self._needed = _state_bytes(state) * (dist.get_world_size() if dist.is_initialized() else 1)

        def side_files():  # tiny; fsynced later together with the shards
            write_json_atomic(partial / f"rank_{self.rank:05d}.json", rank_state, durable=False)
            if self.rank == 0:
                write_json_atomic(partial / TRAINER, trainer_state, durable=False)

        # DCP first: its collectives run on every rank whatever fails locally, and report a failed
        # write to all of them; a rank's own failures after it are agreed on in _finalize.
        with _quiet_single_process():
            if asynchronous:
                response = dcp.async_save(state, checkpoint_id=str(partial), process_group=self._async_group(),
                                          async_stager=self._stager())
                upload = getattr(response, "upload_completion", response)
                self._staging = getattr(response, "staging_completion", None)
                future = self._background().submit(
                    lambda: (upload.result(), side_files(), written and written(), hash_own_files(partial, self.rank)))
                self._pending = PendingSave(step, partial, final, future)
                return final
            error = None
            try:
                dcp.save(state, checkpoint_id=str(partial))
                side_files()
                if written is not None:
                    written()
            except (OSError, CheckpointException) as e:
                error = e
        if error is None:
            error = _attempt(lambda: hash_own_files(partial, self.rank))
        self._finalize(step, partial, final, error)
        return final

    def close(self) -> None:
        """Finish background housekeeping (checksums, deletions of pruned checkpoints)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def _background(self):
        """One worker thread for checkpoint housekeeping: checksums of asynchronous saves, deletions."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hardy-ckpt")
        return self._pool

    def _stager(self):
        """Stage (copy) the state in a background thread too, into buffers reused across saves.

        Training may run forward/backward meanwhile; `staged()` must be called before anything
        modifies the parameters or optimizer state (the optimizer step, a rollback).
        """
        if self._stager_obj is None:
            cuda = torch.cuda.is_available()
            self._stager_obj = DefaultStager(StagingOptions(use_pinned_memory=cuda, use_shared_memory=False,
                                                            use_async_staging=True, use_non_blocking_copy=cuda))
        return self._stager_obj

    def staged(self) -> None:
        """Block until the in-flight asynchronous save has its own copy of the state."""
        if self._staging is not None:
            self._staging.result()
            self._staging = None

    def _async_group(self):
        # Background writes run collectives of their own: give them a process group that the
        # training loop's collectives never share.
        if dist.is_initialized() and self._group is None:
            self._group = dist.new_group(backend="gloo")
        return self._group

    def _finalize(self, step: int, partial: Path, final: Path, error: BaseException | None = None) -> None:
        """Every rank's write succeeded: checksums, rename, COMPLETE. Otherwise SaveFailed on every rank."""
        if self._any_rank(error is not None):  # also the barrier before rank 0 reads every rank's files
            self._discard(step, partial, error)
        if self.rank == 0:
            error = _attempt(lambda: self._complete(step, partial, final))
            if error is not None:
                shutil.rmtree(final, ignore_errors=True)  # renamed, but not COMPLETE
        if self._any_rank(error is not None):
            self._discard(step, partial, error)
        if self.rank == 0:
            self._prune()
        barrier()

    def _complete(self, step: int, partial: Path, final: Path) -> None:
        write_manifest(partial)
        os.rename(partial, final)
        fsync_path(self.root)
        (final / COMPLETE).write_text(f"{step}\n")
        fsync_path(final / COMPLETE)
        fsync_path(final)

    def _any_rank(self, flag: bool) -> bool:
        if not dist.is_initialized():
            return flag
        t = torch.tensor([float(flag)], device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())

    def _discard(self, step: int, partial: Path, error: BaseException | None) -> None:
        """Remove a failed save's partial directory (rank 0, once no rank writes to it) and raise SaveFailed."""
        full = self._any_rank(_disk_full(error))
        if self.rank == 0:
            shutil.rmtree(partial, ignore_errors=True)
        barrier()
        newest = step_dirs(self.root)
        keeps = f"the resume point stays {newest[0][1].name}" if newest else "there is no complete checkpoint yet"
        if full:
            free = shutil.disk_usage(self.root).free
            raise SaveFailed(f"checkpoint of step {step}: no space left in {self.root} (it needs about "
                             f"{_size(self._needed)}, {_size(free)} free); {keeps}", disk_full=True)
        what = _one_line(error) if error is not None else "another rank's write failed"
        raise SaveFailed(f"checkpoint of step {step} was not written ({what}); {keeps}", disk_full=False)

    def poll(self) -> Path | None:
        """Complete the in-flight asynchronous save if every rank's write is done (collective)."""
        if self._pending is None:
            return None
        done = 1.0 if self._pending.written.done() else 0.0
        if dist.is_initialized():
            t = torch.tensor([done], device=self.device)
            dist.all_reduce(t, op=dist.ReduceOp.MIN)
            done = t.item()
        return self.wait() if done else None

    def wait(self) -> Path | None:
        """Block until the in-flight asynchronous save (if any) is written and COMPLETE."""
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        error = _attempt(self.staged)
        error = error or _attempt(pending.written.result)
        self._finalize(pending.step, pending.partial, pending.final, error)
        return pending.final

    def _prune(self) -> None:
        """Drop checkpoints beyond the newest K: renamed out of sight at once, deleted in the
        background (removing gigabytes takes a noticeable fraction of a second)."""
        old = [d for _, d in step_dirs(self.root)[self.keep:]] + list(self.root.glob(".step_*.partial"))
        for d in old:  # a save of the same step later must not find its directory deleted under it
            trash = d.with_name(f".{d.name.lstrip('.')}.deleting")
            shutil.rmtree(trash, ignore_errors=True)  # left over from a run that stopped mid-deletion
            os.rename(d, trash)
        doomed = list(self.root.glob(".step_*.deleting"))
        if doomed:
            self._background().submit(lambda: [shutil.rmtree(d, ignore_errors=True) for d in doomed])

    def find_resumable(self, explicit: Path | None = None) -> Path | None:
        """Newest complete checkpoint whose manifest verifies. Each rank checksums its share of the
        files; the verdicts meet on the rendezvous store, outside any collective and its timeout (at
        70B, reading the checkpoint takes minutes), so all ranks choose the same one."""
        world = dist.get_world_size() if dist.is_initialized() else 1
        self._searches += 1
        candidates = [explicit] if explicit is not None else [d for _, d in step_dirs(self.root)]
        names = share_from_main(f"resume/{self._searches}/candidates", json.dumps([str(d) for d in candidates]),
                                self.rank)
        for i, d in enumerate(Path(n) for n in json.loads(names)):
            try:
                verify_manifest(d, self.rank, world)
                verdict = ""
            except CheckpointCorrupt as e:
                verdict = str(e) or "corrupt"
            verdicts = gather_strings(f"resume/{self._searches}/{i}", verdict, self.rank, world, VERIFY_TIMEOUT_S)
            errors = [v for v in verdicts if v]
            if not errors:
                return d
            if explicit is not None:
                raise HardyError(f"checkpoint {d} failed verification: {errors[0]}")
            if self.rank == 0:
                log.warning("skipping damaged checkpoint %s: %s", d.name, errors[0])
        return None

    def load(self, directory: Path, model, optimizer) -> tuple[dict, dict]:
        """Restore model + optimizer in place; returns (trainer_state, this rank's state)."""
        # checked here as well as by the reader: DCP would wrap the reader's one-line error in its own
        check_dcp_metadata(directory)
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        with _quiet_single_process():
            dcp.load(state, storage_reader=SafeFileSystemReader(str(directory)))
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        trainer_state = json.loads((directory / TRAINER).read_text())
        rank_file = directory / f"rank_{self.rank:05d}.json"
        if not rank_file.is_file():  # resumed on more processes than saved it: data positions are global,
            rank_file = directory / "rank_00000.json"  # so rank 0's serves (and its RNG seeds the new rank)
        if not rank_file.is_file():
            raise HardyError(f"{directory}: no per-rank state (rank_00000.json is missing)")
        return trainer_state, json.loads(rank_file.read_text())


def load_model_weights(directory: Path, model) -> dict:
    """Load only the model weights of a verified checkpoint into a plain (unsharded) model."""
    try:
        verify_manifest(directory)
    except CheckpointCorrupt as e:
        raise HardyError(f"checkpoint {directory} failed verification: {e}") from None
    check_dcp_metadata(directory)  # before DCP, which would wrap the reader's one-line error in its own
    state = {"model": model.state_dict()}
    with _quiet_single_process():
        dcp.load(state, storage_reader=SafeFileSystemReader(str(directory)))
    model.load_state_dict(state["model"])
    return json.loads((directory / TRAINER).read_text())
