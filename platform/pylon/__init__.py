"""Pylon: the whole life of a model on one autoscaling Ray cluster.

import pylon
client = pylon.connect()          # RAY_ADDRESS, or the cluster `pylon cluster up` started
print(client.status())
run = client.train("train.yaml")  # a Run: logs, metrics, plot, checkpoints, export (see pylon.sdk.handles)
"""

from pylon.errors import PylonError
from pylon.version import __version__

__all__ = ["PylonError", "connect", "evaluate", "Run", "Service", "Job", "DataJob", "__version__"]

_SDK = ("Run", "Service", "Job", "DataJob")


def connect(address: str | None = None, *, timeout_s: float = 10.0):
    """Return a `Client` bound to a running Ray cluster (see `pylon.sdk.client.connect`)."""
    from pylon.sdk.client import connect as _connect

    return _connect(address, timeout_s=timeout_s)


def evaluate(model_or_endpoint: str, **kwargs):
    """Perplexity of an export directory or a deployment on a prepared dataset's held-out split; an `Evaluation`
    (see `pylon.sdk.evaluate.evaluate` for the arguments; `pylon eval` is the same on the command line)."""
    from pylon.sdk.evaluate import evaluate as _evaluate

    return _evaluate(model_or_endpoint, **kwargs)


def __getattr__(name: str):
    # The SDK's handles load on first use: `import pylon` stays light for the CLI and job entrypoints.
    if name in _SDK:
        from pylon import sdk

        return getattr(sdk, name)
    raise AttributeError(f"module 'pylon' has no attribute {name!r}")
