"""The broker node list of CONVEYOR_AMQP_URL (conveyor/connection.py), without a broker."""

from __future__ import annotations

import pytest
from yarl import URL

from conveyor.connection import NodeList

THREE = "amqp://u:p@rmq-0:5672/;amqp://u:p@rmq-1:5672/ ; amqp://u:p@rmq-2:5672/;"


def test_the_list_is_split_shuffled_per_process_and_walked_round() -> None:
    nodes = NodeList(THREE, shuffle=False)
    assert nodes.urls == [f"amqp://u:p@rmq-{n}:5672/" for n in range(3)]
    assert nodes.after(nodes.urls[0]) == nodes.urls[1]
    assert nodes.after(URL(nodes.urls[2])) == nodes.urls[0]
    assert nodes.after("amqp://elsewhere/") == nodes.urls[0]
    orders = {tuple(NodeList(THREE).urls) for _ in range(50)}
    assert len(orders) > 1  # each process starts somewhere else


def test_one_url_is_a_list_of_one() -> None:
    nodes = NodeList("amqp://guest:guest@127.0.0.1:5672/")
    assert nodes.urls == ["amqp://guest:guest@127.0.0.1:5672/"]
    assert nodes.after(nodes.urls[0]) == nodes.urls[0]


def test_the_heartbeat_is_added_unless_the_url_sets_its_own() -> None:
    nodes = NodeList("amqp://a/;amqp://b/?heartbeat=3", heartbeat=10, shuffle=False)
    assert [URL(u).query.get("heartbeat") for u in nodes.urls] == ["10", "3"]


def test_an_empty_setting_is_refused() -> None:
    with pytest.raises(ValueError, match="names no broker node"):
        NodeList(" ; ")
