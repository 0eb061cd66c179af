"""Pylon: the whole life of a model on one autoscaling Ray cluster.

import pylon
client = pylon.connect()          # RAY_ADDRESS, or the cluster `pylon cluster up` started
print(client.status())
run = client.train("train.yaml")  # a Run: logs, metrics, plot, checkpoints, export (see pylon.sdk.handles)
"""

from pylon.errors import PylonError
from pylon.version import __version__

__all__ = ["PylonError", "connect", "Run", "Service", "Job", "DataJob", "__version__"]

_SDK = ("Run", "Service", "Job", "DataJob")


def connect(address: str | None = None, *, timeout_s: float = 10.0):
    """Return a `Client` bound to a running Ray cluster (see `pylon.sdk.client.connect`)."""
    from pylon.sdk.client import connect as _connect

    return _connect(address, timeout_s=timeout_s)


def __getattr__(name: str):
    # The SDK's handles load on first use: `import pylon` stays light for the CLI and job entrypoints.
    if name in _SDK:
        from pylon import sdk

        return getattr(sdk, name)
    raise AttributeError(f"module 'pylon' has no attribute {name!r}")
