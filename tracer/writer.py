"""Background writer: turns step records into committed Parquet segments and keeps the manifest.

Training never waits on the disk in normal operation: a segment is handed to one daemon thread,
which writes every table's file as `*.tmp`, renames them, and then writes the segment's commit
record (schema.commit_path), so a reader sees all of a segment's tables or none of them. One
segment is in flight at a time: the next flush waits for it (capped at `max_wait_s`), so a kill
loses at most the open segment and the one being written, never a backlog. Any failure
(unwritable directory, full disk, a writer stuck past the cap) drops that segment's steps, counts
them, and keeps going; the recorder turns the first failure into a warning on the training thread.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import queue
import re
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from . import schema

if TYPE_CHECKING:
    import pyarrow as pa

_INCARNATION_DIR = re.compile(r"^incarnation=(\d+)$")


@dataclass
class Segment:
    """The rows of one segment: every table's columns for a run of consecutive steps."""

    steps: np.ndarray                                   # (S,) int64 step numbers
    components: list[str]
    stats: np.ndarray                                   # (S, C, M) float64, M = HEALTH_METRICS
    valid: np.ndarray                                   # (S, C, M) bool; False = null
    tables: dict[str, dict[str, list[object]]] = field(default_factory=dict)
    # fills in what needs host copies of device values; run by the writer thread before writing
    finish: Callable[[], None] | None = None


def round_significand(values: np.ndarray, bits: int) -> np.ndarray:
    """float32 `values` rounded to nearest, ties to even, to `bits` (0-22) significand bits after
    the leading one: a normal number moves by at most 2**-(bits + 1) of itself. NaN, ±inf and ±0
    are kept; a finite value never rounds to infinity (the largest ones are cut instead)."""
    x = np.ascontiguousarray(values, dtype=np.float32)
    drop = 23 - bits
    if drop <= 0:
        return x.copy()
    u = x.view(np.uint32)
    mask = np.uint32((0xFFFFFFFF << drop) & 0xFFFFFFFF)
    # the bias rounds half to even: it carries exactly when the dropped bits exceed half, or
    # equal it and the kept lowest bit is 1; a carry into the exponent is the correct result
    r = u >> np.uint32(drop)
    r &= np.uint32(1)
    r += np.uint32((1 << (drop - 1)) - 1)
    r += u  # NaN bit patterns may wrap around: restored below
    r &= mask
    out = r.view(np.float32)
    odd = ~np.isfinite(out)  # a non-finite value, or a finite one rounded up to infinity
    if odd.any():
        was = x[odd]
        out[odd] = np.where(np.isfinite(was), (u[odd] & mask).view(np.float32), was)
    return out


def round_estimates(seg: Segment, bits: dict[str, int]) -> None:
    """Round `seg`'s health columns named in `bits` in place, as they will be stored (float32):
    one pass per distinct bit count over all of its columns."""
    for b in sorted(set(bits.values())):
        cols = [schema.HEALTH_METRICS.index(name) for name, nb in bits.items() if nb == b]
        with np.errstate(over="ignore"):  # beyond float32's range: inf, as the column stores it
            block = seg.stats[:, :, cols].astype(np.float32)
        seg.stats[:, :, cols] = round_significand(block, b)


def rounded_table(table: pa.Table) -> pa.Table:
    """`health` rows already written (a Parquet table) with their estimate columns rounded as
    the recorder stores them by default (`schema.Column.bits`); nulls stay null."""
    import pyarrow as pa

    for c in schema.HEALTH_COLUMNS:
        if c.bits is not None and c.name in table.column_names:
            col = table[c.name]
            values = round_significand(col.to_numpy(zero_copy_only=False).astype(np.float32), c.bits)
            table = table.set_column(table.column_names.index(c.name), c.name, pa.array(
                values, pa.float32(), mask=col.is_null().to_numpy(zero_copy_only=False)))
    return table


def health_table(seg: Segment) -> pa.Table:
    """The `health` rows of a segment: one per (step, component), metrics null where not valid."""
    import pyarrow as pa

    n_steps, n_comp, _ = seg.stats.shape
    cols: dict[str, pa.Array] = {
        "step": pa.array(np.repeat(seg.steps, n_comp), pa.int64()),
        "component": pa.array(seg.components * n_steps, pa.string()),
    }
    for m, name in enumerate(schema.HEALTH_METRICS):
        typ = schema.SCHEMAS["health"].field(name).type
        values = seg.stats[:, :, m].reshape(-1)
        mask = ~seg.valid[:, :, m].reshape(-1)
        if pa.types.is_integer(typ):
            values = np.nan_to_num(values, nan=0.0, posinf=0.0, neginf=0.0).astype(np.int64)
        cols[name] = pa.array(values.astype(typ.to_pandas_dtype()), typ, mask=mask)
    return pa.Table.from_pydict(cols, schema=schema.SCHEMAS["health"])


def _table(name: str, cols: dict[str, list[object]]) -> pa.Table:
    """One table of a segment; a column the rows do not carry is written as nulls, not an error
    (a schema column added later must not cost the steps of a caller that predates it)."""
    import pyarrow as pa

    rows = len(next(iter(cols.values()), []))
    full = {f.name: cols.get(f.name, [None] * rows) for f in schema.SCHEMAS[name]}
    return pa.Table.from_pydict(full, schema=schema.SCHEMAS[name])


def next_incarnation(root: Path, rank: int) -> int:
    """1 for a fresh directory, else one more than any incarnation this rank has left behind."""
    seen = [0]
    try:
        manifest = json.loads(schema.manifest_path(root, rank).read_text())
        seen += [int(i["incarnation"]) for i in manifest.get("incarnations", [])]
    except (OSError, ValueError, KeyError, TypeError):
        pass
    for table in (*schema.TABLES, schema.COMMIT_DIR):  # a folder claimed and not yet written too
        rank_dir = Path(root) / table / f"rank={rank}"
        if rank_dir.is_dir():
            seen += [int(m.group(1)) for d in rank_dir.iterdir()
                     if (m := _INCARNATION_DIR.match(d.name))]
    return max(seen) + 1


def claim_incarnation(root: Path, rank: int) -> int:
    """`next_incarnation`, claimed by making its folder of commit records: of two processes that
    start on one trace directory at once, the second to make it takes the next number. (A
    directory that cannot be written keeps the number; the first write reports the problem.)"""
    incarnation = next_incarnation(root, rank)
    folder = Path(root) / schema.COMMIT_DIR / f"rank={rank}"
    for _ in range(10_000):
        try:
            folder.mkdir(parents=True, exist_ok=True)
            (folder / f"incarnation={incarnation}").mkdir()
            return incarnation
        except FileExistsError:
            incarnation += 1
        except OSError:
            break
    return incarnation


# the writers of each manifest in this process, one at a time (a record lock below excludes
# other processes, not other threads)
_manifest_locks: dict[str, threading.Lock] = {}
_manifest_locks_guard = threading.Lock()
MANIFEST_LOCK_WAIT_S = 1.0


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[bool]:
    """The block run alone among this process's writers of the manifest whose lock file is
    `path`, and among other processes' (a POSIX record lock on `path`, made if missing, which a
    forked child does not inherit). Each lock is waited for at most `MANIFEST_LOCK_WAIT_S`;
    past that, or where the system or the file system has no such lock, the block runs without
    it (a manifest written late or unmerged beats a training thread held). Yields whether both
    locks are held."""
    with _manifest_locks_guard:  # one lock per file, however its path is spelt
        own = _manifest_locks.setdefault(os.path.realpath(path), threading.Lock())
    held = own.acquire(timeout=MANIFEST_LOCK_WAIT_S)
    fd, recorded = None, False
    try:
        try:
            if not held:  # a second descriptor's close would let go the holder's record lock
                raise OSError("the thread lock was not had")
            import fcntl

            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            deadline = time.monotonic() + MANIFEST_LOCK_WAIT_S
            while not recorded:
                try:
                    fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    recorded = True
                except (BlockingIOError, PermissionError):  # another process holds it
                    if time.monotonic() >= deadline:
                        break
                    time.sleep(0.005)
        except (ImportError, OSError):  # not POSIX, or no record locks here
            pass
        yield held and recorded
    finally:
        if fd is not None:
            os.close(fd)  # lets the record lock go
        if held:
            own.release()


def _versions() -> dict[str, str]:
    import torch

    try:
        from importlib.metadata import version
        own = version("warninglight")
    except Exception:  # not installed as a distribution (e.g. a source checkout)
        own = "unknown"
    return {"python": platform.python_version(), "torch": torch.__version__, "warninglight": own}


def _remove(path: Path) -> None:
    """Delete a file this writer made, if it can (its folder may be gone)."""
    with contextlib.suppress(OSError):
        path.unlink()


def _atomic_write(path: Path, data: bytes) -> None:
    """`path` replaced whole by `data`, through a temporary file of this process and thread's
    own: writers of one file at once (a writer thread and `close()`, two processes on one trace
    directory) never rename one another's."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}-{threading.get_ident()}{schema.TMP_SUFFIX}")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    except BaseException:
        _remove(tmp)
        raise


class TraceWriter:
    """Owns one rank's part of a trace directory: its segments, commit records and manifest."""

    def __init__(self, root: str | os.PathLike[str], rank: int, world_size: int, run_id: str,
                 model_class: str, config: dict[str, object], max_wait_s: float = 2.0,
                 significand_bits: dict[str, int] | None = None) -> None:
        self.root = Path(root)
        # health columns stored rounded (schema.SAMPLED_BITS): before any reader sees the
        # segment, so live alarms judge the values the trace keeps
        self.significand_bits = dict(significand_bits or {})
        self.rank = rank
        self.incarnation = claim_incarnation(self.root, rank)
        self.dropped_steps = 0
        self.errors: list[str] = []
        self.max_wait_s = max_wait_s
        self.waited_s = 0.0  # training-thread time spent waiting for the previous segment
        self._seq = 0
        # Segments handed over / finished: each counter has one writing thread (the training
        # thread and the writer thread), so no lock is needed to compare them. The wait polls
        # instead of blocking on a Condition: the SIGTERM handler may interrupt the training
        # thread inside the wait and flush again, and a Condition's lock is not re-entrant.
        self._submitted = 0
        self._finished = 0
        self._behind = False  # the last wait hit the cap: don't wait again until it catches up
        self._queue: queue.SimpleQueue[Segment | None] = queue.SimpleQueue()
        self._lock = threading.RLock()
        # called on this thread with each segment once its files are in place (live alarms)
        self.on_segment: Callable[[Segment], None] | None = None
        self.manifest = self._load_manifest(run_id, world_size, model_class, config)
        self._entry: dict[str, object] = {
            "incarnation": self.incarnation, "started_at": time.time(), "ended_at": None,
            "status": "running", "first_step": None, "last_step": None, "steps_recorded": 0,
            "dropped_steps": 0, "segments": 0, "flush_wait_s": 0.0, "warnings": [],
        }
        self.manifest["incarnations"].append(self._entry)
        self._guard(self._write_manifest, 0)
        self._thread = threading.Thread(target=self._run, name="warninglight-writer", daemon=True)
        self._thread.start()

    @property
    def busy(self) -> bool:
        """A segment handed over is not yet committed (or failed)."""
        return self._finished < self._submitted

    def _load_manifest(self, run_id: str, world_size: int, model_class: str,
                       config: dict[str, object]) -> dict[str, object]:
        try:
            old = json.loads(schema.manifest_path(self.root, self.rank).read_text())
            incarnations = list(old.get("incarnations", []))
            run_id, started = old.get("run_id", run_id), old.get("started_at", time.time())
        except (OSError, ValueError):
            incarnations, started = [], time.time()
        return {"format_version": schema.FORMAT_VERSION, "run_id": run_id, "rank": self.rank,
                "world_size": world_size, "started_at": started, "model_class": model_class,
                "host": platform.node(),  # where a transient fault happened, for `rerun`'s verdict
                "versions": _versions(), "config": config, "incarnations": incarnations}

    def ready(self) -> bool:
        """Wait (at most `max_wait_s`) until the previous segment is committed; False if it is not.

        Normally returns at once: a segment is written in milliseconds and flushes are many steps
        apart. After a wait hits the cap, later calls return False without waiting until the
        writer has caught up, so a stalled disk costs the training thread one cap, not one per flush.
        """
        if not self.busy:
            self._behind = False
            return True
        if self._behind or not self._thread.is_alive():
            return False
        t0 = time.perf_counter()
        deadline = t0 + self.max_wait_s
        while self.busy and time.perf_counter() < deadline:
            time.sleep(0.001)
        self.waited_s += time.perf_counter() - t0
        self._entry["flush_wait_s"] = round(self.waited_s, 6)
        self._behind = self.busy
        return not self._behind

    def submit(self, seg: Segment, final: bool = False) -> bool:
        """Hand a segment to the writer; False (its steps counted as dropped) if it cannot take it.

        `final`: the last segment, handed over by `close()`, which waits for the writer anyway.
        """
        if not self._thread.is_alive() or not (final or self.ready()):
            why = ("writer stopped" if not self._thread.is_alive() else
                   f"previous segment still being written after {self.max_wait_s:g} s")
            self.record_failure(f"{why}: dropped {len(seg.steps)} steps", len(seg.steps))
            return False
        self._submitted += 1
        self._queue.put(seg)
        return True

    def close(self, status: str, timeout_s: float = 60.0) -> None:
        """Write what was handed over, then the final manifest; waits at most `timeout_s`."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(timeout_s)
        self._entry["status"] = status
        self._entry["ended_at"] = time.time()
        self._guard(self._write_manifest, 0)

    def _run(self) -> None:
        # pyarrow is imported here, not by `watch()` on the training thread; a failure to
        # import it fails the first segment's write, counted like any write failure
        with contextlib.suppress(ImportError):
            import pyarrow.parquet  # noqa: F401
        while (seg := self._queue.get()) is not None:
            self._guard(self._write_segment, len(seg.steps), seg)
            # the segment is committed or dropped by now: a manifest that fails to follow
            # loses no step (the next write, or close's, brings it up to date)
            self._guard(self._write_manifest, 0)
            self._finished += 1
            if self.on_segment is not None:
                self._guard(self.on_segment, 0, seg)

    def _guard(self, fn, n_steps: int, *args: object) -> None:  # type: ignore[no-untyped-def]
        try:
            fn(*args)
        except Exception as exc:  # never raise into training: count and report instead
            self.record_failure(f"{type(exc).__name__}: {exc}", n_steps)

    def record_failure(self, message: str, n_steps: int) -> None:
        """Count `n_steps` as dropped and keep the message for the manifest."""
        with self._lock:
            self.dropped_steps += n_steps
            self._entry["dropped_steps"] = self.dropped_steps
            self.errors.append(message)
            if len(self._entry["warnings"]) < 20:  # type: ignore[arg-type]
                self._entry["warnings"].append(message)  # type: ignore[attr-defined]

    def _write_segment(self, seg: Segment) -> None:
        if seg.finish is not None:
            seg.finish()
        if self.significand_bits:
            round_estimates(seg, self.significand_bits)
        seq = self._seq
        self._seq += 1  # a failed segment's number is not reused: names stay unique
        span = (int(seg.steps[0]), int(seg.steps[-1])) if len(seg.steps) else None
        tables = {name: _table(name, cols) for name, cols in seg.tables.items()}
        tables["health"] = health_table(seg)
        placed: list[Path] = []
        try:
            for name, data in tables.items():
                placed.append(self._write_table(name, data, seq, span))
            record = {"tables": {name: data.num_rows for name, data in tables.items()},
                      "steps": list(span) if span else None}
            # the commit: from here on the segment's files are visible to readers, all at once
            _atomic_write(schema.commit_path(self.root, self.rank, self.incarnation, seq, span),
                          json.dumps(record).encode())
        except BaseException:
            for path in placed:  # our own uncommitted files: readers would ignore them anyway
                _remove(path)
            raise
        if len(seg.steps):
            first = self._entry["first_step"]
            self._entry["first_step"] = int(seg.steps[0]) if first is None else first
            self._entry["last_step"] = int(seg.steps[-1])
            self._entry["steps_recorded"] += len(seg.steps)  # type: ignore[operator]
        self._entry["segments"] += 1  # type: ignore[operator]

    def _write_table(self, table: str, data: pa.Table, seq: int,
                     span: tuple[int, int] | None) -> Path:
        path = schema.segment_path(self.root, table, self.rank, self.incarnation, seq, span)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + schema.TMP_SUFFIX)
        import pyarrow.parquet as pq

        try:
            pq.write_table(data, tmp, **schema.PARQUET_WRITE_OPTIONS)
        except BaseException:
            _remove(tmp)
            raise
        os.replace(tmp, path)
        return path

    def _write_manifest(self) -> None:
        """This incarnation's entry into the rank's manifest. Under a lock shared with other
        processes (`_locked`), the manifest as it stands on disk keeps the run's identity and
        every other incarnation's entry: another process writing into the same directory loses
        nothing. The training thread's `record_failure` never waits for the file."""
        path = schema.manifest_path(self.root, self.rank)
        with _locked(path.with_name(f"rank={self.rank}.lock")):
            try:
                disk = json.loads(path.read_text())
            except (OSError, ValueError):
                disk = None
            with self._lock:
                if isinstance(disk, dict) and isinstance(disk.get("incarnations"), list):
                    others = [e for e in disk["incarnations"]
                              if isinstance(e, dict) and e.get("incarnation") != self.incarnation]
                    self.manifest["incarnations"] = sorted(
                        [*others, self._entry],
                        key=lambda e: e.get("incarnation") if isinstance(e.get("incarnation"), int) else 0)
                    for key in ("run_id", "started_at"):
                        if key in disk:
                            self.manifest[key] = disk[key]
                text = json.dumps(self.manifest, indent=1, default=str)
            _atomic_write(path, text.encode())
