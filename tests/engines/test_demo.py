"""examples/prefix_cache_demo.py runs (needs torch and transformers: the SGLang venv has both)."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.engines
DEMO = Path(__file__).resolve().parents[2] / "examples" / "prefix_cache_demo.py"


def test_prefix_cache_demo(capsys: pytest.CaptureFixture[str]) -> None:
    sys.argv = [str(DEMO)]
    runpy.run_path(str(DEMO), run_name="__main__")  # raises SystemExit if the logits differ
    out = capsys.readouterr().out
    print(out)
    assert "blocks hit: 5 of 6" in out
    assert "equal a full recompute: True" in out
