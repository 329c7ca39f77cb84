"""The page at / in a real headless Chromium (Debian's, driven by Playwright): fill the form, wait
for the streamed answer, check the kept spans are highlighted; takes the screenshot for docs/service_page.png."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from app.documents import DEFAULT_KEEP_RATIO

pytestmark = pytest.mark.slow
sync_api = pytest.importorskip("playwright.sync_api")

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
SHOT = Path(__file__).resolve().parents[2] / "docs" / "service_page.png"
DOC = (
    "The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris. "
    "It was completed in 1889 as the entrance to the World's Fair. Bananas are rich in potassium. "
    "The tower is 330 metres tall. Honey never spoils. Octopuses have three hearts. "
    "Gustave Eiffel's company designed and built the tower. The Moon orbits the Earth."
)


@pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="chromium is not installed")
def test_page_streams_an_answer_and_highlights_kept_spans(live, tmp_path):
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        try:
            page = browser.new_page(viewport={"width": 1200, "height": 900})
            page.goto(live.url + "/")
            # the slider starts at the service's default keep ratio, its label in percent
            assert page.locator("#keep").input_value() == f"{DEFAULT_KEEP_RATIO:g}"
            assert page.locator("#keep-out").inner_text() == f"{DEFAULT_KEEP_RATIO:.0%}"
            page.fill("#document", DOC)
            page.fill("#question", "When was the Eiffel Tower completed?")
            page.fill("#max-tokens", "16")
            page.locator("#keep").fill("0.4")
            page.click("#submit")
            page.wait_for_function("document.body.dataset.state === 'done'", timeout=300_000)
            assert page.inner_text("#error") == ""
            assert page.inner_text("#answer").strip()
            marks = page.locator("#doc-view mark.kept")
            assert marks.count() >= 1
            kept = "".join(marks.all_inner_texts())
            assert 0 < len(kept) < len(DOC)
            assert page.inner_text("#doc-view") == DOC  # highlighting never alters the text
            figures = page.inner_text("#figures")
            assert "acceptance length" in figures and "total s" in figures
            # D3D_UPDATE_SCREENSHOT=1 refreshes the committed one in docs/
            shot = SHOT if os.environ.get("D3D_UPDATE_SCREENSHOT") else tmp_path / SHOT.name
            page.screenshot(path=str(shot), full_page=True)
            assert shot.stat().st_size > 10_000
        finally:
            browser.close()
