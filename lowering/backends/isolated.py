"""onnxruntime sessions in a child process, so that a crash in onnxruntime is an error, not the end.

onnxruntime's kernels can kill the process that runs them (a SIGFPE in an
integer division by zero, an abort in a kernel's own check).  With
``isolate=True`` the ``ort-cpu``/``ort-cuda`` backends build their session in
one long-lived worker process (started on first use, shared by every isolated
session) and send it the inputs of each run; when the worker dies, the run
raises :class:`~graphc.errors.BackendError` naming the signal, and the next
isolated session starts a fresh worker.  Isolation costs a copy of the inputs
and outputs per run, so it is for fuzzing and untrusted models, not timing.
"""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np

from graphc.errors import BackendError

from .ort_options import packing_entry

__all__ = ["IsolatedSession"]


def _serve_fds(read_fd: int, write_fd: int) -> None:  # pragma: no cover - runs in the child process
    """The worker's loop: load sessions, run them, reply on the pipe."""
    import onnxruntime as ort

    receiver, conn = Connection(read_fd, writable=False), Connection(write_fd, readable=False)

    sessions: dict[int, Any] = {}
    while True:
        try:
            request = receiver.recv()
        except EOFError:
            return
        kind, key, payload = request
        try:
            if kind == "load":
                model, providers, threads, basic, folder, prepack = payload
                so = ort.SessionOptions()
                so.log_severity_level = 3
                so.add_session_config_entry(*packing_entry(prepack))
                if folder is not None:  # external data read from the checkpoint's files (lowering.backends.ort_weights)
                    so.add_session_config_entry("session.model_external_initializers_file_folder_path", folder)
                if threads:
                    so.intra_op_num_threads = threads
                if basic:
                    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
                sess = ort.InferenceSession(model, so, providers=providers)
                sessions[key] = sess
                conn.send(("ok", ([o.name for o in sess.get_outputs()], sess.get_providers(), ort.__version__)))
            elif kind == "run":
                sess = sessions[key]
                names = [o.name for o in sess.get_outputs()]
                conn.send(("ok", sess.run(names, payload)))
            elif kind == "drop":
                sessions.pop(key, None)
        except Exception as e:  # noqa: BLE001 - reported to the parent
            conn.send(("error", f"{type(e).__name__}: {e}"))


class _Worker:
    """The child process (a fresh interpreter running :func:`_serve`) and the pipes to it."""

    def __init__(self) -> None:
        to_child_r, to_child_w = os.pipe()
        from_child_r, from_child_w = os.pipe()
        code = f"from lowering.backends.isolated import _serve_fds; _serve_fds({to_child_r}, {from_child_w})"
        root = str(Path(__file__).resolve().parents[2])  # the folder holding lowering/
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
        self.process = subprocess.Popen([sys.executable, "-c", code], pass_fds=(to_child_r, from_child_w), env=env, stdin=subprocess.DEVNULL)
        os.close(to_child_r)
        os.close(from_child_w)
        self.sender = Connection(to_child_w, readable=False)
        self.receiver = Connection(from_child_r, writable=False)
        self.lock = threading.Lock()

    def request(self, kind: str, key: int, payload: object) -> Any:
        with self.lock:
            try:
                self.sender.send((kind, key, payload))
                if kind == "drop":
                    return None
                status, result = self.receiver.recv()
            except (EOFError, OSError):
                raise BackendError(f"onnxruntime's worker process died ({self.death()}) while handling a {kind!r} request") from None
        if status == "error":
            raise BackendError(f"onnxruntime failed in its worker process: {result}")
        return result

    def death(self) -> str:
        try:
            code = self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            return "not responding"
        if code < 0:
            try:
                return f"killed by {signal.Signals(-code).name}"
            except ValueError:
                return f"killed by signal {-code}"
        return f"exit code {code}"

    @property
    def alive(self) -> bool:
        return self.process.poll() is None


_WORKER: _Worker | None = None
_KEYS = itertools.count()


def _worker() -> _Worker:
    global _WORKER
    if _WORKER is None or not _WORKER.alive:
        _WORKER = _Worker()
    return _WORKER


class IsolatedSession:
    """An onnxruntime ``InferenceSession`` living in the worker process.

    ``basic_optimizations`` limits onnxruntime's graph rewrites to the basic
    level (see :mod:`lowering.backends.ort_backend`); ``weights_folder`` is the folder of
    the model's external data; ``prepack`` as :class:`~lowering.backends.ort_options.OrtOptions` says.  ``outputs``, ``providers`` and ``version``
    describe the session as the worker built it.  :meth:`run` raises :class:`BackendError` when onnxruntime
    fails or the worker dies; a session whose worker died cannot run again.
    """

    def __init__(
        self,
        model: bytes,
        providers: Sequence[str],
        threads: int | None = None,
        basic_optimizations: bool = False,
        weights_folder: str | None = None,
        prepack: bool = False,
    ) -> None:
        self._worker = _worker()
        self._key = next(_KEYS)
        payload = (model, list(providers), threads, basic_optimizations, weights_folder, prepack)
        self.outputs, self.providers, self.version = self._worker.request("load", self._key, payload)

    def run(self, feeds: Mapping[str, np.ndarray]) -> list[np.ndarray]:
        """Run the session on ``feeds``; returns the outputs in :attr:`outputs` order."""
        if not self._worker.alive:
            raise BackendError(f"onnxruntime's worker process died earlier ({self._worker.death()}); prepare the graph again")
        return list(self._worker.request("run", self._key, dict(feeds)))

    def __del__(self) -> None:
        try:
            if self._worker.alive:
                self._worker.request("drop", self._key, None)
        except Exception:  # noqa: BLE001 - best effort at interpreter exit
            pass
