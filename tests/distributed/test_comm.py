"""comm.broadcast_object over gloo, two processes: the object arrives whole, and a
bounded source gives up on a peer that does not take it instead of waiting for good."""
import datetime
import socket
import time

import torch.distributed as dist
import torch.multiprocessing as mp

HANG_LIMIT_S = 60     # tests/conftest.py: a hang ends the run with a traceback


def _free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def _rank(rank: int, port: int, results) -> None:
    from slipstream.distributed import comm
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0,
                          timeout=datetime.timedelta(seconds=30))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2,
                            timeout=datetime.timedelta(days=1))
    step = {"ids": list(range(1000)), "name": "step"}
    got = comm.broadcast_object(step if rank == 0 else None, dist.group.WORLD, bounded=rank == 0)
    results[f"got{rank}"] = got == step
    if rank == 0:   # the peer stops reading: a payload past the sockets' buffers cannot land
        comm.LARGE_SEND_S = 1.0
        t0 = time.monotonic()
        try:
            comm.broadcast_object(b"x" * (64 << 20), dist.group.WORLD, bounded=True)
            results["raised"] = False
        except RuntimeError:
            results["raised"] = True
        results["waited"] = time.monotonic() - t0
        store.set("done", "1")
    else:
        store.wait(["done"], datetime.timedelta(seconds=30))


def test_broadcast_object_arrives_and_a_bounded_source_gives_up():
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_rank, args=(_free_port(), results), nprocs=2, join=True)
        results = dict(results)
    assert results["got0"] and results["got1"]
    assert results["raised"] and results["waited"] < 10, results
