"""README.md and ARCHITECTURE.md list the RPCs exactly as kvfs/rpc.py declares them."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvfs.rpc import RPCS
from kvfs.rpcdoc import BEGIN, END, markdown_table, with_table

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("doc", ["README.md", "ARCHITECTURE.md"])
def test_docs_list_the_rpcs_of_the_table(doc: str) -> None:
    text = (ROOT / doc).read_text()
    assert with_table(text) == text, f"{doc} is stale: run python -m kvfs.rpcdoc --write {doc}"


def test_table_names_every_rpc_and_field() -> None:
    table = markdown_table()
    for r in RPCS.values():
        roles = ", ".join(role.value for role in r.roles)
        assert f"| {int(r.op)} | {r.op.name} | {r.service.value} | {roles} |" in table
    assert "`Commit` `{items?, packed?, ttl_s?, if_absent?}`" in table
    assert "`Committed` `{created, expires_at, present?}`" in table


def test_stale_docs_are_detected() -> None:
    stale = f"x\n{BEGIN}\n| old |\n{END}\ny"
    assert with_table(stale) != stale
    with pytest.raises(ValueError):
        with_table("no markers")
