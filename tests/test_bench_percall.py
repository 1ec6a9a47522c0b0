"""``python -m kvfs.bench.percall``: each path runs and prints a CPU figure per key (get_into: and its ratio to get)."""

from __future__ import annotations

import re

import pytest

from kvfs.bench import percall


@pytest.mark.parametrize("path", percall.PATHS)
def test_each_path_prints_its_cpu_per_key(path: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert percall.main([path, "--calls", "1", "--fsync", "never"]) == 0
    lines = capsys.readouterr().out.splitlines()
    names = {"lookups": ["exists", "match_prefix", "lookup"],
             "get_into": ["get", "get_into", "get_into/get"]}.get(path, [path])
    assert [line.split(":")[0] for line in lines] == names
    for line in lines:  # a ratio (get_into/get) has no unit
        m = re.fullmatch(r"\w+: (\d+\.\d\d) us/key|\w+/\w+: (\d+\.\d\d)", line)
        assert m is not None and float(m.group(1) or m.group(2)) > 0, line


def test_gc_option_prints_the_cyclic_gc_s_cpu_per_key(capsys: pytest.CaptureFixture[str]) -> None:
    assert percall.main(["put", "--calls", "2", "--gc"]) == 0
    put, gc_line = capsys.readouterr().out.splitlines()
    assert put.startswith("put: ")
    assert re.fullmatch(r"gc: \d+\.\d\d us/key \(collections by generation \d+/\d+/\d+\)", gc_line), gc_line
    assert percall.main(["put", "--calls", "1"]) == 0  # without --gc: no gc line
    assert [line.split(":")[0] for line in capsys.readouterr().out.splitlines()] == ["put"]
