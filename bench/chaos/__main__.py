"""`python -m bench.chaos`: see bench/chaos/__init__.py."""

from bench.chaos.run import main

raise SystemExit(main())
