"""``python -m kvfs.bench.percall``: each path runs and prints a CPU figure per key."""

from __future__ import annotations

import re

import pytest

from kvfs.bench import percall


@pytest.mark.parametrize("path", percall.PATHS)
def test_each_path_prints_its_cpu_per_key(path: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert percall.main([path, "--calls", "1", "--fsync", "never"]) == 0
    lines = capsys.readouterr().out.splitlines()
    names = ["exists", "match_prefix", "lookup"] if path == "lookups" else [path]
    assert [line.split(":")[0] for line in lines] == names
    for line in lines:
        m = re.fullmatch(r"\w+: (\d+\.\d\d) us/key", line)
        assert m is not None and float(m.group(1)) > 0, line
