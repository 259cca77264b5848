"""`convert(..., processes=N)`: N local processes, a `jax.distributed` job on the loopback.

The parent pickles the call into a file, starts N children (`python -m
lazyckpt._convert.launch FILE`), each of which joins the job (127.0.0.1, a free port,
gloo collectives on CPU) and calls `convert` with the same arguments, so that the job
divides the work as one launched by a cluster would. Process 0 shows progress; the
others' output reaches the parent's stderr, each line prefixed `[process i]`. When a
child fails or dies, the parent lets the others end within a grace period, then stops
them (a process waiting in a collective for a dead one would wait for ever), and
raises the failing process's error, naming every process that failed.

Stopping a child is SIGINT first (it unwinds as on Ctrl-C: its temporary folder is
removed), SIGKILL only after `STOP_SECONDS`. The grace does not know whether the job
had already agreed that every process wrote its share (that agreement is inside
`convert`); so while process 0, which publishes after it, is alive and has not
reported, the wait goes on up to `PUBLISH_GRACE_SECONDS` rather than kill it
mid-publish (the cost: a job whose process 0 hangs for a dead peer is stopped that much
later; gloo's collectives usually fail at once when a peer's connection closes); and a
result from process 0 is the job's result (it returns only after the final agreement).

The children run with JAX_PLATFORMS=cpu unless the caller's environment sets it (a
conversion needs no accelerator; a TPU opens in one process only, and each child would
take most of a GPU's memory), and with the parent's `sys.path` as PYTHONPATH. Each
child deletes its job file (the pickled call, `storage_options` included) as soon as it
has read it.
"""

from __future__ import annotations

import contextlib
import ctypes
import inspect
import io
import json
import os
import pickle
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import IO, Any

from lazyckpt._errors import ArgumentError, LazyckptError, error_class
from lazyckpt._storage import multihost

GRACE_SECONDS = 20.0
"""How long the others may take to end by themselves once one process has failed: long
enough to raise their own errors, which name the failure, on a busy machine."""

PUBLISH_GRACE_SECONDS = 600.0
"""The grace of process 0 while it runs and has not reported: a process that died
after the job agreed leaves process 0 merging and publishing, which must not be cut."""

STOP_SECONDS = 10.0
"""How long a child asked to stop (SIGINT) may take to clean up before SIGKILL."""

_TAIL_LINES = 20
"""Lines of a child's output kept to explain a death without an error."""


def processes_argument(processes: object) -> int:
    """`processes=` checked: a whole number of 1 or more."""
    if isinstance(processes, bool) or not isinstance(processes, int) or processes < 1:
        raise ArgumentError(
            f"processes={processes!r}: pass a whole number of 1 or more (1 converts in this "
            "process; N starts N local processes that divide the work)"
        )
    jax = sys.modules.get("jax")  # (asks no backend unless in a job: it may be a TPU's)
    if (
        processes > 1
        and jax is not None
        and jax.distributed.is_initialized()
        and multihost.count() > 1
    ):
        raise ArgumentError(
            f"processes={processes}: this process is already one of {multihost.count()} "
            "processes of a jax.distributed job, where convert divides the work among them; "
            "leave out processes= (or pass 1)"
        )
    return processes


def run_processes(processes: int, call: Callable[..., object], arguments: Mapping[str, Any]) -> Any:
    """`call` in each of `processes` local processes of one job, with those of
    `arguments` (the caller's `locals()`) that it takes, but `processes`; process 0's
    result (see the module docstring). The processes run with JAX_PLATFORMS=cpu unless
    the caller's environment sets JAX_PLATFORMS, and with this `sys.path` as PYTHONPATH."""
    taken = inspect.signature(call).parameters
    kwargs = {name: arguments[name] for name in taken if name != "processes"}
    for name, value in kwargs.items():
        _check_picklable(name, value)
    with tempfile.TemporaryDirectory(prefix="lazyckpt-processes-") as folder:
        job = _Job(Path(folder), processes, call, dict(kwargs))
        try:
            job.start()
            job.wait()
        finally:
            job.stop()
        return job.result()


def _check_picklable(name: str, value: object) -> None:
    try:
        data = pickle.dumps(value)
    except Exception as error:  # noqa: BLE001 - any pickling failure, named below
        if callable(value):  # (a function's repr names it, and holds no secret)
            raise ArgumentError(
                f"{name}={value!r} cannot be sent to the other processes ({error}); with "
                "processes=N, pass a function defined at the top level of a module (not a "
                "lambda or a nested function), or an object that pickles"
            ) from None
        # Not the value: storage_options and the like hold credentials.
        culprit = _unpicklable(value)
        raise ArgumentError(
            f"{name} holds a {culprit}, which cannot be sent to another process; with "
            f"processes=N, pass a {name} made of values that pickle (text, numbers, "
            "lists, dicts, functions defined at the top level of a module)"
        ) from None
    if callable(value) and b"__main__" in data:  # (pickled by a name only __main__ has)
        raise ArgumentError(
            f"{name}={value!r} is defined in the script being run (__main__), which the "
            "other processes do not import; with processes=N, define it in a module they "
            "can import"
        )


def _unpicklable(value: object, depth: int = 0) -> str:
    """The qualified type name of the innermost part of `value` that does not pickle."""
    parts: list[object] = []
    if isinstance(value, Mapping):
        parts = [*value.keys(), *value.values()]
    elif isinstance(value, (list, tuple, set, frozenset)):
        parts = list(value)
    elif hasattr(value, "__dict__") and not isinstance(value, type):
        parts = list(vars(value).values())
    for part in parts if depth < 20 else ():
        try:
            pickle.dumps(part)
        except Exception:  # noqa: BLE001 - this part is the one, or holds it
            return _unpicklable(part, depth + 1)
    kind = type(value)
    return (
        kind.__qualname__
        if kind.__module__ == "builtins"
        else f"{kind.__module__}.{kind.__qualname__}"
    )


def _child_environment() -> dict[str, str]:
    """The parent's environment, with the children's JAX_PLATFORMS and PYTHONPATH."""
    env = dict(os.environ)
    env.setdefault("JAX_PLATFORMS", "cpu")  # (the caller's choice when it set one)
    env["PYTHONPATH"] = os.pathsep.join(p or os.getcwd() for p in sys.path)
    return env


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class _Job:
    """The children of one `run_processes`, their files and their output."""

    def __init__(
        self, folder: Path, count: int, call: Callable[..., object], kwargs: dict[str, Any]
    ) -> None:
        self.folder, self.count = folder, count
        self.call, self.kwargs = call, kwargs
        self.children: list[subprocess.Popen[bytes]] = []
        self.tails: list[list[str]] = [[] for _ in range(count)]
        self.failed: list[int] = []  # in the order the parent saw them end
        self.stopped: list[int] = []  # killed by the parent
        self._pumps: list[threading.Thread] = []

    def start(self) -> None:
        port, env = _free_port(), _child_environment()
        for process in range(self.count):
            kwargs = self.kwargs if process == 0 else {**self.kwargs, "progress": False}
            job = self.folder / f"job-{process}.pickle"
            with open(job, "wb") as f:
                # The header first: the child joins the job before it unpickles the call.
                header = {"process": process, "processes": self.count, "port": port}
                pickle.dump({**header, "path": sys.path, "parent": os.getpid()}, f)
                pickle.dump((self.call, kwargs), f)
            piped = process != 0  # (process 0 draws the progress bar on the terminal)
            child = subprocess.Popen(
                [sys.executable, "-m", "lazyckpt._convert.launch", str(job)],
                stdin=subprocess.DEVNULL,
                env=env,
                stdout=subprocess.PIPE if piped else _stderr(),
                stderr=subprocess.STDOUT if piped else None,
            )
            self.children.append(child)
            if child.stdout is not None:
                pump = threading.Thread(target=self._pump, args=(process, child.stdout))
                pump.start()
                self._pumps.append(pump)

    def _pump(self, process: int, stream: IO[bytes]) -> None:
        with stream:
            for raw in stream:
                line = raw.decode(errors="replace").rstrip("\n")
                self.tails[process] = [*self.tails[process][-_TAIL_LINES + 1 :], line]
                with contextlib.suppress(Exception):  # (a closed stderr loses lines, not the job)
                    print(f"[process {process}] {line}", file=sys.stderr, flush=True)

    def wait(self) -> None:
        """Until every child has ended, or one failed and the rest ended or were killed
        after the grace period."""
        deadline: float | None = None
        while True:
            running = []
            for process, child in enumerate(self.children):
                code = child.poll()
                if code is None:
                    running.append(process)
                elif code != 0 and process not in self.failed:
                    self.failed.append(process)
            if not running:
                return
            if self.failed and deadline is None:
                deadline = time.monotonic() + GRACE_SECONDS
            if deadline is not None and time.monotonic() > deadline:
                if 0 not in running or self._reported(0):
                    return
                # Process 0 runs and has not reported: it may be publishing after the
                # job agreed (see the module docstring), so it gets the longer grace.
                if time.monotonic() > deadline - GRACE_SECONDS + PUBLISH_GRACE_SECONDS:
                    return
            time.sleep(0.05)

    def _reported(self, process: int) -> bool:
        names = (f"error-{process}.json", f"result-{process}.pickle")
        return any((self.folder / name).exists() for name in names)

    def stop(self) -> None:
        """Stop the children still running (SIGINT, then SIGKILL after `STOP_SECONDS`),
        and reap every one."""
        for process, child in enumerate(self.children):
            if child.poll() is None:
                with contextlib.suppress(OSError):
                    child.send_signal(signal.SIGINT)  # (it removes what it had written)
                self.stopped.append(process)
        deadline = time.monotonic() + STOP_SECONDS
        with contextlib.suppress(KeyboardInterrupt):  # (a second Ctrl-C: kill at once)
            for child in self.children:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    child.wait(max(0.0, deadline - time.monotonic()))
        for child in self.children:
            if child.poll() is None:
                child.kill()
        for child in self.children:
            child.wait()
        for pump in self._pumps:
            pump.join()

    def result(self) -> Any:
        if (self.folder / "result-0.pickle").exists():
            # Process 0 returns only once every process agreed that the job succeeded:
            # a process that died after that (or was stopped) does not undo it.
            with open(self.folder / "result-0.pickle", "rb") as f:
                return pickle.load(f)
        stopped = [i for i in self.stopped if i not in self.failed]
        errors = {i: self._error(i) for i in range(self.count) if i in self.failed}
        errors.update({i: (LazyckptError, self._stopped(i)) for i in stopped})
        if not errors:
            errors[0] = (LazyckptError, "ended without a result")
        failing = [i for i in self.failed if i in errors] or sorted(errors)
        # The processes whose own error it was: not those that only say that another
        # process failed (as each does once the job agreed on a failure).
        named = {int(n) for _, text in errors.values() for n in _NAMED.findall(text)}
        own = (
            [i for i in failing if i in named]
            or [i for i in failing if not _passed_on(errors[i][1])]
            or failing
        )
        # The most telling class: a specific error before lazyckpt's base class (which a
        # process raises when told that another failed), its own error first.
        order = sorted(failing, key=lambda i: (i not in own, errors[i][0] is LazyckptError))
        kind = errors[order[0]][0]
        head = f"convert in {self.count} processes failed: " + _who(own, "failed")
        others = sorted(set(failing) - set(own))
        if others:
            head += "; " + _who(others, "stopped with it")
        if stopped:
            head += "; " + _who(stopped, "stopped by the parent")
        if (
            len(errors) > 1 and len(set(errors.values())) == 1
        ):  # (each said the same: an argument, the source)
            raise kind(f"{head}, each with: {errors[order[0]][1]}")
        lines = [f"process {i}: {errors[i][1]}" for i in order]
        lines += [f"process {i}: {errors[i][1]}" for i in sorted(errors) if i not in order]
        raise kind(f"{head}; nothing was published:\n" + "\n".join(lines))

    def _error(self, process: int) -> tuple[type[LazyckptError], str]:
        try:
            told = json.loads((self.folder / f"error-{process}.json").read_text())
        except (OSError, ValueError):
            code = self.children[process].returncode
            how = f"signal {-code}" if code < 0 else f"status {code}"
            tail = "\n  ".join(self.tails[process][-5:])
            return LazyckptError, f"died ({how}) without an error" + (
                f"; its last output:\n  {tail}" if tail else ""
            )
        found = error_class(told["class"])
        if found.__name__ == told["class"]:
            return found, str(told["message"])
        return LazyckptError, f"{told['class']}: {told['message']}"

    def _stopped(self, process: int) -> str:
        if not self.failed:
            return "stopped by the parent (interrupted)"
        return f"stopped by the parent after process(es) {self.failed} failed"


_NAMED = re.compile(r"process (\d+) failed: ")
"""How `multihost.agree_on_failure` names a process whose own error it was."""


def _passed_on(message: str) -> bool:
    """Whether an error only passes on another process's failure (see
    `multihost.agree_on_failure`, whose errors say so)."""
    return "every process of the" in message and "stopped there" in message


def _who(processes: list[int], what: str) -> str:
    if len(processes) == 1:
        return f"process {processes[0]} {what}"
    return f"processes {', '.join(map(str, processes))} {what}"


def _stderr() -> int | None:
    """The parent's stderr, where process 0's stdout goes too: convert prints nothing,
    and what gloo logs there must not mix with the caller's output."""
    try:
        return sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # (a notebook's stream has no file)
        return None


def _die_with_parent(parent: int) -> None:
    """Ask Linux to kill this child when its parent dies, so that none is left behind."""
    with contextlib.suppress(Exception):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # (it died before the request)
        os._exit(1)


def _interrupted(signum: int, frame: object) -> None:
    """KeyboardInterrupt once: a Ctrl-C reaches the child from the terminal and again
    from the parent, and the second must not cut the clean-up the first started."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise KeyboardInterrupt


def main(job_file: str) -> None:
    """One child: join the job, call, write the result (process 0) or the error."""
    folder = Path(job_file).parent
    # Read, then deleted at once: the call (storage_options too) stays in no file.
    with open(job_file, "rb") as f:
        data = f.read()
    os.unlink(job_file)
    # Asked to stop (the parent's SIGINT, a Ctrl-C, SIGTERM): unwind as on Ctrl-C, so
    # that convert removes what it had written (even where SIGINT came in ignored).
    signal.signal(signal.SIGINT, _interrupted)
    signal.signal(signal.SIGTERM, _interrupted)
    with io.BytesIO(data) as f:
        header = pickle.load(f)
        process = header["process"]
        _die_with_parent(header["parent"])
        sys.path[:] = header["path"]  # (where the parent found the call's modules)
        try:
            import jax

            jax.config.update("jax_cpu_collectives_implementation", "gloo")
            address = f"127.0.0.1:{header['port']}"
            jax.distributed.initialize(
                coordinator_address=address,
                num_processes=header["processes"],
                process_id=process,
                coordinator_bind_address=address,
            )
            call, kwargs = pickle.load(f)
            result = call(**kwargs)
        except BaseException as error:  # noqa: BLE001 - reported to the parent
            told = {"class": type(error).__name__, "message": str(error)}
            (folder / f"error-{process}.json").write_text(json.dumps(told))
            # Not jax.distributed.shutdown: its barrier would wait for the others.
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)
    if process == 0:  # (renamed into place: the parent never reads half of it)
        with open(folder / "result-0.pickle.part", "wb") as out:
            pickle.dump(result, out)
        os.replace(folder / "result-0.pickle.part", folder / "result-0.pickle")
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
