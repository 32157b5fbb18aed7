"""`python -m dispatcher`: the sidecar, configured by environment variables."""

import sys

from conveyor.dispatcher_settings import DispatcherSettings
from dispatcher.main import run

if __name__ == "__main__":
    sys.exit(run(DispatcherSettings.from_env()))
