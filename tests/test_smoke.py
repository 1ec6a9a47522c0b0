from kvfs.client import AsyncClient


async def test_put_get_roundtrip(kv: AsyncClient) -> None:
    await kv.put(b"k", b"v")
    assert await kv.get(b"k") == b"v"
    assert await kv.get(b"missing") is None
