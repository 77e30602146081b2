"""Optuna storage: SQLite by default (embedded), any SQLAlchemy URL (PostgreSQL, MySQL) to share
a study between processes and hosts, and recovery of trials whose owner died.

A trial's owner is recorded as user attribute `owner` = "<host>:<pid>". A trial still RUNNING
whose owner is a dead process on this host is failed at once (resume after SIGKILL); one owned
elsewhere is failed by Optuna's heartbeat once its owner stops beating. Either way its config is
enqueued again, so nothing is skipped; finished trials are committed rows and never lost.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import random
import socket
import tempfile
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import optuna
import sqlalchemy.engine
import sqlalchemy.exc
from optuna.storages import RDBStorage, RetryHeartbeatStaleTrialCallback
from optuna.trial import TrialState

DEFAULT_STORAGE_FILE = Path("results") / "tune" / "studies.db"
OWNER_ATTR = "owner"


def default_storage_url() -> str:
    return f"sqlite:///{DEFAULT_STORAGE_FILE}"


def owner_tag() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


_URL_EXAMPLE = "sqlite:///results/tune/studies.db or postgresql+psycopg://user@host/db"


def check_storage_url(url: str) -> None:
    """A one-line ValueError unless Optuna can open `url` here: a SQLAlchemy URL whose backend
    and driver are installed and, for a SQLite file, whose file can be created. Connects to
    nothing (a server's reachability shows when the study starts)."""
    try:
        parsed = sqlalchemy.engine.make_url(url)
    except sqlalchemy.exc.ArgumentError:
        raise ValueError(f"{url!r} is not a storage URL; expected a SQLAlchemy URL "
                         f"dialect+driver://..., such as {_URL_EXAMPLE}") from None
    shown = parsed.render_as_string(hide_password=True)
    try:
        dialect = parsed.get_dialect()
    except sqlalchemy.exc.NoSuchModuleError:
        raise ValueError(f"{shown!r}: unknown database {parsed.drivername!r}; expected a URL "
                         f"such as {_URL_EXAMPLE}") from None
    try:
        dialect.import_dbapi()
    except ImportError as exc:
        raise ValueError(f"{shown!r}: its driver {parsed.get_driver_name()!r} is not installed "
                         f"({exc}); install it, e.g. pip install \"psycopg[binary]\" for "
                         "postgresql+psycopg") from None
    path = _sqlite_file(url)
    problem = file_problem(Path(path)) if path else None
    if problem:
        raise ValueError(f"{shown!r}: cannot create the database file: {problem}")


def file_problem(path: Path) -> str | None:
    """Why a file cannot be written at `path` (its missing folders created), or None."""
    if path.is_dir():
        return f"{path} is a folder"
    if path.exists():
        return None if os.access(path, os.W_OK) else f"{path} is not writable"
    parent = path.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        return f"{parent} is not a folder"
    try:  # really try: os.access says yes to root even where nothing can be created (/proc)
        with tempfile.TemporaryFile(dir=parent):
            pass
    except OSError as exc:
        return f"cannot create files in {parent} ({exc.strerror})"
    return None


def make_storage(url: str | None, *, heartbeat_s: int = 30) -> RDBStorage:
    """An RDBStorage for `url` (None: the default SQLite file, its folder created)."""
    url = url or default_storage_url()
    check_storage_url(url)
    engine_kwargs: dict = {}
    if url.startswith("sqlite"):
        path = _sqlite_file(url)
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        # Several processes share one file: wait for the write lock instead of failing.
        engine_kwargs = {"connect_args": {"timeout": 120}}
    else:
        engine_kwargs = {"pool_pre_ping": True}
    # Tuners started together on a fresh database race to create Optuna's tables; the loser
    # gets an integrity error and, on retry, finds the tables there.
    for attempt in range(6):
        try:
            with warnings.catch_warnings():  # heartbeats are "experimental" since Optuna 2.9
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                return _rdb_storage(url, engine_kwargs, heartbeat_s)
        except sqlalchemy.exc.DBAPIError:
            if attempt == 5:
                raise
            time.sleep(0.2 + random.random() * (attempt + 1))
    raise AssertionError("unreachable")


_ASK_LOCKS: dict[str, threading.Lock] = {}
_ASK_LOCKS_GUARD = threading.Lock()


def _sqlite_file(url: str) -> str:
    """The database file of a SQLite URL ("" for other URLs and in-memory databases)."""
    path = url.split(":///", 1)[-1] if url.startswith("sqlite") else ""
    return "" if path == ":memory:" else path


def _storage_url(storage) -> str:
    backend = getattr(storage, "_backend", storage)  # Optuna wraps RDBStorage in a cache
    return str(getattr(backend, "url", ""))


@contextlib.contextmanager
def ask_lock(storage) -> Iterator[None]:
    """Serialise `study.ask()` on one storage. Asking pops a WAITING (enqueued) trial by a
    read-then-write that PostgreSQL and MySQL lock (SELECT ... FOR UPDATE) but SQLite does
    not: two askers can both get the same trial, and the second to finish it fails with
    UpdateFinishedTrialError. So threads of one process share a lock, and processes on one
    SQLite file take an advisory file lock beside it."""
    url = _storage_url(storage)
    with _ASK_LOCKS_GUARD:
        lock = _ASK_LOCKS.setdefault(url, threading.Lock())
    with lock:
        path = _sqlite_file(url)
        if not path:
            yield
            return
        with open(f"{path}.ask.lock", "a") as fh:
            fcntl.flock(fh, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(fh, fcntl.LOCK_UN)


def _rdb_storage(url: str, engine_kwargs: dict, heartbeat_s: int) -> RDBStorage:
    return RDBStorage(
        url,
        engine_kwargs=engine_kwargs,
        heartbeat_interval=heartbeat_s,
        grace_period=heartbeat_s * 4,
        heartbeat_stale_trial_callback=RetryHeartbeatStaleTrialCallback(max_retry=2),
    )


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# An ownerless RUNNING trial on a shared database server may be mid-ask on another host (the
# owner is written right after ask); older than this, its asker is taken for dead.
ORPHAN_AGE_S = 600.0


def _is_orphan(t, host: str, local: bool) -> bool:
    owner = t.user_attrs.get(OWNER_ATTR, "")
    if not owner:
        # Killed between ask() and writing its owner (both under the ask lock, which we hold).
        age = (time.time() - t.datetime_start.timestamp()) if t.datetime_start else 0.0
        return local or age > ORPHAN_AGE_S
    h, _, pid = owner.rpartition(":")
    return h == host and pid.isdigit() and not _pid_alive(int(pid))


def reap_dead_trials(study: optuna.Study) -> int:
    """Fail RUNNING trials whose owner process on this host is dead (or that never got an
    owner) and enqueue their configs again; then let the heartbeat fail stale trials of other
    hosts. Returns how many."""
    host = socket.gethostname()
    storage = study._storage
    local = _storage_url(storage).startswith("sqlite")
    reaped = 0
    with ask_lock(storage):
        for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
            if not _is_orphan(t, host, local):
                continue  # alive, or on another host (the heartbeat covers those)
            owner = t.user_attrs.get(OWNER_ATTR, "") or "unknown (killed while asking)"
            try:
                storage.set_trial_user_attr(t._trial_id, "fail_reason", f"owner {owner} died")
                # Killed after writing its measurement's attributes but before telling the
                # study: nothing was recorded, so the trial must not count as evaluated.
                if t.user_attrs.get("evaluated"):
                    storage.set_trial_user_attr(t._trial_id, "evaluated", False)
                if not storage.set_trial_state_values(t._trial_id, state=TrialState.FAIL):
                    continue
            except optuna.exceptions.UpdateFinishedTrialError:
                continue  # another process reaped it first
            reaped += 1
            # A seed popped from the queue has its config only as fixed params.
            params = t.params or t.system_attrs.get("fixed_params") or {}
            if params and (t.user_attrs.get("candidate") or not t.params):
                study.enqueue_trial(params, user_attrs={"retry_of": t.number})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        optuna.storages.fail_stale_trials(study)
    return reaped


class Heartbeat:
    """Beats for the trials a worker has in flight (ask/tell does not start Optuna's own)."""

    def __init__(self, storage: RDBStorage) -> None:
        self._storage = storage
        self._ids: set[int] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        interval = storage.get_heartbeat_interval() or 30
        self._thread = threading.Thread(target=self._run, args=(interval,), daemon=True)
        self._thread.start()

    def add(self, trial_id: int) -> None:
        with self._lock:
            self._ids.add(trial_id)
        self._storage.record_heartbeat(trial_id)

    def remove(self, trial_id: int) -> None:
        with self._lock:
            self._ids.discard(trial_id)

    def _run(self, interval: float) -> None:
        while not self._stop.wait(interval):
            with self._lock:
                ids = list(self._ids)
            for i in ids:
                try:
                    self._storage.record_heartbeat(i)
                except Exception:  # a transient DB error must not kill the worker
                    pass

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
