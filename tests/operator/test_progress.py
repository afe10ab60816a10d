"""Progress: the trainer's Prometheus text into status.progress."""
from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest

from sftjob_operator import progress
from sftjob_operator.status import Progress

pytestmark = pytest.mark.unit

TEXT = """# HELP sftjob_trainer_step Optimizer steps done.
# TYPE sftjob_trainer_step gauge
sftjob_trainer_step 12.0
# TYPE sftjob_trainer_total_steps gauge
sftjob_trainer_total_steps 40.0
# TYPE sftjob_trainer_epoch gauge
sftjob_trainer_epoch 0.0
# TYPE sftjob_trainer_loss gauge
sftjob_trainer_loss 2.718281828
# TYPE sftjob_trainer_tokens_per_second gauge
sftjob_trainer_tokens_per_second 1234.5678
# TYPE sftjob_trainer_last_checkpoint_step gauge
sftjob_trainer_last_checkpoint_step 10.0
# TYPE sftjob_trainer_tokens_total counter
sftjob_trainer_tokens_total 99999.0
# TYPE python_gc_objects_collected_total counter
python_gc_objects_collected_total{generation="0"} 5.0
"""


def test_parse_metrics_picks_the_contract_gauges():
    got = progress.parse_metrics(TEXT)
    assert got == {"step": 12, "totalSteps": 40, "epoch": 0, "loss": 2.718282,
                   "tokensPerSecond": 1234.5678, "lastCheckpointStep": 10}


def test_merge_rounds_summarises_and_stamps_only_on_change():
    new = progress.merge(Progress(), progress.parse_metrics(TEXT), "T1")
    assert (new.summary, new.loss, new.tokens_per_second, new.updated_time) == ("12/40", 2.7183, 1234.6, "T1")
    assert new.last_step_time == "T1"
    again = progress.merge(new, progress.parse_metrics(TEXT), "T2")
    assert (again.updated_time, again.last_step_time) == ("T1", "T1")


def test_uninitialised_trainer_does_not_wipe_progress():
    before = Progress(step=12, total_steps=40, loss=2.5, summary="12/40")
    assert progress.merge(before, {"step": 0, "totalSteps": 0, "loss": 0.0}, "T") == before


def test_infinite_values_are_dropped_not_raised():
    got = progress.parse_metrics("sftjob_trainer_step +Inf\nsftjob_trainer_tokens_per_second NaN\n"
                                 "sftjob_trainer_total_steps 40\n")
    assert got == {"totalSteps": 40}


def test_a_non_finite_loss_is_shown_as_such_not_hidden_behind_the_last_finite_one():
    """A run of NaN steps kept showing its last finite loss, and looked healthy."""
    before = progress.merge(Progress(), progress.parse_metrics(TEXT), "T1")
    text = ("sftjob_trainer_step 13\nsftjob_trainer_total_steps 40\nsftjob_trainer_loss NaN\n"
            "# TYPE sftjob_trainer_skipped_steps counter\nsftjob_trainer_skipped_steps_total 3.0\n"
            "# TYPE sftjob_trainer_failed_checkpoint_commits counter\n"
            "sftjob_trainer_failed_checkpoint_commits_total 1.0\n")
    now = progress.merge(before, progress.parse_metrics(text), "T2")
    assert now.loss is None and now.non_finite_loss == "nan"
    assert (now.skipped_steps, now.failed_checkpoint_commits) == (3, 1)
    assert progress.merge(now, {"step": 14, "totalSteps": 40, "loss": float("-inf")}, "T3").non_finite_loss == "-inf"
    back = progress.merge(now, {"step": 15, "totalSteps": 40, "loss": 1.5}, "T4")
    assert (back.loss, back.non_finite_loss) == (1.5, None)


class _Endpoints:
    """Real HTTP endpoints on 127.0.0.1: a good trainer, a huge response, a hung one."""

    def __init__(self):
        from aiohttp import web

        async def good(_):
            return web.Response(text=TEXT)

        async def huge(_):
            return web.Response(text="x" * (progress.MAX_BYTES + 10))

        async def hung(_):
            await asyncio.sleep(5)
            return web.Response(text=TEXT)

        self.app = web.Application()
        self.app.add_routes([web.get("/good", good), web.get("/huge", huge), web.get("/hung", hung)])

    async def __aenter__(self):
        from aiohttp import web

        self.runner = web.AppRunner(self.app, shutdown_timeout=0.2)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.base = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc):
        await self.runner.cleanup()


def test_scrape_limits_size_and_time():
    async def main():
        async with _Endpoints() as ep, aiohttp.ClientSession() as session:
            assert (await progress.scrape(session, f"{ep.base}/good"))["step"] == 12
            assert await progress.scrape(session, f"{ep.base}/huge") is None
            t0 = time.monotonic()
            assert await progress.scrape(session, f"{ep.base}/hung") is None
            assert time.monotonic() - t0 < progress.SCRAPE_TIMEOUT_S + 1

    asyncio.run(main())


def test_scraper_never_makes_a_caller_wait_on_an_endpoint():
    """want() returns at once whatever the endpoint does; readings arrive in the background
    and a change asks for a reconcile of that job only."""
    async def main():
        changed = []
        async with _Endpoints() as ep, aiohttp.ClientSession() as session:
            scraper = progress.Scraper(session, on_change=changed.append, interval=0.1)
            t0 = time.monotonic()
            assert scraper.want("hung-job", "uid-1", f"{ep.base}/hung") is None
            assert scraper.want("good-job", "uid-2", f"{ep.base}/good") is None
            assert time.monotonic() - t0 < 0.1
            for _ in range(50):
                await asyncio.sleep(0.05)
                if changed:
                    break
            assert changed == ["good-job"]
            assert scraper.want("good-job", "uid-2", f"{ep.base}/good")["step"] == 12
            # A new pod (a restarted gang) starts from nothing, never from the old pod's reading.
            assert scraper.want("good-job", "uid-3", f"{ep.base}/good") is None
            scraper.close()
            assert not scraper.tasks

    asyncio.run(main())


@pytest.mark.parametrize("wait, answered, elapsed, expected", [
    (5.0, True, 0.01, 5.0),      # answered: the normal interval
    (20.0, True, 2.9, 5.0),      # answered slowly after back-off: back to the interval
    (5.0, False, 0.01, 5.0),     # refused at once (port not open yet): no back-off
    (5.0, False, 1.0, 10.0),     # no answer until the connect timeout: back off
    (10.0, False, 3.0, 20.0),
    (20.0, False, 3.0, progress.MAX_BACKOFF_S),  # capped
])
def test_next_wait_backs_off_only_for_endpoints_that_make_the_read_wait(wait, answered, elapsed, expected):
    assert progress.next_wait(wait, 5.0, answered, elapsed) == expected


def test_a_trainer_that_opens_its_port_late_is_read_within_an_interval():
    """A trainer loads its model and data before it serves metrics; its refused reads must not
    push the first reading of its steps back by the whole back-off (they did: 20 s, so a
    short run showed no step until it had finished)."""
    from aiohttp import web

    async def main():
        import socket

        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        changed = []
        async with aiohttp.ClientSession() as session:
            scraper = progress.Scraper(session, on_change=changed.append, interval=0.2)
            scraper.want("job", "uid-1", f"http://127.0.0.1:{port}/metrics")
            # Refused reads for 3.5 s: with back-off (0.4, 0.8, 1.6, 3.2 s) the next read would
            # come only at 6 s; at the interval it comes within 0.2 s of the port opening.
            await asyncio.sleep(3.5)

            async def serve(request):
                return web.Response(text=TEXT)

            app = web.Application()
            app.router.add_get("/metrics", serve)
            runner = web.AppRunner(app, shutdown_timeout=0.2)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", port).start()
            try:
                t0 = time.monotonic()
                while not changed and time.monotonic() - t0 < 1.0:
                    await asyncio.sleep(0.05)
                assert changed == ["job"], "the endpoint was not read within 1 s of opening its port"
            finally:
                scraper.close()
                await runner.cleanup()

    asyncio.run(main())


def test_work_at_risk_is_the_steps_and_time_since_the_last_commit():
    from sftjob_operator.progress import merge
    from sftjob_operator.status import Progress

    p = merge(Progress(), {"step": 17, "totalSteps": 40, "lastCheckpointStep": 15,
                           "lastCheckpointTime": 1767268800.0}, "2026-01-01T12:00:05Z")
    assert p.steps_since_checkpoint == 2 and p.last_checkpoint_time == "2026-01-01T12:00:00Z"
    assert merge(Progress(), {"step": 3, "totalSteps": 40}, "t").steps_since_checkpoint == 3


def test_the_preflight_report_per_source_reaches_status():
    """Issue 27: the per-source report (rows, dropped, truncated, tokens) in status, not only
    in the log: the trainer's labelled gauges become status.progress.sources, in its order."""
    from sftjob_contract import metrics as M

    rows = [("chat", 300, 290, 10, 4, 9000, 500), ("code", 200, 200, 0, 0, 7000, 300),
            ("jsonl", 90, 88, 2, 1, 2000, 200)]
    text = TEXT
    for metric, col in ((M.SOURCE_ROWS, 1), (M.SOURCE_USABLE_ROWS, 2), (M.SOURCE_DROPPED_ROWS, 3),
                        (M.SOURCE_TRUNCATED_ROWS, 4), (M.SOURCE_TOKENS, 5), (M.SOURCE_SAMPLES_PER_EPOCH, 6)):
        text += f"# TYPE {metric} gauge\n" + "".join(f'{metric}{{source="{r[0]}"}} {float(r[col])}\n' for r in rows)
    got = progress.parse_metrics(text)
    assert got["sources"][0] == {"name": "chat", "rows": 300, "usableRows": 290, "droppedRows": 10,
                                 "truncatedRows": 4, "tokens": 9000, "samplesPerEpoch": 500}
    assert [s["name"] for s in got["sources"]] == ["chat", "code", "jsonl"]
    st = progress.merge(Progress(), got, "T1").model_dump(by_alias=True, exclude_none=True)
    assert st["sources"][2] == {"name": "jsonl", "rows": 90, "usableRows": 88, "droppedRows": 2, "truncatedRows": 1,
                                "tokens": 2000, "samplesPerEpoch": 200}
    assert st["step"] == 12   # beside the other values, which are unchanged
    assert "sources" not in progress.parse_metrics(TEXT)
