"""The tiers' storage: copies of KV taken out of the paged pool, by handle, in host memory
or (spilled) in files.

The allocator decides what moves and keeps the accounting (`kvcore.tiers`); this store only
holds the bytes. An entry is what `KVCache.read_slots` returns for one session's history:
the full-attention layers' K/V at positions [0, n) in position order, and (split pools) the
sliding layers' K/V at the positions whose sliding KV existed, in position order. A load
writes a range of those positions back at the slots the allocator just reserved.

A spill writes an entry to `disk_dir/<handle>.kv` (safetensors: one tensor per part, the
metadata holding the format, the model's fingerprint and a BLAKE2b checksum of the tensors'
bytes) and frees the host copy; a load of a spilled entry reads and verifies it first. The
file is written beside and renamed into place, so a crash never leaves a half file under
the final name. The write may run on a thread of its own (`spill_source`, `write_partial`,
`commit_spill`), the entry staying a host entry until the commit.

On drain the runner writes a manifest (`sessions.json`: the sessions whose entries are on
disk, with what the ledger needs to take them back) and the files it lists survive the
process; the next start on the same folder adopts them (`adopt_manifest`) and deletes
everything else there. Without a manifest, a stopping store deletes its folder.

A spilled entry may be read ahead (`read_spilled` on any thread, then `put_staged` on the
thread that serves the store's other calls): the verified copy waits in `staged` (at most
MAX_STAGED of them, outside the tiers' budgets: it is a cache of a file, which stays the
entry) until its load takes it, so a turn's disk read overlaps other requests' steps. A
copy is kept only while the file it was read from is still the entry's (same inode,
modification time and size), and never in place of another copy waiting for its load.

The store never decides anything: an unknown handle, or a file that is missing, truncated,
altered or from another model, is an error the caller turns into a prefill (never into wrong
KV), and every entry's tier and size are reported so the ledger's count can be audited.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import Tensor

from kernels.kv_cache import KVCache

FILE_FORMAT = "kvactor-kv-1"
MANIFEST_FORMAT = "kvactor-sessions-1"
MANIFEST = "sessions.json"
MAX_STAGED = 2  # read-ahead copies of spilled entries held at once (oldest dropped first)


class MissingKv(KeyError):
    """A load or an audit named a handle the store does not hold."""


class CorruptKv(ValueError):
    """A spilled entry's file is missing, unreadable, altered or another model's."""


@dataclass(frozen=True)
class StoredKv:
    parts: list[Tensor]  # [k_full, v_full(, k_swa, v_swa)], layers first, positions second
    nbytes: int

    @property
    def positions(self) -> int:
        return int(self.parts[0].shape[1])

    @property
    def swa_positions(self) -> int:
        return int(self.parts[2].shape[1]) if len(self.parts) > 2 else 0


class HostKvStore:
    """Handle -> `StoredKv` in host memory, or its file under `disk_dir` once spilled. Not
    bounded here: the allocator's budgets are."""

    def __init__(self, cache: KVCache, disk_dir: Path | None = None, fingerprint: str = ""):
        self.cache = cache
        self.entries: dict[int, StoredKv] = {}
        self.on_disk: dict[int, int] = {}  # spilled handle -> its file's bytes
        self.disk_dir = disk_dir
        self.fingerprint = fingerprint
        self.persisted: set[int] = set()  # handles a drain's manifest keeps for the next start
        self.adopted: dict[int, int] = {}  # a previous run's files, until the ledger claims them
        self.staged: dict[int, StoredKv] = {}  # spilled entries read ahead, oldest first

    def save(self, handle: int, full_slots: np.ndarray, swa_slots: np.ndarray) -> int:
        """Copy the KV at these slots (full positions [0, n) in order; the sliding pool's
        physical slots of the saved sliding positions) under `handle`; its size in bytes.
        Saving a handle again replaces it."""
        parts = self.cache.read_slots(full_slots, swa_slots)
        nbytes = sum(p.numel() * p.element_size() for p in parts)
        self.entries[handle] = StoredKv(parts, nbytes)
        return nbytes

    def load(
        self,
        handle: int,
        start: int,
        full_slots: np.ndarray,
        swa_index: np.ndarray,
        swa_slots: np.ndarray,
    ) -> None:
        """Write saved positions [start, start + len(full_slots)) at `full_slots`, and the
        saved sliding entries `swa_index` (indices into the saved sliding positions) at the
        sliding pool's `swa_slots`."""
        entry = self.entries.get(handle)
        if entry is None and handle in self.on_disk:
            entry = self.staged.pop(handle, None) or self._read(handle)
        if entry is None:
            raise MissingKv(f"no stored KV under handle {handle}")
        end = start + len(full_slots)
        if start < 0 or end > entry.positions:
            raise ValueError(f"positions [{start}, {end}) outside the {entry.positions} saved")
        index = np.asarray(swa_index, dtype=np.int64)
        if len(index) != len(swa_slots):
            raise ValueError(f"{len(index)} sliding entries for {len(swa_slots)} slots")
        if index.size and (index.min() < 0 or index.max() >= entry.swa_positions):
            raise ValueError(f"sliding entries outside the {entry.swa_positions} saved")
        parts = [p[:, start:end] for p in entry.parts[:2]]
        if len(entry.parts) > 2:
            idx = torch.from_numpy(np.ascontiguousarray(index))
            parts += [p.index_select(1, idx) for p in entry.parts[2:]]
        self.cache.write_slots(parts, full_slots, swa_slots)

    def read_spilled(self, handle: int) -> tuple[StoredKv, tuple] | None:
        """(a spilled entry read from its file and verified, the file's identity), or None
        (not spilled, or its file failed: the load will fail the same way and the turn
        prefill). Touches no state, so it may run beside the store's other calls."""
        if self.disk_dir is None or handle not in self.on_disk:
            return None
        try:
            identity = self._identity(handle)
            return self._read(handle), identity
        except (CorruptKv, OSError):
            return None

    def put_staged(self, handle: int, read: tuple[StoredKv, tuple]) -> bool:
        """Keep a `read_spilled` copy for the entry's load; False when the entry is no
        longer that spilled file (loaded, dropped, written again meanwhile) or MAX_STAGED
        copies already wait for their loads."""
        entry, identity = read
        if handle not in self.on_disk or handle in self.entries or len(self.staged) >= MAX_STAGED:
            return False
        try:
            if self._identity(handle) != identity:
                return False
        except OSError:
            return False
        self.staged[handle] = entry
        return True

    def _identity(self, handle: int) -> tuple:
        st = self._path(handle).stat()
        return (st.st_ino, st.st_mtime_ns, st.st_size)

    def spill(self, handle: int) -> int:
        """Write a host entry to its file and free the host copy; the file's bytes (an
        entry already spilled: its file's)."""
        entry = self.spill_source(handle)
        if entry is None:
            return self.on_disk[handle]
        return self.commit_spill(handle, entry, self.write_partial(handle, entry))

    # A spill in three steps, so that the file is written beside the steps: `spill_source`
    # and `commit_spill` on the thread that serves the store's other calls, `write_partial`
    # on any thread (it reads the entry's tensors, which nothing writes, and touches no
    # state). Until the commit the entry is a host entry as any: a load reads it, a drop
    # drops it (and the commit then deletes the file).
    def spill_source(self, handle: int) -> StoredKv | None:
        """The host entry to write (None: it is on disk already)."""
        if self.disk_dir is None:
            raise MissingKv("this store has no disk tier")
        entry = self.entries.get(handle)
        if entry is None and handle in self.on_disk:
            return None
        if entry is None:
            raise MissingKv(f"no host entry under handle {handle}")
        return entry

    def write_partial(self, handle: int, entry: StoredKv) -> Path:
        """Write the entry's file beside its final name; that path."""
        self.disk_dir.mkdir(parents=True, exist_ok=True)
        tensors = {f"part{i}": p.contiguous() for i, p in enumerate(entry.parts)}
        metadata = {
            "format": FILE_FORMAT,
            "fingerprint": self.fingerprint,
            "checksum": _checksum(tensors),
        }
        partial = self._path(handle).with_suffix(".partial")
        try:
            save_file(tensors, str(partial), metadata=metadata)
        except BaseException:
            partial.unlink(missing_ok=True)
            raise
        return partial

    def commit_spill(self, handle: int, entry: StoredKv, partial: Path) -> int:
        """The written file becomes the entry (renamed into place, the host copy freed); its
        bytes. An entry dropped (or written again) meanwhile keeps nothing: the file goes."""
        if self.entries.get(handle) is not entry:
            partial.unlink(missing_ok=True)
            raise MissingKv(f"host entry {handle} was dropped while its file was written")
        try:
            nbytes = partial.stat().st_size
            os.replace(partial, self._path(handle))
        except BaseException:
            partial.unlink(missing_ok=True)
            raise
        del self.entries[handle]
        self.on_disk[handle] = nbytes
        return nbytes

    def drop(self, handles: list[int]) -> int:
        """Forget these handles, deleting spilled files (unknown ones are ignored); the bytes
        freed."""
        freed = 0
        for h in handles:
            self.staged.pop(h, None)
            entry = self.entries.pop(h, None)
            if entry is not None:
                freed += entry.nbytes
            if self.on_disk.pop(h, None) is not None:
                freed += self._path(h).stat().st_size if self._path(h).exists() else 0
                self._path(h).unlink(missing_ok=True)
        return freed

    def sizes(self) -> dict[int, tuple[str, int]]:
        """Handle -> (tier, bytes), for the ledger's audit."""
        out = {h: ("host", e.nbytes) for h, e in self.entries.items()}
        out.update({h: ("disk", n) for h, n in self.on_disk.items()})
        return out

    def write_manifest(self, sessions: list[dict]) -> None:
        """Drain: these spilled entries (each a dict naming its `handle`) are to be found
        again by the next start on this folder; at close every other file goes."""
        keep = {int(s["handle"]) for s in sessions}
        missing = sorted(keep - set(self.on_disk))
        if missing:
            raise MissingKv(f"handles {missing[:8]} are not on disk")
        body = {"format": MANIFEST_FORMAT, "fingerprint": self.fingerprint, "sessions": sessions}
        partial = self.disk_dir / (MANIFEST + ".partial")
        self.disk_dir.mkdir(parents=True, exist_ok=True)
        partial.write_text(json.dumps(body))
        os.replace(partial, self.disk_dir / MANIFEST)
        self.persisted = keep

    def adopt_manifest(self) -> list[dict]:
        """Start: the sessions a previous run's manifest lists whose files are here (held
        aside until `claim` makes them spilled entries; the manifest is consumed), and every
        other file in the folder deleted. A manifest of another format or fingerprint adopts
        nothing."""
        if self.disk_dir is None or not self.disk_dir.exists():
            return []
        path = self.disk_dir / MANIFEST
        sessions: list[dict] = []
        try:
            body = json.loads(path.read_text()) if path.exists() else {}
        except (OSError, ValueError):
            body = {}
        if body.get("format") == MANIFEST_FORMAT and body.get("fingerprint") == self.fingerprint:
            for s in body.get("sessions", []):
                file = self._path(int(s["handle"]))
                if file.exists():
                    self.adopted[int(s["handle"])] = file.stat().st_size
                    sessions.append(s)
        path.unlink(missing_ok=True)
        for file in self.disk_dir.iterdir():
            adopted = file.suffix == ".kv" and file.stem.isdigit()
            adopted = adopted and int(file.stem) in self.adopted
            if file.is_file() and not adopted:
                file.unlink(missing_ok=True)
        return sessions

    def claim(self, handles: list[int]) -> None:
        """These adopted entries are the ledger's now (spilled entries as any); the other
        adopted files are deleted."""
        for h in handles:
            if h in self.adopted:
                self.on_disk[h] = self.adopted.pop(h)
        for h in self.adopted:
            self._path(h).unlink(missing_ok=True)
        self.adopted.clear()

    def close(self) -> None:
        """The process ends: without a manifest the disk tier's files die with it; with one,
        the files it lists stay for the next start and every other goes."""
        if self.disk_dir is not None and self.disk_dir.exists():
            if not self.persisted:
                shutil.rmtree(self.disk_dir, ignore_errors=True)
            else:
                for file in self.disk_dir.iterdir():
                    listed = file.suffix == ".kv" and file.stem.isdigit()
                    if file.name != MANIFEST and not (listed and int(file.stem) in self.persisted):
                        file.unlink(missing_ok=True)
        self.on_disk.clear()
        self.staged.clear()

    def _path(self, handle: int) -> Path:
        return self.disk_dir / f"{handle}.kv"

    def _read(self, handle: int) -> StoredKv:
        """A spilled entry, verified: the format, this model's fingerprint, the checksum."""
        path = self._path(handle)
        try:
            with safe_open(str(path), framework="pt") as f:
                metadata = f.metadata() or {}
                tensors = {name: f.get_tensor(name) for name in f.keys()}
        except (OSError, SafetensorError, ValueError) as exc:
            raise CorruptKv(f"spilled KV {handle} cannot be read: {exc}") from None
        if metadata.get("format") != FILE_FORMAT:
            raise CorruptKv(f"spilled KV {handle}: not a {FILE_FORMAT} file")
        if metadata.get("fingerprint") != self.fingerprint:
            raise CorruptKv(f"spilled KV {handle} belongs to another model or KV layout")
        if metadata.get("checksum") != _checksum(tensors):
            raise CorruptKv(f"spilled KV {handle}: checksum mismatch (the file was altered)")
        parts = [tensors[f"part{i}"] for i in range(len(tensors))]
        return StoredKv(parts, sum(p.numel() * p.element_size() for p in parts))


def _checksum(tensors: dict[str, Tensor]) -> str:
    digest = hashlib.blake2b(digest_size=16)
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        digest.update(name.encode())
        digest.update(str(tuple(t.shape)).encode() + str(t.dtype).encode())
        # the tensor's own buffer (no copy; hashlib lets other threads run meanwhile)
        digest.update(t.view(torch.uint8).reshape(-1).numpy())
    return digest.hexdigest()
