"""`convert(..., processes=N)` and `lazyckpt convert --processes N`: N local processes
(a jax.distributed job on 127.0.0.1) give what one process gives; a failure or a death
in one fails the call in the parent, naming it, with nothing published and no process
left behind; bad arguments are refused before any process starts."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

import lazyckpt
from lazyckpt._convert.plan import Converted
from tests import process_faults

ROOT = Path(__file__).resolve().parent.parent
# OPTIONS rename the tensors, so the carried config.json may not describe them: said
# by a warning, in the parent as in each process.
pytestmark = pytest.mark.filterwarnings("ignore::lazyckpt.CarriedFilesWarning")
TIMEOUT = 600  # (each process imports jax and joins the job: slow on a busy machine)


@pytest.fixture(scope="module")
def fp8_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A DeepSeek-style model folder: FP8 weights with 128x128 float32 block scales
    (edges cut short), a bf16 norm, two shards, an index and `config.json`."""
    folder = tmp_path_factory.mktemp("fp8") / "model"
    folder.mkdir()
    rng = np.random.default_rng(0)
    tensors: dict[str, np.ndarray] = {}
    for layer in range(2):
        for name, shape in (("gate_proj", (300, 200)), ("down_proj", (200, 300))):
            prefix = f"model.layers.{layer}.mlp.{name}"
            codes = rng.normal(0, 2, size=shape).astype(np.float32)
            tensors[f"{prefix}.weight"] = codes.astype(ml_dtypes.float8_e4m3fn)
            scales = tuple(math.ceil(n / 128) for n in shape)
            tensors[f"{prefix}.weight_scale_inv"] = rng.uniform(0.01, 2, scales).astype(np.float32)
        tensors[f"model.layers.{layer}.norm.weight"] = rng.normal(size=300).astype(
            ml_dtypes.bfloat16
        )
    names = sorted(tensors)
    weight_map = {}
    for number, members in enumerate((names[::2], names[1::2]), 1):
        shard = f"model-0000{number}-of-00002.safetensors"
        save_file({n: tensors[n] for n in members}, str(folder / shard), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(members, shard))
    index = {"metadata": {}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    config = {"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def _children(root: int | None = None) -> set[int]:
    """The processes descended from `root` (this one by default), from /proc."""
    parents = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except (OSError, ValueError):  # (not a process, or one that just ended)
            continue
        parents[int(entry.name)] = int(stat.rpartition(")")[2].split()[1])
    found: set[int] = set()
    mine = {os.getpid() if root is None else root}
    while mine:
        mine = {pid for pid, parent in parents.items() if parent in mine} - found
        found |= mine
    return found


def _same_trees(a: str, b: str) -> None:
    """The same key paths, shapes and dtypes, and the same bits in every array."""
    first, second = dict(lazyckpt.leaves(lazyckpt.open(a))), dict(lazyckpt.leaves(lazyckpt.open(b)))
    assert sorted(first) == sorted(second)
    for path, leaf in first.items():
        other = second[path]
        assert (leaf.shape, leaf.dtype) == (other.shape, other.dtype), path
        assert leaf.get().tobytes() == other.get().tobytes(), path


OPTIONS: dict[str, Any] = {
    "dequantize": True,
    "select": "model/layers/**",
    "rename": [(r"^model/layers/", "blocks/")],
    "chunk_bytes": 16 << 10,  # (several chunks per array)
    "progress": False,
}


def test_two_processes_write_the_orbax_checkpoint_one_process_writes(
    fp8_model: Path, tmp_path: Path
) -> None:
    before = _children()
    one = lazyckpt.convert(fp8_model, tmp_path / "one", **OPTIONS)
    two = lazyckpt.convert(fp8_model, tmp_path / "two", processes=2, **OPTIONS)
    assert isinstance(two, Converted)
    assert str(two) == str(tmp_path / "two") and two.carried == one.carried == ("config.json",)
    _same_trees(one, two)
    assert (tmp_path / "two" / "huggingface" / "config.json").read_bytes() == (
        tmp_path / "one" / "huggingface" / "config.json"
    ).read_bytes()
    assert _children() == before


def test_two_processes_write_the_safetensors_files_one_process_writes(
    fp8_model: Path, tmp_path: Path
) -> None:
    options = {**OPTIONS, "to": "safetensors", "max_shard_size": 200_000}
    one = lazyckpt.convert(fp8_model, tmp_path / "one", **options)
    two = lazyckpt.convert(fp8_model, tmp_path / "two", processes=2, **options)
    files = sorted(p.name for p in Path(one).iterdir())
    assert len([f for f in files if f.endswith(".safetensors")]) > 1, files
    assert sorted(p.name for p in Path(two).iterdir()) == files
    for name in files:
        assert (Path(two) / name).read_bytes() == (Path(one) / name).read_bytes(), name


def test_the_command_line_with_processes_writes_what_one_process_writes(
    fp8_model: Path, tmp_path: Path
) -> None:
    outputs = []
    for processes in ("1", "2"):
        out = tmp_path / f"cli{processes}"
        command = [*("convert", str(fp8_model), str(out), "--dequantize", "--quiet"),
                   *("--select", "model/layers/0/**", "--processes", processes)]  # fmt: skip
        result = subprocess.run(
            [sys.executable, "-m", "lazyckpt._cli.main", *command],
            capture_output=True,
            text=True,
            cwd=ROOT,
            timeout=TIMEOUT,
        )
        assert result.returncode == 0, result.stderr
        assert f"wrote {out}" in result.stdout
        outputs.append(str(out))
    _same_trees(*outputs)


def test_a_failure_in_one_process_fails_the_call_naming_it_and_publishes_nothing(
    fp8_model: Path, tmp_path: Path
) -> None:
    before = _children()
    destination = tmp_path / "out"
    with pytest.raises(lazyckpt.CorruptCheckpointError, match=r"(?s)failed: process 1 failed; process 0 "
                       r"stopped with it.*process 1.*injected failure in process 1"):  # fmt: skip
        lazyckpt.convert(
            fp8_model, destination, processes=2, transform=process_faults.fail_in_process_1
        )
    assert not destination.exists()
    assert _children() == before


def test_a_process_killed_before_publishing_leaves_no_checkpoint_that_opens(
    fp8_model: Path, tmp_path: Path
) -> None:
    before = _children()
    destination = tmp_path / "out"
    with pytest.raises(lazyckpt.LazyckptError, match=r"process 0: died \(signal 9\)"):
        lazyckpt.convert(
            fp8_model,
            destination,
            processes=2,
            transform=process_faults.killed_before_publishing,
            **OPTIONS,
        )
    assert not destination.exists()
    with pytest.raises(lazyckpt.UnfinishedCheckpointError, match="has not committed"):
        lazyckpt.open(destination)
    for leftover in tmp_path.iterdir():  # what the dead process had written, unpublished
        with pytest.raises(lazyckpt.LazyckptError):
            lazyckpt.open(leftover)
    assert _children() == before


def test_only_process_0_prints_unprefixed_the_others_say_which_they_are(
    fp8_model: Path, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    lazyckpt.convert(
        fp8_model,
        tmp_path / "out",
        processes=2,
        transform=process_faults.warn_in_every_process,
        progress=False,
    )
    err = capfd.readouterr().err
    assert any(
        line.startswith("[process 1] ") and "a note from process 1" in line
        for line in err.splitlines()
    ), err
    assert not any(
        "a note from process 0" in line and line.startswith("[process") for line in err.splitlines()
    )


def test_the_processes_die_with_a_parent_that_was_killed(fp8_model: Path, tmp_path: Path) -> None:
    script = (
        "import sys\nimport lazyckpt\nfrom tests import process_faults\n"
        "lazyckpt.convert(sys.argv[1], sys.argv[2], processes=2, "
        "transform=process_faults.wait_for_ever)\n"
    )
    command = [sys.executable, "-c", script, str(fp8_model), str(tmp_path / "out")]
    parent = subprocess.Popen(command, cwd=ROOT, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + TIMEOUT
        while len(_children(parent.pid)) < 2 and parent.poll() is None:
            assert time.monotonic() < deadline, "the processes did not start"
            time.sleep(0.1)
        started = _children(parent.pid)
        assert len(started) == 2, started
    finally:
        parent.kill()
        parent.wait()
    deadline = time.monotonic() + 60
    while started & {int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()}:
        assert time.monotonic() < deadline, f"left behind: {started}"
        time.sleep(0.1)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("processes", [0, -2, True, 2.0, "2"])
def test_processes_must_be_a_whole_number_of_1_or_more(processes: Any, tmp_path: Path) -> None:
    with pytest.raises(lazyckpt.ArgumentError, match=r"processes=.*whole number of 1 or more"):
        lazyckpt.convert(tmp_path / "missing", tmp_path / "out", processes=processes)


def test_a_transform_that_cannot_be_sent_is_refused_by_name(
    fp8_model: Path, tmp_path: Path
) -> None:
    before = _children()
    with pytest.raises(lazyckpt.ArgumentError, match=r"transform=.*cannot be sent.*top level"):
        lazyckpt.convert(fp8_model, tmp_path / "out", processes=2, transform=lambda tree: tree)

    def nested(tree: object) -> object:
        return tree

    with pytest.raises(lazyckpt.ArgumentError, match=r"select=.*cannot be sent"):
        lazyckpt.convert(fp8_model, tmp_path / "out", processes=2, select=lambda p, leaf: True)
    with pytest.raises(lazyckpt.ArgumentError, match=r"transform=.*nested.*cannot be sent"):
        lazyckpt.convert(fp8_model, tmp_path / "out", processes=2, transform=nested)
    assert not (tmp_path / "out").exists() and _children() == before


def test_a_transform_defined_in_the_script_run_is_refused(fp8_model: Path, tmp_path: Path) -> None:
    """Pickled by its name in `__main__`, which the processes (`python -m ...launch`)
    do not have."""
    script = (
        "import sys\nimport lazyckpt\n\ndef keep(tree):\n    return tree\n\n"
        "try:\n    lazyckpt.convert(sys.argv[1], sys.argv[2], processes=2, transform=keep)\n"
        "except lazyckpt.ArgumentError as error:\n    print(error)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script, str(fp8_model), str(tmp_path / "out")],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=TIMEOUT,
    )
    assert "transform=<function keep" in result.stdout, result.stdout + result.stderr
    assert "defined in the script being run (__main__)" in result.stdout
    assert not (tmp_path / "out").exists()


def test_a_dry_run_with_processes_plans_in_this_process(fp8_model: Path, tmp_path: Path) -> None:
    before = _children()
    planned = lazyckpt.convert(fp8_model, tmp_path / "out", processes=4, dry_run=True, **OPTIONS)
    assert planned == lazyckpt.convert(fp8_model, tmp_path / "out", dry_run=True, **OPTIONS)
    assert _children() == before and not (tmp_path / "out").exists()


def test_processes_inside_a_job_of_several_processes_is_refused(
    fp8_model: Path, tmp_path: Path
) -> None:
    with pytest.raises(lazyckpt.ArgumentError, match=r"already one of 2 processes"):
        lazyckpt.convert(
            fp8_model,
            tmp_path / "out",
            processes=2,
            transform=process_faults.convert_in_processes_again,
        )


def test_a_child_that_died_is_named_with_its_last_output(tmp_path: Path) -> None:
    """The parent's report of a death without an error file (no children: `_Job`'s
    report alone)."""
    from lazyckpt._convert import launch

    job = launch._Job(tmp_path, 2, print, {})
    job.children = [subprocess.Popen([sys.executable, "-c", "pass"]),
                    subprocess.Popen([sys.executable, "-c", "print('bye'); raise SystemExit(3)"])]  # fmt: skip
    for child in job.children:
        child.wait()
    job.tails[1] = ["bye"]
    job.wait()
    with pytest.raises(lazyckpt.LazyckptError, match=r"(?s)process 1: died \(status 3\).*bye"):
        job.result()


def test_a_value_that_cannot_be_sent_is_named_by_its_type_never_shown(
    fp8_model: Path, tmp_path: Path
) -> None:
    """storage_options hold credentials: the error names the part that does not pickle,
    not the value."""
    import threading

    options = {"secret": "S3CR3T-TOKEN", "session": threading.Lock()}
    with pytest.raises(lazyckpt.ArgumentError) as caught:
        lazyckpt.convert(fp8_model, tmp_path / "out", processes=2, storage_options=options)
    message = str(caught.value)
    assert "storage_options holds a _thread.lock, which cannot be sent" in message, message
    assert "S3CR3T" not in message and "top level of a module (not a lambda" not in message


def _temporary_folders(folder: Path) -> list[Path]:
    return [p for p in folder.rglob("*") if "tmp-lazyckpt" in p.name]


@pytest.mark.parametrize("to", ["the parent", "the process group"])
def test_an_interrupted_call_leaves_no_temporary_folder_no_process_and_no_pickled_call(
    fp8_model: Path, tmp_path: Path, to: str
) -> None:
    """SIGINT to the parent, or to its process group as Ctrl-C sends it, once both
    processes write: each stops and removes what it wrote; the job files (the pickled
    call) were deleted on reading."""
    markers, temp, out = tmp_path / "markers", tmp_path / "tmp", tmp_path / "dest"
    for folder in (markers, temp, out):
        folder.mkdir()
    script = (
        "import sys\nimport lazyckpt\nfrom tests import process_faults\n"
        "lazyckpt.convert(sys.argv[1], sys.argv[2], processes=2, progress=False, "
        "storage_options={'token': 'S3CR3T'}, transform=process_faults.wait_while_writing)\n"
    )
    env = {**os.environ, "LAZYCKPT_TEST_MARKERS": str(markers), "TMPDIR": str(temp)}
    command = [sys.executable, "-c", script, str(fp8_model), str(out / "ckpt")]
    parent = subprocess.Popen(
        command, cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        deadline = time.monotonic() + TIMEOUT
        while len(list(markers.iterdir())) < 2:
            assert parent.poll() is None, parent.communicate()[1]
            assert time.monotonic() < deadline, "the processes did not start writing"
            time.sleep(0.1)
        started = _children(parent.pid)
        assert _temporary_folders(out), list(out.rglob("*"))  # (what there is to clean up)
        assert not list(temp.rglob("job-*")), list(temp.rglob("*"))  # read, then deleted
        if to == "the parent":
            parent.send_signal(signal.SIGINT)
        else:
            os.killpg(parent.pid, signal.SIGINT)
        _, err = parent.communicate(timeout=TIMEOUT)
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
    assert "KeyboardInterrupt" in err, err
    alive = {int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()}
    assert not started & alive, f"left behind: {started & alive}"
    assert not _temporary_folders(out), list(out.rglob("*"))
    assert list(out.iterdir()) == [] and list(temp.iterdir()) == []


def test_the_processes_run_on_the_cpu_with_the_parents_import_path(
    fp8_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from lazyckpt._convert import launch

    monkeypatch.setenv("LAZYCKPT_TEST_MARKERS", str(tmp_path))
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    monkeypatch.syspath_prepend(str(tmp_path / "found-by-sys-path-insert"))
    lazyckpt.convert(
        fp8_model, tmp_path / "out", processes=2, transform=process_faults.report_environment
    )
    for process in range(2):
        told = json.loads((tmp_path / f"environment-{process}.json").read_text())
        assert told["JAX_PLATFORMS"] == "cpu" and told["backend"] == "cpu", told
        assert str(tmp_path / "found-by-sys-path-insert") in told["PYTHONPATH"].split(os.pathsep)
    monkeypatch.setenv("JAX_PLATFORMS", "tpu")  # (the caller's choice is kept)
    assert launch._child_environment()["JAX_PLATFORMS"] == "tpu"


def test_a_process_dying_after_the_job_agreed_does_not_cut_process_0_publishing(
    fp8_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Process 1 dies once every array is written and agreed; process 0 publishes after
    the (shortened) grace has run out: the checkpoint is published whole."""
    from lazyckpt._convert import launch

    monkeypatch.setattr(launch, "GRACE_SECONDS", 1.0)
    before = _children()
    destination = tmp_path / "out"
    # (process 0 published whole, then found process 1 gone: it warns, and succeeds)
    out = lazyckpt.convert(
        fp8_model,
        destination,
        processes=2,
        transform=process_faults.process_1_dies_after_the_job_agreed,
        **OPTIONS,
    )
    assert out == str(destination) and destination.exists()
    _same_trees(str(destination), lazyckpt.convert(fp8_model, tmp_path / "alone", **OPTIONS))
    assert _children() == before
