"""tinygrad's on-disk compile cache, usable from every thread.

tinygrad keeps one module-level sqlite connection for its cache (compiled kernels, BEAM
results), and sqlite refuses a connection in any thread but the one that opened it. The engine
steps in its own thread, so a kernel compiled there after one compiled in the caller's thread
(a tree step first met while serving, after a warm-up in the main thread) failed with sqlite's
ProgrammingError. `install_thread_connections` gives each thread its own connection to the
same file (sqlite's WAL journal, which tinygrad sets, lets them share it).
"""

from __future__ import annotations

import threading

from tinygrad import helpers

_local = threading.local()
_opening = threading.Lock()
_shared_connection = helpers.db_connection


def _thread_connection():
    connection = getattr(_local, "connection", None)
    if connection is None:
        with _opening:  # tinygrad's opener fills its one global: open, take it, put the old one back
            previous, helpers._db_connection = helpers._db_connection, None
            try:
                connection = _local.connection = _shared_connection()
            finally:
                helpers._db_connection = previous
    return connection


def install_thread_connections() -> None:
    """Route tinygrad's cache reads and writes through a connection per thread (idempotent)."""
    helpers.db_connection = _thread_connection
