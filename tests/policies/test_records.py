"""Documents and marks (batch jobs' metadata) on every store, and marks written with a settle."""

from __future__ import annotations

from policies.stores.base import Mark, UsageDelta


async def test_documents_are_owned_listed_newest_first_and_paged(store) -> None:
    for i in range(5):
        await store.put_record("batch", f"b{i}", "acme", 100.0 + i, f'{{"n":{i}}}')
    await store.put_record("batch", "x0", "other", 200.0, "theirs")
    await store.put_record("file", "f0", "acme", 300.0, "a file")
    assert await store.get_record("batch", "b1") == ("acme", '{"n":1}')
    assert await store.get_record("batch", "nope") is None
    assert await store.get_record("file", "b1") is None  # kinds are separate
    assert await store.list_records("batch", "acme", limit=2) == ['{"n":4}', '{"n":3}']
    assert await store.list_records("batch", "acme", after="b3", limit=10) == [
        '{"n":2}',
        '{"n":1}',
        '{"n":0}',
    ]
    assert await store.list_records("batch", "other") == ["theirs"]
    await store.put_record("batch", "b4", "acme", 104.0, "changed")  # replace keeps its place
    assert (await store.list_records("batch", "acme", limit=1)) == ["changed"]
    assert await store.delete_record("batch", "b4") is True
    assert await store.delete_record("batch", "b4") is False
    assert await store.list_records("batch", "acme", limit=1) == ['{"n":3}']


async def test_marks_are_written_with_their_settle_and_only_once(store) -> None:
    await store.put_marks([Mark("lines:b1", "0", "a"), Mark("lines:b1", "1", "b"), Mark("other", "x", "y")])
    assert await store.get_marks("lines:b1") == {"0": "a", "1": "b"}
    usage = [UsageDelta("acme", "m", "2026-11-21", 1, 7)]
    common = dict(lease_id="r1", buckets=[], release=[], counters=[], usage=usage, now=1000.0)
    assert await store.settle(settle_id="r1", marks=[Mark("lines:b1", "2", "c")], **common) is True
    # a repeated settle writes neither its usage nor its marks again
    assert await store.settle(settle_id="r1", marks=[Mark("lines:b1", "2", "z")], **common) is False
    assert await store.get_marks("lines:b1") == {"0": "a", "1": "b", "2": "c"}
    assert [(u.requests, u.tokens) for u in await store.usage("acme")] == [(1, 7)]
    await store.drop_marks("lines:b1", ["0"])
    assert await store.get_marks("lines:b1") == {"1": "b", "2": "c"}
    await store.drop_marks("lines:b1")
    assert await store.get_marks("lines:b1") == {}
    assert await store.get_marks("other") == {"x": "y"}
