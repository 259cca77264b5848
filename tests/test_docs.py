"""The docs site builds with warnings as errors (what `nox -s docs` runs), and every
code block of the README and of every page under docs/ runs as written.

Each page runs top to bottom in one fresh process, in an empty folder of its own:
`python` blocks in one namespace, `bash` blocks through `bash -e` in that folder, and
`pycon` blocks as doctests in the same namespace. A `text` block right after a python
block is what that block prints. The process sees 8 CPU devices
(`XLA_FLAGS=--xla_force_host_platform_device_count=8`), the virtualenv's `bin` first on
`PATH` (so `python` and `lazyckpt` resolve), and a loopback Hugging Face Hub
(`tests/hub_server.py`, as `HF_ENDPOINT`) serving the repositories the pages name,
written by the real orbax-checkpoint and transformers.

A block the test must not run says so on the line right above its fence, with the
reason, in an HTML comment (shown in the source, not on the rendered page):

    <!-- docs-test: skip: creates a virtualenv and runs every check (many minutes) -->

Each such block is named and counted in the report; `SKIPPED` below lists them all, so
none is skipped silently. Each page's test prints the blocks it ran and skipped."""

from __future__ import annotations

import itertools
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pytest

ROOT = Path(__file__).parent.parent


def test_docs_site_builds_strict(tmp_path: Path) -> None:
    pytest.importorskip("mkdocs")
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    for page in ("index.html", "getting-started/index.html", "api/index.html",
                 "use-cases/small-hosts/index.html", "tutorial.ipynb"):  # fmt: skip
        assert (tmp_path / page).exists(), page
    reference = (tmp_path / "api" / "index.html").read_text()
    assert "lazyckpt.save" in reference and "chunk_bytes" in reference


def test_getting_started_is_the_first_page_after_home() -> None:
    nav = [
        line.strip() for line in (ROOT / "mkdocs.yml").read_text().split("\nnav:\n")[1].splitlines()
    ]
    assert nav[:2] == ["- Home: index.md", "- Getting started: getting-started.md"]


_FENCE = re.compile(r"^```(\w*)\n(.*?)^```$", re.MULTILINE | re.DOTALL)
_SKIP = re.compile(r"^<!-- docs-test: skip: (.+?) -->\n", re.MULTILINE)
_END = "----- end of block -----"
RUN = ("python", "bash", "pycon")
PAGES = [
    "README.md",
    *sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").rglob("*.md")),
]
# Every block the test leaves out, by page: (its language, its reason).
SKIPPED = {
    "README.md": [
        (
            "bash",
            "creates a virtualenv and installs into it; the second runs every check (minutes)",
        ),
        ("bash", "installs lazyckpt from PyPI into your environment"),
    ],
    "docs/benchmarks.md": [
        ("bash", "installs the benchmark extra, then runs every benchmark (many minutes)"),
    ],
    "docs/getting-started.md": [("bash", "installs lazyckpt into your environment")],
    "docs/index.md": [("bash", "installs lazyckpt into your environment")],
    "docs/use-cases/fleet-convert.md": [("bash", "needs a SLURM cluster")],
}


class Block(NamedTuple):
    lang: str
    body: str
    line: int  # of the block's first line of code, 1-based
    start: int
    end: int
    skip: str | None  # the reason its marker gives, if it has one


def page_blocks(page: str) -> list[Block]:
    text = (ROOT / page).read_text()
    blocks = []
    for match in _FENCE.finditer(text):
        marker = None
        for found in _SKIP.finditer(text, 0, match.start()):
            if found.end() == match.start():
                marker = found[1]
        line = text.count("\n", 0, match.start(2)) + 1
        blocks.append(Block(match[1], match[2], line, match.start(), match.end(), marker))
    return blocks


def test_every_skip_is_a_marked_runnable_block_and_listed() -> None:
    """A marker sits right above a block that would run, every marked block is in
    SKIPPED with its reason (the list of what the docs test leaves out is complete),
    and a block that installs packages is marked."""
    found: dict[str, list[tuple[str, str]]] = {}
    for page in PAGES:
        blocks = page_blocks(page)
        skipped = [(b.lang, b.skip) for b in blocks if b.skip is not None]
        assert all(lang in RUN for lang, _ in skipped), page
        markers = len(_SKIP.findall((ROOT / page).read_text()))
        assert markers == len(skipped), f"{page}: a skip marker not right above a fence"
        for block in blocks:  # the test never installs into the environment it runs in
            installs = block.lang == "bash" and re.search(r"pip install|-m venv", block.body)
            assert block.skip is not None or not installs, f"{page}, line {block.line}"
        if skipped:
            found[page] = skipped
    assert found == SKIPPED


_DRIVER = """
import doctest, json, subprocess, sys
page, blocks = json.load(open(sys.argv[1]))
namespace = {"__name__": "__main__"}
for lang, body, line in blocks:
    sys.stdout.flush()
    if lang == "python":
        exec(compile("\\n" * (line - 1) + body, page, "exec"), namespace)
    elif lang == "bash":
        done = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", body])
        if done.returncode:
            sys.exit(f"{page}, line {line}: the bash block exited with {done.returncode}")
    else:
        name = f"{page}, line {line}"
        test = doctest.DocTestParser().get_doctest(body, namespace, name, page, line - 1)
        runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
        runner.run(test, clear_globs=False)
        if runner.failures:
            sys.exit(f"{name}: the pycon block failed (above)")
    print(sys.argv[2], flush=True)
"""


def _release() -> dict[str, Any]:
    """A small language model's parameters, named as Gemma's Flax releases name them."""
    rng = np.random.default_rng(0)

    def weight(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape, dtype=np.float32) * 0.02

    params: dict[str, Any] = {
        "embedder": {"input_embedding": weight(2048, 64)},
        "final_norm": {"scale": np.ones(64, np.float32)},
    }
    for layer in range(2):
        params[f"layer_{layer}"] = {
            "attn": {
                "q_einsum": {"w": weight(4, 64, 16)},
                "kv_einsum": {"w": weight(2, 1, 64, 16)},
                "attn_vec_einsum": {"w": weight(4, 16, 64)},
            },
            "mlp": {"gating_einsum": weight(2, 64, 256), "linear": weight(256, 64)},
            "pre_attention_norm": {"scale": np.ones(64, np.float32)},
            "pre_ffw_norm": {"scale": np.ones(64, np.float32)},
        }
    return {"params": params}


@pytest.fixture(scope="module")
def docs_hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """The loopback Hub, serving what the pages open: `acme/tiny-lm-jax` (an Orbax
    checkpoint under `checkpoints/base`), `acme/tiny-lm-run` (a CheckpointManager root
    under `train`, steps 1000 and 2000, items `state` and `meta`) and
    `acme/tiny-gpt2-torch` and `acme/tiny-gpt2` (a GPT-2 `save_pretrained` by
    transformers, sharded `pytorch_model.bin` and `model.safetensors`:
    tests/fixtures/torch)."""
    pytest.importorskip("huggingface_hub")
    ocp = pytest.importorskip("orbax.checkpoint")
    from tests.helpers import orbax_save
    from tests.hub_server import HubServer, folder_files

    folder = tmp_path_factory.mktemp("docs-hub")
    release = orbax_save(folder / "release", _release())
    with ocp.CheckpointManager(folder / "run") as manager:
        for step in (1000, 2000):
            state = {"params": {"w": np.full((64, 64), step / 1000, np.float32)}}
            manager.save(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.StandardSave(state),
                    meta=ocp.args.JsonSave({"loss": 3000 / step}),
                ),
            )
    gpt2 = ROOT / "tests" / "fixtures" / "torch"
    with HubServer(folder / "hub") as hub:
        hub.commit("acme/tiny-lm-jax", folder_files(release, "checkpoints/base"))
        hub.commit("acme/tiny-lm-run", folder_files(folder / "run", "train"))
        for repo, saved in (("tiny-gpt2-torch", "gpt2_bin"), ("tiny-gpt2", "gpt2_safetensors")):
            files = {file.name: file.read_bytes() for file in (gpt2 / saved).iterdir()}
            hub.commit(f"acme/{repo}", files)
        yield hub


_REPORT: dict[str, tuple[int, list[str]]] = {}


@pytest.mark.slow
@pytest.mark.parametrize("page", PAGES)
def test_page_runs_as_written(
    page: str, tmp_path: Path, docs_hub: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every block of the page runs, in order, in one fresh process in an empty folder;
    a text block right after a python block is what that block prints."""
    text = (ROOT / page).read_text()
    blocks = page_blocks(page)
    ran = [b for b in blocks if b.lang in RUN and b.skip is None]
    skipped = [f"line {b.line} ({b.lang}): {b.skip}" for b in blocks if b.skip is not None]
    work = tmp_path / "work"
    work.mkdir()
    plan = tmp_path / "blocks.json"
    plan.write_text(json.dumps([str(ROOT / page), [(b.lang, b.body, b.line) for b in ran]]))
    env = {
        **os.environ,
        "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        "HF_ENDPOINT": docs_hub.endpoint,
        "HF_HUB_CACHE": str(tmp_path / "hf-cache"),
        "HF_TOKEN_PATH": str(tmp_path / "no-token"),
        "HF_HUB_DISABLE_TELEMETRY": "1",
    }
    for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_HUB_OFFLINE"):
        env.pop(name, None)
    result = subprocess.run(
        [sys.executable, "-c", _DRIVER, str(plan), _END],
        capture_output=True,
        text=True,
        cwd=work,
        env=env,
        timeout=600,
    )
    assert result.returncode == 0, f"{page}:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    printed = result.stdout.split(_END + "\n")
    assert len(printed) == len(ran) + 1
    for previous, block in itertools.pairwise(blocks):
        if block.lang != "text" or previous.lang != "python" or previous.skip is not None:
            continue
        between = text[previous.end : block.start]
        assert not between.strip(), f"prose between a block and its output in {page}"
        want = [line.rstrip() for line in block.body.rstrip("\n").splitlines()]
        got = [line.rstrip() for line in printed[ran.index(previous)].rstrip("\n").splitlines()]
        assert got == want, f"{page}, line {previous.line}: the block prints\n" + "\n".join(got)
    _REPORT[page] = (len(ran), skipped)
    with capsys.disabled():
        print(f"\n[docs] {page}: {len(ran)} blocks ran, {len(skipped)} skipped")
        for reason in skipped:
            print(f"[docs]   skipped {reason}")


@pytest.mark.slow
def test_report_of_the_blocks_that_ran(capsys: pytest.CaptureFixture[str]) -> None:
    """The totals of the pages that ran in this session (it runs after them)."""
    if not _REPORT:
        pytest.skip("no page ran in this session")
    ran = sum(count for count, _ in _REPORT.values())
    skipped = sum(len(reasons) for _, reasons in _REPORT.values())
    with capsys.disabled():
        print(
            f"\n[docs] {len(_REPORT)} of {len(PAGES)} pages ran as written: "
            f"{ran} blocks ran, {skipped} skipped (named above)"
        )
    assert ran > 0
