"""The notebook view of a checkpoint, rendered in a real browser (headless Chromium).

`.ci/run` installs Debian's `chromium`; elsewhere the test is skipped when there is
no browser, but under CI (`CI=true`) a missing browser fails it.
"""

from __future__ import annotations

import os
import shutil
import struct
from pathlib import Path
from typing import Any

import pytest

import lazyckpt
from tests.helpers import orbax_save, refuse_data_reads

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
FLAGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


@pytest.fixture
def browser_page() -> Any:
    if CHROMIUM is None:
        if os.environ.get("CI"):
            pytest.fail("CI must have Chromium: .ci/run installs Debian's chromium package")
        pytest.skip("no chromium on this machine (apt-get install chromium)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        try:
            yield browser.new_page(viewport={"width": 1100, "height": 700})
        finally:
            browser.close()


def _png_size(path: Path) -> tuple[int, int]:
    header = path.read_bytes()[:24]
    assert header[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", header[16:24])
    return width, height


def test_checkpoint_view_in_chromium(
    browser_page: Any, tmp_path: Path, mesh: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests.helpers import reference_tree

    path = orbax_save(tmp_path / "ckpt", reference_tree(mesh), zarr3=True)
    tree = lazyckpt.open(path)
    refuse_data_reads(monkeypatch)  # drawing the view reads no array data
    view = lazyckpt.summary(tree, title="reference")._repr_html_()
    page_file = tmp_path / "view.html"
    page_file.write_text(f"<!doctype html><meta charset='utf-8'><body>{view}</body>")

    page = browser_page
    page.goto(page_file.as_uri())
    shot = tmp_path / "view.png"
    page.screenshot(path=str(shot), full_page=True)
    width, height = _png_size(shot)
    assert width == 1100 and height >= 300

    kernel = page.locator('[data-path="params/dense/kernel"]')
    assert kernel.is_visible()
    assert kernel.inner_text().split("\n")[:4] == [
        "kernel",
        "float32[64,128]",
        "32.0 KiB",
        "P('x', 'y')",
    ]
    body = page.locator("body").inner_text()
    for text in ("opt_state/", "mask", "bool[4,8]", "P(None, ('x', 'y'))", "'run-1'"):
        assert text in body

    params = page.locator('details[data-path="params"]')
    assert params.evaluate("node => node.open")
    params.locator("> summary").click()  # collapse
    assert not params.evaluate("node => node.open")
    assert not kernel.is_visible()
    assert page.locator('[data-path="opt_state/mu"]').is_visible()  # other subtrees stay
    page.screenshot(path=str(tmp_path / "collapsed.png"))
    params.locator("> summary").click()  # and open again
    assert kernel.is_visible()


def test_tutorial_plots_in_chromium(browser_page: Any, tutorial: Any, tmp_path: Path) -> None:
    """The tutorial's figures, as a notebook page shows them: images that load, of the
    size matplotlib drew, with lines and bars on a white ground."""
    from matplotlib.image import imread

    images = [
        output["data"]["image/png"]
        for cell in tutorial.cells
        if cell.cell_type == "code"
        for output in cell.outputs
        if "image/png" in output.get("data", {})
    ]
    assert len(images) == 3
    tags = "".join(
        f'<img id="f{i}" src="data:image/png;base64,{data}">' for i, data in enumerate(images)
    )
    page_file = tmp_path / "plots.html"
    page_file.write_text(f"<!doctype html><meta charset='utf-8'><body>{tags}</body>")
    page = browser_page
    page.goto(page_file.as_uri())
    for i in range(len(images)):
        image = page.locator(f"#f{i}")
        width, height = image.evaluate("img => [img.naturalWidth, img.naturalHeight]")
        assert width >= 300 and height >= 150, (i, width, height)
        shot = tmp_path / f"plot{i}.png"
        image.screenshot(path=str(shot))
        assert _png_size(shot) == (width, height)
        pixels = imread(shot)[..., :3]
        ink = (pixels.mean(axis=2) < 0.5).mean()  # dark pixels: axes, ticks, text, lines
        colour = (pixels.std(axis=2) > 0.1).mean()  # coloured pixels: the data
        assert 0.005 < ink < 0.5 and colour > 0.005, (i, ink, colour)
