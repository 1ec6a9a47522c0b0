"""Hostile inputs against real server processes (marker ``hostile``: run by .ci/run).

Each attack of :mod:`kvfs.bench.hostile` runs against freshly started meta and
chunkserver processes with short timeouts, while a good client keeps reading;
the server's RSS is sampled from /proc.  Bounds stated here: every attack costs
the attacked server less than +64 MiB of RSS, and every unauthenticated
connection is closed by the server.
"""

from __future__ import annotations

import pytest

from kvfs.bench.hostile import Outcome, format_table, run_attacks

pytestmark = [pytest.mark.hostile, pytest.mark.timeout(600)]

RSS_BOUND_MIB = 64
SERVER_ARGS = ("--handshake-timeout", "1s", "--idle-timeout", "3s", "--max-inflight", "16MiB")


@pytest.fixture(scope="module")
def outcomes() -> dict[str, Outcome]:
    from kvfs._loop import run

    rows = run(run_attacks(wait_s=10.0, idle_n=1000, loris_n=50, meta_args=SERVER_ARGS,
                           cs_args=SERVER_ARGS))
    print("\n" + format_table(rows))
    return {r.attack: r for r in rows}


# A connection still in its TLS handshake holds OpenSSL's per-connection state and the
# asyncio SSL layer's buffers (~70 KiB; measured +73 MiB for 1,000) until
# handshake_timeout_s closes it; max_connections does not count it (asyncio hands the
# connection to kvfs only after the handshake).  SECURITY.md states this bound.
TLS_PENDING_RSS_BOUND_MIB = 128


def _one(outcomes: dict[str, Outcome], part: str, bound_mib: int = RSS_BOUND_MIB) -> Outcome:
    (row,) = [r for name, r in outcomes.items() if part in name]
    assert row.server_alive and row.good_client_ok, row
    assert row.rss_growth_mib < bound_mib, row
    return row


@pytest.mark.parametrize("part", ["512 MiB header", "100 GiB header", "idle connections",
                                  "slow-loris"])
def test_unauthenticated_attacks_are_closed_cheaply(outcomes: dict[str, Outcome], part: str) -> None:
    row = _one(outcomes, part)
    assert row.closed == row.connections, row


def test_a_never_reading_client_costs_a_bounded_amount(outcomes: dict[str, Outcome]) -> None:
    _one(outcomes, "never-reading")


def test_a_readv_repeating_one_range_is_refused(outcomes: dict[str, Outcome]) -> None:
    row = _one(outcomes, "1,000 times")
    assert row.note.startswith("refused"), row  # past max_read_rpc_bytes (and overlapping)


@pytest.fixture(scope="module")
def tls_outcomes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Outcome]:
    """The unauthenticated attacks against mutual-TLS servers: they hit the TLS handshake."""
    from test_tls import make_certs

    from kvfs._loop import run

    certs = make_certs(tmp_path_factory.mktemp("certs"))
    rows = run(run_attacks(wait_s=10.0, idle_n=1000, loris_n=50, meta_args=SERVER_ARGS,
                           cs_args=SERVER_ARGS, tls=certs.services()))
    print("\n" + format_table(rows))
    return {r.attack: r for r in rows}


@pytest.mark.parametrize("part", ["512 MiB header", "100 GiB header", "idle connections",
                                  "slow-loris"])
def test_unauthenticated_attacks_on_tls_servers_are_closed_cheaply(
        tls_outcomes: dict[str, Outcome], part: str) -> None:
    row = _one(tls_outcomes, part,
               TLS_PENDING_RSS_BOUND_MIB if part == "idle connections" else RSS_BOUND_MIB)
    assert row.closed == row.connections, row
