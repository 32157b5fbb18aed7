"""Conveyor: asynchronous HTTP functions behind a queue.

This package is the contract shared by the gateway and the dispatcher: the wire
format (`events`), the queue topology (`topology`), settings, the CLI, the client
SDK and the optional function helper. It must stay light: the dispatcher image
installs it without the gateway's dependencies.
"""

__version__ = "0.1.0"
