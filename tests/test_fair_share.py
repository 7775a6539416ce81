"""Admission at the door and fair shares between clients (issue 33's findings 2, 3 and 1): a
request that will be refused is refused before it is tokenized; a client whose streams are never
read cannot keep another client from being served; an oversized Tokenize is refused before work.
In-process engines over real ONNX Runtime sessions; every case waits for states, never durations."""

import asyncio
import threading

import grpc
import pytest
from test_batching import make_engine, prompt, request, run_stream, wait_for

from kvshare.v1 import generator_pb2 as pb
from kvshare.v1 import generator_pb2_grpc as pb_grpc
from services.api.method_handlers import add_generator_to_server
from services.api.servicer import GeneratorServicer
from services.engine.fair_share import client_of
from services.engine.generation import FinishReason, GenerationRequest
from services.engine.output_processor import unread_limit
from services.errors import Overloaded


def for_client(req: GenerationRequest, client: str) -> GenerationRequest:
    req.client = client
    return req


async def unread_streams(engine, client: str, count: int):
    """``count`` long streams of ``client``, each read up to its first chunk and no further."""
    streams = [engine.generate(for_client(request(prompt(12, i), n=400), client)) for i in range(count)]
    for s in streams:
        await s.__anext__()
    return streams


async def two_running_two_queued(engine, last: str):
    """Client a's two unread streams in the two slots, then a's request and ``last``'s queued."""
    streams = await unread_streams(engine, "tenant:a", 2)
    streams += [engine.generate(for_client(request(prompt(12, i), n=400), client))
                for i, client in ((2, "tenant:a"), (3, last))]
    queued = []
    for count, s in enumerate(streams[2:], 1):
        queued.append(asyncio.ensure_future(s.__anext__()))
        await wait_for(lambda: engine.scheduler.queued == count, "a request queued")
    return streams, queued


async def end_all(streams, pending) -> None:
    for f in pending:
        f.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    for s in streams:
        await s.aclose()


def test_a_request_that_will_be_refused_is_refused_before_tokenizing(tiny_model):
    """--max-batch 1 --max-queued 1 and two requests still being tokenized (held at a gate): they
    fill the worker, so a third is refused at once, and is never tokenized. Before, the door
    counted only requests already queued or running, and the third was tokenized first."""
    engine = make_engine(tiny_model, max_batch=1, max_queued=1)
    gate, entered = threading.Event(), []
    tokenized = engine.inputs.tokenized

    def gated(req):
        entered.append(req)
        gate.wait(60)
        return tokenized(req)

    engine.inputs.tokenized = gated

    async def scenario():
        held = [asyncio.ensure_future(run_stream(engine, request(prompt(20, i), n=4))) for i in range(2)]
        await wait_for(lambda: len(entered) == 2, "two requests being tokenized")
        with pytest.raises(Overloaded, match="1 running|being prepared"):
            await run_stream(engine, request(prompt(20, 9), n=4))
        assert len(entered) == 2, "the refused request was tokenized"
        gate.set()
        return await asyncio.gather(*held)

    results = asyncio.run(scenario())
    assert [len(tokens) for tokens, _, _ in results] == [4, 4]
    assert engine.scheduler.stats.rejected == 1
    assert engine.scheduler.life.shares.reserved == 0 and not engine.scheduler.life.shares.held
    engine.close()


def test_a_request_refused_while_being_prepared_gives_its_reservation_back(tiny_model):
    engine = make_engine(tiny_model, max_batch=1, max_queued=0)

    async def scenario():
        bad = request(prompt(20, 1), n=4)
        bad.max_new_tokens = 10**9
        with pytest.raises(Exception, match="max_new_tokens"):
            await run_stream(engine, bad)
        return await run_stream(engine, request(prompt(20, 2), n=3))  # the one slot is free again

    tokens, _, _ = asyncio.run(scenario())
    assert len(tokens) == 3
    assert engine.scheduler.life.shares.reserved == 0 and not engine.scheduler.life.shares.held
    engine.close()


def test_24_unread_streams_of_one_client_do_not_keep_another_from_being_served(tiny_model):
    """The attack's worker (--max-batch 8 --max-queued 16): one client opens 24 streams and never
    reads past their first chunk, filling every slot and the queue. A second client's request
    still runs to the end: it takes the queue place of the first client's newest request (which
    is refused RESOURCE_EXHAUSTED, before any work), and a paused stream of the first client,
    holding more than its fair part of the slots, gives its slot up. Before, the second client was
    refused (the queue was full) for as long as the 24 streams lasted. (The scheduler sleeps on the
    paused streams' --max-paused-s of an hour when the second client comes: its arrival must wake it.)"""
    engine = make_engine(tiny_model, max_batch=8, max_queued=16, max_unread_tokens=2, max_paused_s=3600.0,
                         yield_paused_s=0.2)
    hoarder, victim = "peer:10.0.0.1", "peer:10.0.0.2"

    async def scenario():
        streams = [engine.generate(for_client(request(prompt(12, i), n=400), hoarder)) for i in range(24)]
        firsts = [asyncio.ensure_future(s.__anext__()) for s in streams]
        await wait_for(lambda: engine.scheduler.running == 8 and engine.scheduler.queued == 16, "8 running, 16 queued")
        await wait_for(lambda: all(s.paused for s in engine.scheduler.active), "the hoarder's streams to pause")
        tokens, _, last = await run_stream(engine, for_client(request(prompt(12, 99), n=6), victim))
        refused = [f for f in firsts if f.done() and isinstance(f.exception(), Overloaded)]
        for f in firsts:
            f.cancel()
        await asyncio.gather(*firsts, return_exceptions=True)
        await end_all(streams, [])
        return tokens, last, refused

    tokens, last, refused = asyncio.run(scenario())
    assert len(tokens) == 6 and last.finish_reason is FinishReason.LENGTH
    assert len(refused) == 1 and "holding fewer rows" in str(refused[0].exception())
    stats = engine.scheduler.stats
    assert stats.pushed_out == 1 and stats.yielded == 1
    engine.close()


def test_a_fixed_client_bound_refuses_at_the_door_naming_it(tiny_model):
    engine = make_engine(tiny_model, max_batch=4, max_queued=4, max_client_rows=2, max_unread_tokens=2,
                         max_paused_s=3600.0)

    async def scenario():
        streams = await unread_streams(engine, "tenant:a", 2)
        with pytest.raises(Overloaded, match=r"holds 2 rows .* at most 2 per client \(--max-client-rows\)"):
            await run_stream(engine, for_client(request(prompt(12, 5), n=3), "tenant:a"))
        tokens, _, _ = await run_stream(engine, for_client(request(prompt(12, 6), n=3), "tenant:b"))
        await end_all(streams, [])
        return tokens

    assert len(asyncio.run(scenario())) == 3
    assert engine.scheduler.stats.client_rejected == 1
    engine.close()


def test_the_next_free_slot_goes_to_the_client_holding_fewest(tiny_model):
    """Client a holds both slots and has a request queued; client b queues one after it. When one of
    a's streams ends, b's request starts, not a's earlier one."""
    engine = make_engine(tiny_model, max_batch=2, max_queued=4, max_unread_tokens=2, max_paused_s=3600.0,
                         yield_paused_s=3600.0)

    async def scenario():
        streams, queued = await two_running_two_queued(engine, "tenant:b")
        await streams[0].aclose()
        await wait_for(lambda: engine.scheduler.queued == 1, "a slot given to a queued request")
        started = [seq.client for seq in engine.scheduler.active]
        await end_all(streams, queued)
        return started

    assert sorted(asyncio.run(scenario())) == ["tenant:a", "tenant:b"]
    engine.close()


def test_clients_are_tenants_else_addresses_without_ports():
    assert client_of("acme", "ipv4:10.0.0.5:41234") == "tenant:acme"
    assert client_of("", "ipv4:10.0.0.5:41234") == client_of("", "ipv4:10.0.0.5:5000") == "peer:10.0.0.5"
    assert client_of("", "ipv6:[::1]:5000") == "peer:[::1]"
    # The HTTP face's address is trusted on its private Unix socket only, never over TCP.
    assert client_of("", "unix:/tmp/kvshare-http-x/grpc.sock", "192.0.2.7") == "peer:192.0.2.7"
    assert client_of("", "ipv4:10.0.0.5:41234", "192.0.2.7") == "peer:10.0.0.5"


def test_unread_bytes_pause_log_probability_streams_sooner():
    assert unread_limit(256, 64 * 1024, False, 0) == 256
    with_top_20 = unread_limit(256, 64 * 1024, True, 20)
    assert with_top_20 < 256 and with_top_20 * (8 + 20 * 21) <= 64 * 1024
    assert unread_limit(256, 1, True, 20) == 1


def test_an_oversized_tokenize_is_refused_before_any_work_while_a_stream_runs(tiny_model):
    """Four Tokenize calls of 4.1M ids each (a 4 MB message) beside a running stream: each is
    refused INVALID_ARGUMENT naming token_ids and its limit, before its bytes are even parsed, and
    the stream's answer is the one it gets alone. Before, each was decoded in full (seconds holding
    the GIL) and failed sending an answer over the message limit. (Eight Tokenize places: one client
    holds four, so that all four calls pass the door and meet the size check.)"""
    engine = make_engine(tiny_model, max_unread_tokens=4096, max_tokenize_requests=8)
    decoded = []
    tokenize = engine.inputs._tokenize
    engine.inputs._tokenize = lambda req: decoded.append(req) or tokenize(req)
    ids = prompt(20, 7)
    alone, _, _ = asyncio.run(run_stream(engine, request(ids, n=40)))

    async def scenario():
        server = grpc.aio.server(options=[("grpc.max_receive_message_length", 32 << 20),
                                          ("grpc.max_send_message_length", 32 << 20)])
        add_generator_to_server(GeneratorServicer(engine), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = pb_grpc.GeneratorStub(channel)
                stream = stub.Generate(pb.GenerateRequest(prompt_token_ids=ids, max_new_tokens=40, ignore_eos=True))
                first = await stream.read()
                huge = pb.TokenizeRequest(token_ids=[3] * 4_100_000)
                outcomes = await asyncio.gather(*(stub.Tokenize(huge, timeout=60) for _ in range(4)),
                                                return_exceptions=True)
                tokens = list(first.token_ids)
                while (message := await stream.read()) is not grpc.aio.EOF:
                    tokens += message.token_ids
                small = await stub.Tokenize(pb.TokenizeRequest(token_ids=ids[:5]), timeout=60)
                return outcomes, tokens, small
        finally:
            await server.stop(None)

    outcomes, tokens, small = asyncio.run(scenario())
    limit = engine.limits.token_ids
    for outcome in outcomes:
        assert isinstance(outcome, grpc.aio.AioRpcError) and outcome.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "a TokenizeRequest of 4100005 bytes" in outcome.details() and f"{limit} token_ids" in outcome.details()
    assert len(decoded) == 1 and list(small.token_ids) == ids[:5], "only the small call was decoded"
    assert tokens == alone
    engine.close()


def test_tokenize_answers_over_the_message_limit_are_refused_before_work(tiny_model):
    engine = make_engine(tiny_model)
    limits = engine.limits
    from dataclasses import replace

    from services.engine.generation import TokenizeRequest
    from services.errors import InvalidRequest

    small = replace(limits, answer_bytes=1000)
    with pytest.raises(InvalidRequest, match=r"answer could take \d+ bytes.*--max-message-bytes"):
        small.check_tokenize(TokenizeRequest(text="a" * 500))
    with pytest.raises(InvalidRequest, match="token_ids"):
        small.check_tokenize(TokenizeRequest(token_ids=[3] * 200))
    small.check_tokenize(TokenizeRequest(text="a" * 100))
    engine.close()


def test_push_out_refuses_nobody_when_it_cannot_make_room(tiny_model):
    """--max-batch 2 --max-queued 2: a holds both slots and one queued row, c one queued row. b asks
    for 2 rows: refusing a's queued request would still leave no room, so b alone is refused and
    a's request stays queued (found by an attack: both were refused)."""
    engine = make_engine(tiny_model, max_batch=2, max_queued=2, max_unread_tokens=2, max_paused_s=3600.0,
                         yield_paused_s=3600.0)

    async def scenario():
        streams, queued = await two_running_two_queued(engine, "tenant:c")
        group = for_client(request(prompt(12, 9), n=3), "tenant:b")
        group.n = 2
        with pytest.raises(Overloaded, match="the worker is full"):
            await run_stream(engine, group)
        still = engine.scheduler.queued
        await end_all(streams, queued)
        return still

    assert asyncio.run(scenario()) == 2
    assert engine.scheduler.stats.pushed_out == 0
    engine.close()


def test_a_waiting_client_wakes_the_yielding_of_unread_streams(tiny_model):
    """The scheduler sleeps on the paused streams' --max-paused-s (an hour here) when another
    client's request queues: its arrival must shorten that to --yield-paused-s, so that one of the
    unread streams gives its slot up (found by an attack: nothing woke the scheduler, and the
    hoarder kept every slot until --max-paused-s)."""
    engine = make_engine(tiny_model, max_batch=2, max_queued=4, max_unread_tokens=2, max_paused_s=3600.0,
                         yield_paused_s=0.2)

    async def scenario():
        streams = await unread_streams(engine, "tenant:a", 2)
        await wait_for(lambda: all(s.paused for s in engine.scheduler.active), "a's streams to pause")
        tokens, _, _ = await run_stream(engine, for_client(request(prompt(12, 7), n=3), "tenant:b"))
        await end_all(streams, [])
        return tokens

    assert len(asyncio.run(scenario())) == 3
    assert engine.scheduler.stats.yielded == 1
    engine.close()
