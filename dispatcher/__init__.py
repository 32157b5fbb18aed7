"""The dispatcher sidecar (SPEC §7): `<queue>-in` -> a plain HTTP function -> `<queue>-out`.

It exists so that function authors write one HTTP handler and nothing else: the
dispatcher owns the AMQP consumer, acks, retries, progress coalescing, health
probes and the SIGTERM dance. Entry point: `dispatcher.main.run(settings)`.

Module map, one concept each:

* `main`       process lifecycle: start, wait, stop; returns the exit code
* `consumer`   the AMQP connection (robust), the wait for `-in`, deliveries
* `worker`     what happens to one delivery, top to bottom
* `inflight`   handler tasks in flight, and deliveries orphaned by a reconnection
* `invoker`    the HTTP call in CloudEvents binary mode, answer -> outcome
* `retry`      backoff, Retry-After, the attempt loop within the task timeout
* `publisher`  confirmed publishes: events to `-out`, graceful requeues to `-in`
* `progress`   per-task coalescing and rate limiting of progress reports
* `api`        the local HTTP API (progress, health, metrics), via aiohttp
* `metrics`    Prometheus counters
* `readiness`  waiting for the function before consuming anything
* `shutdown`   signals, abort tokens, and the `requeue` / `drain` modes
"""
