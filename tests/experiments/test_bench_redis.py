"""``experiments.bench_redis``'s TTFT section on the byte model and a real redis-server: every
contender runs, the Redis contender restores every full block (not a silent recompute)."""

from __future__ import annotations

import pytest

from tests.redis_server import running_redis


@pytest.fixture
def redis_server(tmp_path):
    yield from running_redis(tmp_path)


def test_the_ttft_section_restores_every_block_from_redis(redis_server):
    from experiments.bench_redis import _model, _prompt, ttft_section
    model = _model("byte")
    out = ttft_section(model, _prompt(model, 97, 0), 2, redis_server.url)
    assert out["blocks"] == 6 and out["redis_hits"] == [6, 6]
    assert set(out["median"]) == {"recompute", "cold", "redis"}
    assert out["restore_MBps_ttft"] > 0
