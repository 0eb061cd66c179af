"""Pylon: the whole life of a model on one autoscaling Ray cluster.

    import pylon
    client = pylon.connect()          # RAY_ADDRESS, or the cluster `pylon cluster up` started
    print(client.status())
"""
from pylon.errors import PylonError

__version__ = "0.1.0"
__all__ = ["PylonError", "connect", "__version__"]


def connect(address: str | None = None, *, timeout_s: float = 10.0):
    """Return a `Client` bound to a running Ray cluster (see `pylon.client.connect`)."""
    from pylon.client import connect as _connect

    return _connect(address, timeout_s=timeout_s)
