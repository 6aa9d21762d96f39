"""Scheduler tests over the FakeSpeechModel: batching, equality with solo runs, limits, cancel."""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest

from tests.server.fake_model import FakeSpeechModel
from tilevox.models.streaming import FinishReason, SynthesisRequest
from tilevox.server.metrics import ServerMetrics
from tilevox.server.scheduler import OverloadedError, Scheduler, ShuttingDownError


def _req(text: str, seed: int = 0, **kw) -> SynthesisRequest:
    return SynthesisRequest(text=text, seed=seed, **kw)


def _run(coro):
    return asyncio.run(coro)


@pytest.fixture
def sched_factory():
    made = []

    def make(model=None, **kw):
        model = model or FakeSpeechModel()
        kw.setdefault("max_active", 8)
        kw.setdefault("max_queued", 8)
        s = Scheduler(model, metrics=ServerMetrics(), **kw)
        s.start()
        made.append(s)
        return s

    yield make
    for s in made:
        s.shutdown()


def test_concurrent_streams_equal_solo_and_share_steps(sched_factory):
    model = FakeSpeechModel()
    sched = sched_factory(model, max_active=6, max_queued=20)
    rng = np.random.default_rng()
    reqs = [_req("x" * int(rng.integers(3, 40)), seed=int(rng.integers(0, 1000))) for _ in range(17)]

    async def main():
        handles = [sched.submit(r) for r in reqs]
        return await asyncio.gather(*(h.collect() for h in handles)), handles

    outs, handles = _run(main())
    for r, out, h in zip(reqs, outs, handles):
        np.testing.assert_array_equal(out, model.expected(r))
        assert h.stats.finish_reason is FinishReason.LENGTH
        assert h.stats.num_frames == min(len(r.text), 50 * 60)
    assert max(len(ids) for ids in model.step_log) == 6  # streams were batched, never beyond max_active
    assert model.open_stream_ids == ()


def test_overload_raises_and_queue_is_bounded(sched_factory):
    sched = sched_factory(FakeSpeechModel(step_delay_s=0.002), max_active=2, max_queued=3)

    async def main():
        handles = [sched.submit(_req("y" * 30)) for _ in range(5)]
        with pytest.raises(OverloadedError):
            sched.submit(_req("z"))
        await asyncio.gather(*(h.collect() for h in handles))
        # slots are free again once streams finish
        h = sched.submit(_req("after"))
        return await h.collect()

    assert _run(main()).size > 0


def test_cancel_frees_slot_within_one_step(sched_factory):
    model = FakeSpeechModel(step_delay_s=0.002)
    sched = sched_factory(model, max_active=1, max_queued=0)

    async def main():
        long = sched.submit(_req("l" * 5000, max_duration_s=100.0))
        got = 0
        async for samples in long:
            got += samples.size
            if got >= 3 * model.samples_per_frame:
                long.cancel()
                steps_at_cancel = len(model.step_log)
                break
        rest = [s async for s in long]  # drains until the stats arrive
        assert long.stats.finish_reason is FinishReason.CANCELLED
        assert len(model.step_log) - steps_at_cancel <= 2  # closed within one step (+ the one in flight)
        assert model.open_stream_ids == ()
        h = sched.submit(_req("next"))  # the only slot is free again
        return rest, await h.collect()

    _, nxt = _run(main())
    assert nxt.size > 0


def test_cancel_while_queued(sched_factory):
    sched = sched_factory(FakeSpeechModel(step_delay_s=0.002), max_active=1, max_queued=2)

    async def main():
        a = sched.submit(_req("a" * 40))
        b = sched.submit(_req("b" * 40))
        b.cancel()
        out_b = await b.collect()
        await a.collect()
        return b, out_b

    b, out_b = _run(main())
    assert out_b.size == 0 and b.stats.finish_reason is FinishReason.CANCELLED


def test_newcomer_first_audio_not_delayed_by_long_streams_with_batch_cap(sched_factory):
    model = FakeSpeechModel()
    sched = sched_factory(model, max_active=8, max_queued=0, max_batch=2)

    async def main():
        longs = [sched.submit(_req("L" * 400, seed=i)) for i in range(4)]
        await asyncio.sleep(0.05)
        new = sched.submit(_req("short", seed=99))
        async for _ in new:
            break
        new.cancel()
        for h in longs:
            h.cancel()
        await asyncio.gather(*(h.collect() for h in longs + [new]))
        return new.model_stream_id

    sid = _run(main())
    opened = model.open_at_step[sid]
    # 4 long streams hold the 2-wide batch, yet the newcomer is in the very next steps after it
    # opens until its first audio (lookahead step, then audio step)
    assert sid in model.step_log[opened] and sid in model.step_log[opened + 1]
    assert all(len(ids) <= 2 for ids in model.step_log)


def test_model_failure_fails_only_that_batch_and_worker_survives(sched_factory):
    class Exploding(FakeSpeechModel):
        def step(self, ids):
            if any(self._streams[i]["key"] == self.bad_key for i in ids):
                raise RuntimeError("boom")
            return super().step(ids)

    model = Exploding()
    import zlib

    model.bad_key = zlib.crc32(b"0|None|explode")
    sched = sched_factory(model, max_active=1, max_queued=2)

    async def main():
        bad = sched.submit(_req("explode"))
        with pytest.raises(Exception, match="boom"):
            await bad.collect()
        return await sched.submit(_req("fine")).collect()

    assert _run(main()).size > 0


def test_shutdown_rejects_new_streams(sched_factory):
    sched = sched_factory()

    async def main():
        sched.stop_accepting()
        with pytest.raises(ShuttingDownError):
            sched.submit(_req("late"))

    _run(main())


def test_invalid_request_is_rejected_before_queueing(sched_factory):
    sched = sched_factory()

    async def main():
        with pytest.raises(ValueError, match="voice"):
            sched.submit(_req("hi", voice="nobody"))
        assert sched.num_queued == 0

    _run(main())


def test_constructor_validation():
    with pytest.raises(ValueError, match="max_streams"):
        Scheduler(FakeSpeechModel(max_streams=4), max_active=5, max_queued=0)
    with pytest.raises(ValueError, match="max_queued"):
        Scheduler(FakeSpeechModel(), max_active=1, max_queued=-1)


def test_worker_death_fails_streams_and_refuses_new_ones(sched_factory):
    class BadClose(FakeSpeechModel):
        def close(self, stream_id):
            raise RuntimeError("close exploded")

    model = BadClose(step_delay_s=0.002)
    sched = sched_factory(model, max_active=2, max_queued=2)

    async def main():
        victim = sched.submit(_req("v" * 500))
        other = sched.submit(_req("o" * 500))
        async for _ in victim:
            break
        victim.cancel()  # the worker's close() raises: the worker loop dies
        for h in (victim, other):
            with pytest.raises(Exception, match="close exploded"):
                await h.collect()
        with pytest.raises(Exception, match="worker stopped"):
            sched.submit(_req("new"))

    _run(main())
    assert sched.worker_error is not None


async def _full_scheduler():
    """A started scheduler with its one place running a long stream and its one queue place taken:
    (scheduler, running handle, queued handle). The caller shuts it down."""
    import asyncio

    from tests.server.fake_model import FakeSpeechModel
    from tilevox.server.scheduler import Scheduler

    scheduler = Scheduler(FakeSpeechModel(step_delay_s=0.05), max_active=1, max_queued=1)
    scheduler.start()
    running = scheduler.submit(SynthesisRequest(text="a" * 40))
    while scheduler.num_active == 0:  # the worker admits it
        await asyncio.sleep(0.002)
    return scheduler, running, scheduler.submit(SynthesisRequest(text="b"))


def test_a_ticket_keeps_its_first_attempts_place_in_line():
    """Refused requests get a ticket; coming back with it queues them beyond max_queued, ahead of later arrivals."""
    import asyncio

    from tilevox.server.scheduler import OverloadedError

    async def main():
        scheduler, running, queued = await _full_scheduler()
        try:
            with pytest.raises(OverloadedError) as refused:
                scheduler.submit(SynthesisRequest(text="c"))
            assert refused.value.ticket and 0 < refused.value.retry_after_s <= 30
            with pytest.raises(OverloadedError):  # a newcomer without a ticket: still full
                scheduler.submit(SynthesisRequest(text="d"))
            back = scheduler.submit(SynthesisRequest(text="c"), ticket=refused.value.ticket)
            assert scheduler.num_queued == 2 and back.holds_ticket  # beyond max_queued=1
            with pytest.raises(OverloadedError):  # a ticket is single-use
                scheduler.submit(SynthesisRequest(text="c"), ticket=refused.value.ticket)
            for handle in (running, queued, back):
                await handle.collect()
        finally:
            scheduler.shutdown()

    asyncio.run(main())


def test_a_retry_on_the_same_connection_keeps_its_place_without_the_ticket():
    """A client that does not echo the ticket but retries on the connection it was refused on (`client`) is
    queued at its first attempt's place, ahead of a later refused arrival; another connection is still refused."""
    import asyncio

    from tilevox.server.scheduler import OverloadedError

    async def main():
        scheduler, running, queued = await _full_scheduler()
        try:
            with pytest.raises(OverloadedError):
                scheduler.submit(SynthesisRequest(text="c"), client="http 10.0.0.1:4000")
            with pytest.raises(OverloadedError) as later:  # refused after c, with a ticket it will echo
                scheduler.submit(SynthesisRequest(text="d"), client="http 10.0.0.2:4000")
            with pytest.raises(OverloadedError):  # a third connection never refused before: still full
                scheduler.submit(SynthesisRequest(text="e"), client="http 10.0.0.3:4000")
            late = scheduler.submit(SynthesisRequest(text="d"), ticket=later.value.ticket)
            back = scheduler.submit(SynthesisRequest(text="c"), client="http 10.0.0.1:4000")
            assert back.holds_ticket and late.holds_ticket and scheduler.num_queued == 3
            assert back.queue_order < late.queue_order  # c was refused first: it runs before d
            with pytest.raises(OverloadedError):  # the remembered ticket was used once
                scheduler.submit(SynthesisRequest(text="c"), client="http 10.0.0.1:4000")
            for handle in (running, queued, back, late):
                await handle.collect()
        finally:
            scheduler.shutdown()

    asyncio.run(main())


def test_a_finished_stream_frees_its_place_before_its_client_is_told():
    """A closed loop of N clients on N places and no queue never sees a spurious 429 (issue 19 item 8)."""
    import asyncio

    from tests.server.fake_model import FakeSpeechModel
    from tilevox.server.scheduler import Scheduler

    async def main():
        scheduler = Scheduler(FakeSpeechModel(), max_active=3, max_queued=0)
        scheduler.start()
        try:

            async def client(i):
                for k in range(20):
                    await scheduler.submit(SynthesisRequest(text="x" * (1 + (i + k) % 4))).collect()

            await asyncio.gather(*(client(i) for i in range(3)))
        finally:
            scheduler.shutdown()

    asyncio.run(main())


def test_a_burst_of_admissions_is_spread_over_frames_while_streams_run(sched_factory):
    """With streams running, at most max_prefill_batch new streams are prefilled (one open_streams call)
    between two frames, so a burst never holds the running streams back by more than one batched prefill."""
    model = FakeSpeechModel(step_delay_s=0.002)
    calls: list[tuple[int, int]] = []  # (streams asked for, steps taken before)
    real_open_streams = model.open_streams

    def spy(requests):
        calls.append((len(requests), len(model.step_log)))
        return real_open_streams(requests)

    model.open_streams = spy
    sched = sched_factory(model, max_active=40, max_queued=40, max_prefill_batch=8)

    async def main():
        first = sched.submit(_req("running " * 30))
        while not model.step_log:
            await asyncio.sleep(0.001)
        burst = [sched.submit(_req(f"burst {n}", seed=n)) for n in range(30)]
        return await asyncio.gather(*(h.collect() for h in [first, *burst]))

    outs = _run(main())
    assert all(out.size for out in outs)
    assert calls[0][0] == 1 and sum(n for n, _ in calls) == 31
    assert max(n for n, _ in calls[1:]) <= 8 and len(calls) >= 5
    steps_before = [steps for _, steps in calls[1:]]
    assert steps_before == sorted(set(steps_before))  # one batched prefill per frame at most


def test_waiting_chunks_come_as_one_array_and_the_end_still_follows():
    """A consumer that falls behind gets every chunk already waiting at once, in order; an end or error
    item behind them is kept for the next call, never lost or reordered."""
    from tilevox.server.scheduler import StreamHandle, StreamStats

    async def main():
        handle = StreamHandle(None, 0, _req("x"), asyncio.get_running_loop())
        chunks = [np.full(n, float(n), dtype=np.float32) for n in (3, 5, 2)]
        for chunk in chunks[:2]:
            handle._queue.put_nowait(chunk)
        first = await handle.__anext__()
        np.testing.assert_array_equal(first, np.concatenate(chunks[:2]))
        handle._queue.put_nowait(chunks[2])
        stats = StreamStats(
            num_frames=3,
            num_samples=10,
            sample_rate_hz=16000,
            queue_wait_s=0.0,
            time_to_first_audio_s=0.0,
            wall_time_s=0.0,
            finish_reason=FinishReason.LENGTH,
        )
        handle._queue.put_nowait(stats)
        handle._queue.put_nowait(np.ones(4, dtype=np.float32))  # never read: the stream ended before it
        np.testing.assert_array_equal(await handle.__anext__(), chunks[2])
        with pytest.raises(StopAsyncIteration):
            await handle.__anext__()
        assert handle.stats is stats

    _run(main())


def test_joining_stops_at_max_joined_chunks():
    from tilevox.server.scheduler import MAX_JOINED_CHUNKS, StreamHandle

    async def main():
        handle = StreamHandle(None, 0, _req("x"), asyncio.get_running_loop())
        chunks = [np.full(2, float(n), dtype=np.float32) for n in range(MAX_JOINED_CHUNKS + 3)]
        for chunk in chunks:
            handle._queue.put_nowait(chunk)
        first, second = await handle.__anext__(), await handle.__anext__()
        np.testing.assert_array_equal(first, np.concatenate(chunks[:MAX_JOINED_CHUNKS]))
        np.testing.assert_array_equal(second, np.concatenate(chunks[MAX_JOINED_CHUNKS:]))

    _run(main())


def test_worker_profile_covers_the_asked_steps_and_the_model_step(sched_factory, tmp_path):
    from tilevox.server.profiling import WorkerProfile

    model = FakeSpeechModel()
    out = tmp_path / "profile.txt"
    profile = WorkerProfile(7, out, skip=3, min_batch=2)
    sched = sched_factory(model, max_active=4, max_queued=8, profile=profile)
    reqs = [_req("x" * 30, seed=s) for s in range(4)]

    async def main():
        handles = [sched.submit(r) for r in reqs]
        return await asyncio.gather(*(h.collect() for h in handles))

    outs = _run(main())
    for r, o in zip(reqs, outs):
        np.testing.assert_array_equal(o, model.expected(r))  # profiling changes nothing streamed
    assert profile.done
    text = out.read_text()
    assert text.startswith("tilevox worker profile: 7 iterations with >= 2 streams after 3;")
    assert "cProfile of the worker thread, by tottime" in text
    assert "(step)" in text  # the model's step shows up by name in the worker's profile
    assert "torch.profiler" not in text  # CPU: no device tables


def test_worker_profile_validates():
    from tilevox.server.profiling import WorkerProfile

    for kw in ({"steps": 0}, {"steps": 1, "skip": -1}, {"steps": 1, "min_batch": 0}):
        with pytest.raises(ValueError):
            WorkerProfile(out="x", **kw)


def _first_audio_first_run(sched_factory, slack_s, step_delay_s=0.001):
    """Four long streams play (3,000 frames: still running when the newcomer ends, however fast the
    machine); once they have audio, a newcomer arrives. Returns (model, scheduler, newcomer id)."""
    model = FakeSpeechModel(step_delay_s=step_delay_s)
    sched = sched_factory(model, max_active=8, max_queued=0, newcomer_slack_s=slack_s)

    async def main():
        longs = [sched.submit(_req("L" * 3000, seed=i)) for i in range(4)]
        for h in longs:
            async for _ in h:
                break
        await asyncio.sleep(0.05)
        new = sched.submit(_req("short one", seed=99))
        out = await new.collect()
        for h in longs:
            h.cancel()
        await asyncio.gather(*(h.collect() for h in longs), return_exceptions=True)
        return new, out

    new, out = _run(main())
    np.testing.assert_array_equal(out, model.expected(_req("short one", seed=99)))
    return model, sched, new.model_stream_id


def test_first_audio_first_steps_a_newcomer_alone_while_players_have_slack(sched_factory):
    # The fake model makes 20 ms of audio per 1 ms step: the players' buffers are far ahead.
    model, sched, sid = _first_audio_first_run(sched_factory, slack_s=0.2)
    opened = model.open_at_step[sid]
    assert model.step_log[opened] == (sid,) and model.step_log[opened + 1] == (sid,)  # alone until first audio
    assert len(model.step_log[opened + 2]) == 5  # then everyone again
    assert sched.newcomer_steps == 2


def test_first_audio_first_never_starves_players_without_slack(sched_factory):
    # 5 ms steps of 20 ms audio build slack slowly; a 100 s bar is never reached: always stepped together.
    model, sched, sid = _first_audio_first_run(sched_factory, slack_s=100.0, step_delay_s=0.005)
    opened = model.open_at_step[sid]
    assert len(model.step_log[opened]) == 5 and sched.newcomer_steps == 0


def test_first_audio_first_off(sched_factory):
    model, sched, sid = _first_audio_first_run(sched_factory, slack_s=None)
    opened = model.open_at_step[sid]
    assert len(model.step_log[opened]) == 5 and sched.newcomer_steps == 0


def test_first_audio_first_is_off_by_default():
    assert Scheduler.__init__.__kwdefaults__["newcomer_slack_s"] is None
    with pytest.raises(ValueError, match="newcomer_slack_s"):
        Scheduler(FakeSpeechModel(), max_active=1, max_queued=0, newcomer_slack_s=-0.1)


def test_prefill_budget_prices_admissions_against_the_least_buffered_playing_stream():
    from tilevox.server.scheduler import PrefillBudget

    budget = PrefillBudget(margin_s=0.010)
    assert budget.admissions(0.080) >= 1 << 20  # nothing measured yet: unconstrained
    budget.observe_step(0.036)
    budget.observe_prefill(4, 0.014)  # one size seen: 3.5 ms an admission, no fixed part
    assert budget.cost() == pytest.approx((0.0, 0.0035))
    assert budget.admissions(None) >= 1 << 20  # nothing playing: no buffer to protect
    assert budget.admissions(0.080) == 9  # (80 - 36 - 10) / 3.5
    assert budget.admissions(0.040) == 1 and budget.admissions(0.001) == 1  # always progress
    budget = PrefillBudget(margin_s=0.010)
    budget.observe_step(0.036)
    for n in (1, 8, 2, 12, 4, 16):  # prefills of 8 ms + 3 ms an admission, sizes mixed
        budget.observe_prefill(n, 0.008 + 0.003 * n)
    fixed, marginal = budget.cost()
    assert fixed == pytest.approx(0.008, abs=2e-4) and marginal == pytest.approx(0.003, abs=2e-5)
    assert budget.admissions(0.080) == 8  # (80 - 36 - 10 - 8) / 3
    budget.observe_step(0.056)  # moving average: 36 + 0.2 x 20 = 40 ms
    assert budget.step_s == pytest.approx(0.040) and budget.admissions(0.080) == 7


@pytest.mark.parametrize("prefill_budget", [True, False])
def test_a_burst_right_after_first_audio_is_admitted_within_the_playing_streams_buffer(sched_factory, prefill_budget):
    """A playing stream has one 100 ms frame buffered when a burst of 30 arrives; prefill costs 12 ms an
    admission and a step 50 ms. With the prefill budget the next iteration admits only what fits in that
    buffer ((100 - 50 - 10) / 12: at most 3); without it max_prefill_batch (8) at once, which would make
    the stream's next audio come after its buffer ran dry. Every stream completes either way."""
    model = FakeSpeechModel(frame_rate_hz=10.0, step_delay_s=0.050)
    calls: list[int] = []
    real_open_streams = model.open_streams

    def slow_prefill(requests):
        calls.append(len(requests))
        time.sleep(0.012 * len(requests))
        return real_open_streams(requests)

    model.open_streams = slow_prefill
    first_audio_step, burst_queued = threading.Event(), threading.Event()
    real_step = model.step

    def step(ids):
        if len(model.step_log) == 1:  # the step that gives the first stream its first audio: the burst
            first_audio_step.set()  # is queued before it ends, so the next iteration sees all of it
            assert burst_queued.wait(10)
        return real_step(ids)

    model.step = step
    sched = sched_factory(model, max_active=40, max_queued=40, max_prefill_batch=8, prefill_budget=prefill_budget)

    async def main():
        first = sched.submit(_req("running " * 3))
        assert await asyncio.to_thread(first_audio_step.wait, 10)
        burst = [sched.submit(_req(f"b{n}", seed=n)) for n in range(30)]
        burst_queued.set()
        return await asyncio.gather(first.collect(), *(h.collect() for h in burst))

    outs = _run(main())
    assert all(out.size for out in outs) and sum(calls) == 31
    assert calls[1] <= 3 if prefill_budget else calls[1] == 8, calls


class _LatePrefills(FakeSpeechModel):
    """A model whose prefills finish on the device `late` steps after open_streams returns (as a prefill on
    its own CUDA stream, models.cuda_streams): is_ready says so, and stepping a stream early is recorded."""

    def __init__(self, late: int, **kw) -> None:
        super().__init__(**kw)
        self.late = late
        self.ready_at: dict[int, int] = {}  # stream id -> len(step_log) from which it is ready
        self.stepped_early: list[tuple[int, int]] = []  # (stream id, step) stepped before ready

    def open_stream(self, request):
        sid = super().open_stream(request)
        self.ready_at[sid] = len(self.step_log) + self.late
        return sid

    def is_ready(self, stream_id: int) -> bool:
        return len(self.step_log) >= self.ready_at.get(stream_id, 0)

    def step(self, stream_ids):
        self.stepped_early += [(i, len(self.step_log)) for i in stream_ids if not self.is_ready(i)]
        return super().step(stream_ids)


def test_running_streams_step_while_an_admission_prefills_and_it_joins_once_ready(sched_factory):
    """Streams step on while a new stream's prefill is unfinished; the new stream joins the first step after
    its prefill finished; a stream alone with an unfinished prefill is stepped anyway (the step waits for it
    on the device), so the worker never spins; every stream's audio is its solo audio."""
    model = _LatePrefills(late=3, step_delay_s=0.002)
    sched = sched_factory(model, max_active=8, max_queued=8)
    first_req, later_req = _req("running " * 10, seed=1), _req("admitted later", seed=2)

    async def main():
        first = sched.submit(first_req)
        while len(model.step_log) < 4:  # the first stream's own prefill has finished (ready from step 3)
            await asyncio.sleep(0.001)
        later = sched.submit(later_req)
        return await asyncio.gather(first.collect(), later.collect())

    first_out, later_out = _run(main())
    np.testing.assert_array_equal(first_out, model.expected(first_req))
    np.testing.assert_array_equal(later_out, model.expected(later_req))
    first_id, later_id = 0, 1
    later_steps = [n for n, ids in enumerate(model.step_log) if later_id in ids]
    assert later_steps[0] == model.ready_at[later_id]  # joined at the first step once ready, not before
    opened = model.open_at_step[later_id]
    assert all(ids == (first_id,) for ids in model.step_log[opened : later_steps[0]])  # the others went on
    assert len(model.step_log[opened : later_steps[0]]) == 3
    # The first stream, alone and not ready, was stepped at once (the device would have waited for it).
    assert model.stepped_early == [(first_id, 0), (first_id, 1), (first_id, 2)]
