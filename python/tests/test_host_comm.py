"""The host backend's communicators of N ranks from Python: N threads, each
with its own host engine (host_lwo.host_engine()), make one world with
Engine.nccl_comm_create(id, n, rank), where the id is any 128 bytes the ranks
share; Engine.nccl_comm_split splits it; a sharded pool over either stages
the whole record, gathered from every rank's shard. (ctypes releases the GIL
around each call, so the ranks' blocking calls meet.)"""

import ctypes
import os
import threading

import pytest

import lwo

import host_lwo


def run_ranks(n, fn):
    """fn(rank, engine) on n threads, each with a host engine; the errors
    raised, by rank."""
    errors = {}

    def body(r):
        try:
            fn(r, host_lwo.host_engine())
        except BaseException as e:  # noqa: BLE001 - handed to the main thread
            errors[r] = e

    threads = [threading.Thread(target=body, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads)
    return errors


LAYERS = [[("w", "f32", [37, 19]), ("b", "f32", [19])], [("w", "f32", [300])]]


def test_ranks_meet_split_and_gather():
    n = 3
    uid = os.urandom(128)
    got = {}

    def rank(r, engine):
        world = engine.nccl_comm_create(uid, n, r)
        half = engine.nccl_comm_split(world, color=r % 2, key=-r)
        pool = lwo.Pool.create_sharded(engine, LAYERS, world)
        info = pool.info()
        halves = lwo.Pool.create_sharded(engine, LAYERS, half).info()
        shards = []
        for layer in range(len(LAYERS)):
            s = pool.shard_host(layer)
            ctypes.memset(s.address, 0x10 * (r + 1) + layer, s.bytes)
            shards.append((s.record_offset, s.bytes))
        ring = pool.ring(depth=2)
        staged = []
        for layer in range(len(LAYERS)):
            t = ring.stage(layer)
            v = ring.acquire(t)
            staged.append(ctypes.string_at(v.base, v.record_bytes))
            ring.release(t)
        got[r] = (info.rank, info.n_ranks, halves.rank, halves.n_ranks, shards, staged)
        ring.close()
        pool.close()
        half.close()
        world.close()

    errors = run_ranks(n, rank)
    assert not errors, errors
    for r in range(n):
        rank_, n_ranks, half_rank, half_n, _, staged = got[r]
        assert (rank_, n_ranks) == (r, n)
        same = [k for k in range(n) if k % 2 == r % 2]
        assert half_n == len(same)
        assert half_rank == sum(1 for k in same if k > r)  # key -r: reversed
        for layer, record in enumerate(staged):
            want = b"".join(bytes([0x10 * (q + 1) + layer]) * got[q][4][layer][1]
                            for q in range(n))
            assert record == want[:len(record)]


def test_a_rank_that_disagrees_fails_every_rank():
    uid = os.urandom(128)
    errors = run_ranks(2, lambda r, e: e.nccl_comm_create(uid, 2 + r, r))
    assert set(errors) == {0, 1}
    for e in errors.values():
        assert isinstance(e, lwo.Error)
        assert "same n_ranks" in str(e)


def test_grads_replica_comm_sums_the_shards_over_the_nodes():
    # 2 nodes of 2 ranks: shards within a node (color rank // 2), the ranks
    # holding the same shard across the nodes (color rank % 2) as the
    # replica communicator. Rank r's gradient is (r + 1) * (i % 7), so every
    # rank's shard must be 10 * (i % 7).
    n = 4
    uid = os.urandom(128)
    got = {}

    def rank(r, engine):
        world = engine.nccl_comm_create(uid, n, r)
        node = engine.nccl_comm_split(world, color=r // 2, key=r)
        replicas = engine.nccl_comm_split(world, color=r % 2, key=r)
        pool = lwo.Pool.create_sharded(engine, LAYERS, node)
        grads = pool.grads(replica_comm=replicas)
        for layer in reversed(range(len(LAYERS))):
            view = grads.begin(layer)
            for t in view:
                count = t.bytes // 4
                vals = (ctypes.c_float * count)(*[(r + 1) * (i % 7) for i in range(count)])
                ctypes.memmove(t.data, vals, t.bytes)
            grads.end(layer)
        grads.wait()
        got[r] = {(layer, name): (s.first_element, list(s.memoryview()))
                  for layer, tensors in enumerate(LAYERS) for name, _, _ in tensors
                  for s in [grads.shard(layer, name)]}
        grads.close()
        pinned = lwo.Pool.create_pinned(engine, LAYERS)
        with pytest.raises(lwo.Error, match="not sharded"):
            pinned.grads(replica_comm=replicas)
        pinned.close()
        pool.close()
        for c in (replicas, node, world):
            c.close()

    errors = run_ranks(n, rank)
    assert not errors, errors
    for r in range(n):
        for (layer, name), (first, vals) in got[r].items():
            assert vals == [10.0 * ((first + i) % 7) for i in range(len(vals))], (r, layer, name)
        assert got[r] == got[r % 2]  # replicas hold the same shard


def test_a_missing_rank_fails_at_the_deadline():
    prev = host_lwo.set_comm_deadline(200)
    try:
        engine = host_lwo.host_engine()
        with pytest.raises(lwo.Error, match=r"rank\(s\) 0 did not join within 0.2 s"):
            engine.nccl_comm_create(os.urandom(128), 2, 1)
    finally:
        assert host_lwo.set_comm_deadline(prev) == 200
