"""The gateway: consumer API, task store, outbox relay, result consumer, notifier,
reaper and purge. It is the only writer of task state (SPEC §6.4)."""
