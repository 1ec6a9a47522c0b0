"""Every code block in README.md runs as pasted, against a live cluster.

A block runs unless the line above it is ``<!-- readme-test: skip: REASON -->``:
Python blocks with this interpreter, bash blocks with ``bash -euo pipefail``, each in a
fresh directory with ``$KVFS_ADDR``/``$KVFS_TOKEN``/``$KVFS_ADMIN_TOKEN`` naming the test cluster (the README's
commands default to them).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import ThreadCluster

README = Path(__file__).resolve().parent.parent / "README.md"
_FENCE = re.compile(r"^```(\w*)\n(.*?)^```\n", re.S | re.M)
_SKIP = re.compile(r"<!-- readme-test: skip: (.+?) -->\n\Z")


@dataclass(frozen=True)
class Block:
    line: int
    lang: str
    code: str
    skip: str | None  # the reason it is not run


def readme_blocks(text: str) -> list[Block]:
    blocks = []
    for m in _FENCE.finditer(text):
        before = text[max(0, m.start() - 400):m.start()]
        skip = _SKIP.search(before)
        blocks.append(Block(text.count("\n", 0, m.start()) + 1, m[1], m[2],
                            skip[1] if skip else None))
    return blocks


BLOCKS = readme_blocks(README.read_text())
RUN = [b for b in BLOCKS if b.skip is None]


def test_every_block_runs_or_says_why_not() -> None:
    assert len(BLOCKS) >= 10
    for b in BLOCKS:
        assert b.skip is not None or b.lang in ("python", "bash"), \
            f"README line {b.line}: a ```{b.lang} block can't run; mark it skip with the reason"
    assert len(RUN) >= 6, [b.line for b in RUN]


@pytest.mark.parametrize("block", RUN, ids=[f"L{b.line}-{b.lang}" for b in RUN])
def test_readme_block(block: Block, tcluster: ThreadCluster, tmp_path: Path) -> None:
    env = {**os.environ, "KVFS_ADDR": tcluster.addr, "KVFS_TOKEN": tcluster.token,
           "KVFS_ADMIN_TOKEN": tcluster.cluster.admin_token,
           "KVFS_CONFIG_DIR": str(tmp_path / "config"),
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    argv = ([sys.executable, "-c", block.code] if block.lang == "python"
            else ["bash", "-euo", "pipefail", "-c", block.code])
    r = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, timeout=120)
    assert r.returncode == 0, (f"README line {block.line} failed:\n{r.stdout.decode()}\n"
                               f"{r.stderr.decode()}")
