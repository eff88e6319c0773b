"""The engine thread and its consumers: a consumer that stops reading holds O(its length) and is aborted after
the stall timeout; admission counts sequences."""
from __future__ import annotations

import asyncio
import gc
import threading
import time
import tracemalloc

import pytest

from resin import LLM, SamplingParams
from resin.core.sampling_params import OutputKind
from resin.server.async_engine import AsyncEngine, QueueFull

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def llm(text_model):
    return LLM(str(text_model[0]), dtype="float32", kv_cache_memory="16MiB", max_num_seqs=4)


def _params(max_tokens: int, n: int = 1) -> SamplingParams:
    return SamplingParams(n=n, temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=1,
                          output_kind=OutputKind.DELTA)


async def _until(cond, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


def test_a_stalled_stream_holds_o_length_and_reading_later_gets_it_all(llm):
    async def main():
        engine = AsyncEngine(llm.engine, stall_timeout=600)
        engine.start()
        retained = {}
        try:
            for length in (150, 600):
                gc.collect()
                tracemalloc.start()
                base = tracemalloc.get_traced_memory()[0]
                stream = engine.submit(f"r{length}", [(None, [1, 2, 3])], _params(length))
                await _until(lambda: stream.done)
                gc.collect()
                retained[length] = tracemalloc.get_traced_memory()[0] - base
                tracemalloc.stop()
                outs = [out async for _, out in stream]  # the reader comes back: everything, merged once
                stream.close()
                assert len(outs) == 1 and len(outs[0].outputs[0].token_ids) == length
                assert len(outs[0].outputs[0].logprobs) == length and outs[0].finished
        finally:
            engine.stop()
        return retained

    retained = asyncio.run(main())
    # Linear in the length (4x the tokens: ~4x the bytes); cumulative outputs queued per step would be ~16x.
    print("retained bytes", retained)
    assert retained[600] < 6 * retained[150], retained


def test_a_consumer_that_stops_reading_is_aborted_and_its_blocks_freed(llm):
    async def main():
        engine = AsyncEngine(llm.engine, stall_timeout=0.5)
        engine.start()
        try:
            stream = engine.submit("stalled", [(None, [1, 2, 3])], _params(1500, n=2))
            i, first = await stream.__anext__()  # reads once, then stops
            start = time.monotonic()
            await _until(lambda: stream.done)
            stopped_after = time.monotonic() - start
            rest = [out async for _, out in stream]
            stream.close()
        finally:
            engine.stop()
        return first, rest, stopped_after

    first, rest, stopped_after = asyncio.run(main())
    produced = len(first.outputs[0].token_ids) + sum(len(c.token_ids) for o in rest for c in o.outputs if c.index == 0)
    assert stopped_after < 10 and produced < 1500
    assert rest[-1].finished and {c.finish_reason for c in rest[-1].outputs} == {"abort"}
    assert llm.engine.kv.pool.num_free == llm.engine.kv.pool.num_blocks


def test_admission_counts_sequences_not_requests(llm):
    async def main():
        engine = AsyncEngine(llm.engine, max_waiting=10)  # not started: nothing leaves the queue
        engine._started = True  # noqa: admission only; no thread steps it here
        a = engine.submit("a", [(None, [1, 2])], _params(4, n=6))
        with pytest.raises(QueueFull):
            engine.submit("b", [(None, [1, 2]), (None, [3])], _params(4, n=3))
        engine.submit("c", [(None, [1, 2]), (None, [3])], _params(4, n=2))
        assert engine.num_waiting == 10
        a.close()
    asyncio.run(main())


def test_a_reader_kept_waiting_by_the_queue_is_not_stalled(llm):
    """The stall clock runs only while output waits unread: a consumer parked for seconds while its request
    queues, then handed several outputs at once (the event loop was busy), reads on and is never aborted."""
    async def main():
        engine = AsyncEngine(llm.engine, stall_timeout=0.3)
        engine.start()
        try:
            # long enough that a free slot takes well over the stall timeout on a fast machine too
            busy = [engine.submit(f"busy{i}", [(None, [1, 2, 3])], _params(1000)) for i in range(4)]
            stream = engine.submit("late", [(None, [7, 8])], _params(40))
            start = time.monotonic()
            await _until(lambda: engine.num_waiting == 0)
            assert time.monotonic() - start > 0.3  # it waited in the queue for longer than the stall timeout
            time.sleep(0.2)  # the loop is busy: several outputs land in one turn
            outs = [out async for _, out in stream]
            for b in busy:
                b.close()
        finally:
            engine.stop()
        return stream, outs

    stream, outs = asyncio.run(main())
    assert not stream.stalled
    assert outs[-1].outputs[-1].finish_reason == "length"
    assert sum(len(c.token_ids) for o in outs for c in o.outputs) == 40


def test_run_in_this_thread_steps_in_the_caller_and_serves_requests_from_another(llm):
    """`resin run`'s arrangement: the engine steps in the thread that calls run_in_this_thread (the main thread,
    which owns the model's OpenMP team) while an event loop in another thread submits and reads; stop() from that
    thread ends the loop."""
    steppers: set[str] = set()
    result: dict = {}
    engine = AsyncEngine(llm.engine, on_step=lambda _: steppers.add(threading.current_thread().name))

    def http_side():
        async def main():
            stream = engine.submit("r", [(None, [1, 2, 3])], _params(12))
            result["tokens"] = sum([len(c.token_ids) async for _, o in stream for c in o.outputs])
        try:
            asyncio.run(main())
        finally:
            engine.stop()

    http = threading.Thread(target=http_side, name="http")
    engine.run_in_this_thread(then_start=http.start)
    http.join(60)
    assert result["tokens"] == 12
    assert steppers == {threading.current_thread().name}
    assert not engine.alive  # the loop returned: submitting now fails with a 503, not a hang
