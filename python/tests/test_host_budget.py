"""The engine's host memory limit from Python: OverBudgetError, host_usage."""

import mmap

import pytest

import lwo
from host_lwo import host_engine


def test_over_budget_is_its_own_exception_with_the_bytes():
    engine = host_engine()
    page = mmap.PAGESIZE
    engine.set_host_limit(4 * page)
    with pytest.raises(lwo.OverBudgetError) as info:
        lwo.Pool.create_pinned(engine, [[("w", "u8", [4 * page + 1])]])
    e = info.value
    assert e.status == lwo.LWO_ERR_OVER_BUDGET
    assert isinstance(e, lwo.ResourceError) and isinstance(e, MemoryError)
    assert "lwo_pool_create_pinned" in e.message
    assert "%d bytes of host memory asked" % (5 * page) in e.message
    assert "host limit %d" % (4 * page) in e.message
    assert engine.host_usage() == (4 * page, 0)
    pool = lwo.Pool.create_pinned(engine, [[("w", "u8", [page])]])  # still usable
    assert engine.host_usage() == (4 * page, page)
    pool.close()
    assert engine.host_usage() == (4 * page, 0)
    engine.set_host_limit(lwo.LWO_HOST_LIMIT_NONE)
    assert engine.host_usage() == (0, 0)
    engine.close()
