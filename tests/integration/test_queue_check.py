"""The gateway asks the broker whether a queue exists every 10 s per service with PENDING tasks
(the `queue-check` loop) and at every results refresh: on the real broker, the answers, and
what asking costs the connection over time."""

from __future__ import annotations

import asyncio
import gc
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import aio_pika
from aio_pika.tools import OneShotCallback

from gateway.broker import Broker


def _callbacks_held() -> int:
    """aio-pika's per-channel close callbacks alive: one stays on the connection for every
    channel ever opened on it (aio-pika 10.2.1)."""
    gc.collect()
    return sum(1 for o in gc.get_objects() if isinstance(o, OneShotCallback))


@asynccontextmanager
async def _a_queue(amqp_url: str) -> AsyncIterator[tuple[Broker, str]]:
    """A gateway's broker, and the name of a queue that exists for the block's length."""
    broker = Broker(amqp_url)
    name = f"check-{uuid.uuid4().hex[:10]}"
    connection = await aio_pika.connect(amqp_url)
    try:
        async with connection:
            channel = await connection.channel()
            await channel.declare_queue(name)
            try:
                yield broker, name
            finally:
                await channel.queue_delete(name)
    finally:
        await broker.close()


async def _ask(amqp_url: str) -> tuple[list[bool], int]:
    async with _a_queue(amqp_url) as (broker, name):
        answers = [await broker.queue_exists(name), await broker.queue_exists(name + "-x")]
        answers.append(await broker.queue_exists(name))  # after a NOT_FOUND closed it
        before = _callbacks_held()
        for _ in range(200):
            assert await broker.queue_exists(name)
        return answers, _callbacks_held() - before


def test_queue_exists_answers_and_holds_nothing_per_question(amqp_url: str) -> None:
    """Found when the queue check came back: each question opened a channel, and aio-pika
    keeps a callback (~4 KB with what it holds) on the connection for every channel ever
    opened there, so a gateway grew by a few KB per service with PENDING tasks every 10 s.
    The questions now share one channel."""
    answers, held = asyncio.run(_ask(amqp_url))
    assert answers == [True, False, True]
    assert held < 5, f"{held} callbacks more after 200 questions"


async def _ask_at_once(amqp_url: str, rounds: int) -> list[tuple[object, object]]:
    """A question about a missing queue and one about a queue that exists, asked together
    on the shared channel `rounds` times; each pair of answers that was not (False, True)."""
    wrong: list[tuple[object, object]] = []
    async with _a_queue(amqp_url) as (broker, name):
        for _ in range(rounds):
            answers = await asyncio.gather(
                broker.queue_exists(name + "-x"), broker.queue_exists(name), return_exceptions=True
            )
            if answers != [False, True]:
                wrong.append((answers[0], answers[1]))
    return wrong


def test_questions_asked_at_once_each_get_their_own_answer(amqp_url: str) -> None:
    """Found by CI: the broker answers a question about a missing queue by closing the shared
    channel, and that failed every other question in flight on it, or answered it "missing".
    A gateway's results subscription asked whether a service's `-in` was there while its
    service figures asked about another; told nothing, it declared `-in` at once, and the
    tasks whose messages had gone with the deleted queue stayed PENDING. One question at a
    time on the channel now."""
    wrong = asyncio.run(_ask_at_once(amqp_url, 50))
    assert not wrong, f"{len(wrong)} of 50 pairs answered wrong, e.g. {wrong[:3]}"


async def _ask_after_giving_up(amqp_url: str, rounds: int) -> list[object]:
    """A question given up halfway (its caller's timeout), then another about a queue that
    exists, `rounds` times; each answer to the second that was not True."""
    wrong: list[object] = []
    async with _a_queue(amqp_url) as (broker, name):
        assert await broker.queue_exists(name)
        for _ in range(rounds):
            given_up = asyncio.create_task(broker.queue_exists(name))
            for _ in range(2):  # under way: the question is on the wire
                await asyncio.sleep(0)
            given_up.cancel()
            try:
                answer: object = await broker.queue_exists(name)
            except Exception as exc:
                answer = exc
            if answer is not True:
                wrong.append(answer)
    return wrong


def test_a_question_given_up_halfway_fails_no_other(amqp_url: str) -> None:
    """Found under load: the service figures give up their questions after a few seconds,
    and aiormq closes the channel of an RPC cancelled halfway; the next question (a results
    subscription asking for a lost `-in`) failed with "Channel closed by RPC timeout", so
    the gateway declared `-in` at once, and the tasks lost with it stayed PENDING."""
    wrong = asyncio.run(_ask_after_giving_up(amqp_url, 100))
    assert not wrong, f"{len(wrong)} of 100 answers wrong, e.g. {wrong[:3]}"
