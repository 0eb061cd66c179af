"""Errors a user can act on. The CLI prints them without a traceback."""


class PylonError(Exception):
    """A problem with the user's input or environment, with what to do next in the message."""


class SpecError(PylonError):
    """One or more spec documents are invalid; `problems` lists every one of them."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        super().__init__("\n".join(self.problems))


class StorageError(PylonError):
    """A URI could not be resolved, read or written."""


class ClusterError(PylonError):
    """No cluster, or the cluster could not be started, reached or stopped."""
