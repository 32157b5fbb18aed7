"""The gateway asks the broker whether a queue exists every 10 s per service with PENDING tasks
(the `queue-check` loop) and at every results refresh: on the real broker, the answers, and
what asking costs the connection over time."""

from __future__ import annotations

import asyncio
import gc
import uuid

import aio_pika
from aio_pika.tools import OneShotCallback

from gateway.broker import Broker


def _callbacks_held() -> int:
    """aio-pika's per-channel close callbacks alive: one stays on the connection for every
    channel ever opened on it (aio-pika 10.2.1)."""
    gc.collect()
    return sum(1 for o in gc.get_objects() if isinstance(o, OneShotCallback))


async def _ask(amqp_url: str) -> tuple[list[bool], int]:
    broker = Broker(amqp_url)
    name = f"check-{uuid.uuid4().hex[:10]}"
    connection = await aio_pika.connect(amqp_url)
    try:
        async with connection:
            channel = await connection.channel()
            await channel.declare_queue(name)
            try:
                answers = [await broker.queue_exists(name), await broker.queue_exists(name + "-x")]
                answers.append(await broker.queue_exists(name))  # after a NOT_FOUND closed it
                before = _callbacks_held()
                for _ in range(200):
                    assert await broker.queue_exists(name)
                return answers, _callbacks_held() - before
            finally:
                await channel.queue_delete(name)
    finally:
        await broker.close()


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
    broker = Broker(amqp_url)
    name = f"check-{uuid.uuid4().hex[:10]}"
    connection = await aio_pika.connect(amqp_url)
    wrong: list[tuple[object, object]] = []
    try:
        async with connection:
            channel = await connection.channel()
            await channel.declare_queue(name)
            try:
                for _ in range(rounds):
                    answers = await asyncio.gather(
                        broker.queue_exists(name + "-x"),
                        broker.queue_exists(name),
                        return_exceptions=True,
                    )
                    if answers != [False, True]:
                        wrong.append((answers[0], answers[1]))
            finally:
                await channel.queue_delete(name)
    finally:
        await broker.close()
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
