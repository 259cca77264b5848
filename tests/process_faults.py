"""Transforms that `convert(..., processes=N)` sends to its processes, to fail one of them.

They run inside each child (after it joined the job, before anything is written), so
they are functions of an importable module: pickled by name, as users' must be.
"""

from __future__ import annotations

import os
import signal
import warnings

import jax

import lazyckpt


def fail_in_process_1(tree: object) -> object:
    """Process 1 fails as a damaged source would; the others go on."""
    if jax.process_index() == 1:
        raise lazyckpt.CorruptCheckpointError("injected failure in process 1")
    return tree


def killed_before_publishing(tree: object) -> object:
    """Process 0 is killed (SIGKILL) once every array is written, just before the
    checkpoint would be renamed into place: the moment a partial checkpoint would
    appear if publishing were not all or nothing."""
    if jax.process_index() == 0:
        import lazyckpt._storage.publish as publish

        def die(*_: object) -> None:
            os.kill(os.getpid(), signal.SIGKILL)

        publish._publish = die  # type: ignore[assignment]
    return tree


def wait_for_ever(tree: object) -> object:
    """Every process waits, as one stuck in a collective would."""
    import time

    while True:
        time.sleep(1)


def warn_in_every_process(tree: object) -> object:
    """A warning from each process, naming it."""
    warnings.warn(f"a note from process {jax.process_index()}", UserWarning, stacklevel=1)
    return tree


def convert_in_processes_again(tree: object) -> object:
    """`processes=2` from inside a process of a job: refused."""
    lazyckpt.convert("nowhere", "nowhere-out", processes=2)
    return tree


def wait_while_writing(tree: object) -> object:
    """Each process, once it writes its arrays (the temporary folder made), says so by a
    file in the folder `LAZYCKPT_TEST_MARKERS` names and waits there, interruptible."""
    import time
    from pathlib import Path

    import lazyckpt._orbax.write_together as write_together

    def wait(*_: object, **__: object) -> None:
        marker = Path(os.environ["LAZYCKPT_TEST_MARKERS"]) / f"writing-{jax.process_index()}"
        marker.write_text("")
        while True:
            time.sleep(0.1)

    write_together.write_arrays = wait  # type: ignore[attr-defined]
    return tree


def _siblings() -> set[int]:
    """The other live processes of this job (children of the same parent)."""
    from pathlib import Path

    found = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            fields = (entry / "stat").read_text().rpartition(")")[2].split()
        except OSError:  # (it just ended)
            continue
        if int(fields[1]) == os.getppid() and fields[0] != "Z":
            found.add(int(entry.name))
    return found


def process_1_dies_after_the_job_agreed(tree: object) -> object:
    """Process 1 is killed (SIGKILL) once the job agreed that every array is written;
    process 0 publishes only after it is gone, and a while later (longer than a
    grace the test shortened): the parent must not kill process 0 mid-publish."""
    import time

    if jax.process_index() == 1:
        from lazyckpt._storage import multihost

        agree = multihost.agree_on_failure

        def agree_then_die(what: str, failed: object) -> None:
            agree(what, failed)  # type: ignore[arg-type]
            if "writing" in what:
                os.kill(os.getpid(), signal.SIGKILL)

        multihost.agree_on_failure = agree_then_die
    else:
        import lazyckpt._storage.publish as publish

        real = publish._publish

        def publish_later(*args: object, **kwargs: object) -> object:
            while _siblings():
                time.sleep(0.1)
            time.sleep(5)  # (the grace the test set is shorter)
            return real(*args, **kwargs)  # type: ignore[arg-type]

        publish._publish = publish_later  # type: ignore[assignment]
    return tree


def report_environment(tree: object) -> object:
    """Each process writes its JAX_PLATFORMS, PYTHONPATH and jax backend to a file in
    the folder `LAZYCKPT_TEST_MARKERS` names."""
    import json
    from pathlib import Path

    told = {
        "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS"),
        "PYTHONPATH": os.environ.get("PYTHONPATH"),
        "backend": jax.default_backend(),
    }
    folder = Path(os.environ["LAZYCKPT_TEST_MARKERS"])
    (folder / f"environment-{jax.process_index()}.json").write_text(json.dumps(told))
    return tree
