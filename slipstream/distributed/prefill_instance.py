"""The prefill instance of a prefill/decode pair: its process's whole life.

It holds an ordinary `Engine` (tensor-parallel when the pair's instances are:
this process is then the prefill instance's rank 0, and its executor starts the
other ranks). A receiving thread takes the decode side's
messages (("prefill", request id, prompt ids), or None to stop) into a queue;
the main loop adds each prompt as a 1-token greedy request, steps the engine,
and as each finishes sends its full blocks' K/V (`kv_transfer.gather_blocks`)
to the decode side: a header message, then the tensor (each other rank sends
its shard to its decode peer when told to, `SendBlocks`). Its sampled token is
not used: the decode side computes the prompt's last token and samples itself.

The prompt's blocks are cached (prefix caching is on) and free once the
request finishes; they are exported right after the step that finished it,
before any later step can reuse them. With async scheduling the step after
that one was scheduled while the request still held them, so it cannot have
been given them either.
"""
from __future__ import annotations

import queue
import sys
import threading
from dataclasses import replace

import torch

from slipstream.distributed.kv_transfer import (SendBlocks, cached_block_ids, close_link,
                                                gather_blocks, kv_layout, link_of, open_link)
from slipstream.distributed.parallel import World, join_store
from slipstream.distributed.worker import cpu_threads_per_rank, follow_parent


def start_instance(world: World, args, device: torch.device):
    """(this instance's Engine, its end of the link) in `world`. The link is joined
    before the model loads (a tensor-parallel instance joins in its executor, before
    loading too), so a failure while loading closes this end's sockets and the other
    instance fails at once; on failure the caller closes the link."""
    from slipstream.engine.engine import Engine
    args = replace(args, device=str(device))
    if world.tp == 1:
        link = open_link(world, device)
        return Engine(args), link
    return Engine(args, world), link_of(device)


def prefill_main(world: World, args) -> None:
    """Entry point of the prefill process (torch.multiprocessing spawn): rank 0 of
    the prefill instance of `world`. `args`: EngineArgs."""
    from slipstream.config import resolve_device
    from slipstream.sampling_params import SamplingParams

    follow_parent()
    device = resolve_device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(cpu_threads_per_rank(world.size))
    store = join_store(world.port, world.size)
    store.set("pd/joined", "1")
    inbox: queue.Queue = queue.Queue()
    link = None

    def receive():
        try:
            while True:
                msg = link.recv_message()
                inbox.put(msg)
                if msg is None:
                    return
        except RuntimeError as e:   # the decode side went away
            inbox.put(e)

    engine = None
    try:
        engine, link = start_instance(world, args, device)
        shape, dtype = kv_layout(engine.runner)
        link.send_message(("ready", shape, str(dtype)))
        threading.Thread(target=receive, name="slipstream-prefill-recv", daemon=True).start()
        params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
        prompts: dict[str, list[int]] = {}
        while True:
            idle = not engine.has_unfinished_requests()
            try:
                while True:
                    msg = inbox.get(timeout=0.5) if idle else inbox.get_nowait()
                    idle = False
                    if msg is None:
                        return
                    if isinstance(msg, BaseException):
                        raise msg
                    _, rid, ids = msg
                    prompts[rid] = ids
                    engine.add_request({"prompt_token_ids": ids}, params, rid)
            except queue.Empty:
                pass
            if not engine.has_unfinished_requests():
                continue
            for out in engine.step():
                if out.finished:
                    block_ids = cached_block_ids(engine, prompts.pop(out.request_id))
                    kv = gather_blocks(engine.runner, block_ids)   # [layers, 2, n, block_size, kv_heads, head_dim]
                    if kv.is_cuda:   # gathered before the header goes: the decode side's
                        torch.cuda.current_stream(kv.device).synchronize()   # timing is the wire's
                    link.send_message(("kv", out.request_id, tuple(kv.shape), str(kv.dtype)))
                    if kv.shape[2]:   # a prompt shorter than a block and a token moves nothing
                        link.send_tensor(kv)
                        if world.tp > 1:   # the other ranks send their shards to their peers
                            engine.runner.command(SendBlocks(block_ids))
    except RuntimeError as e:
        print(f"slipstream prefill instance: stopping: {e}", file=sys.stderr)
        sys.exit(1)
    finally:
        if engine is not None and world.tp > 1:
            engine.shutdown()
        close_link()
