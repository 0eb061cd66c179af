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


class JobNotFoundError(PylonError):
    """No job with this id (or submission id) on the cluster."""

    def __init__(self, job_id: str, where: str):
        self.job_id = job_id
        super().__init__(f"no job '{job_id}' on the cluster at {where} (list them with `pylon jobs list`)")


class JobFailedError(PylonError):
    """A job ended FAILED; the message carries the end of its logs."""

    def __init__(self, job_id: str, status: str, logs_tail: str, message: str | None = None):
        self.job_id, self.status, self.logs_tail = job_id, status, logs_tail
        why = f" ({message.strip()})" if message and message.strip() else ""
        super().__init__(
            f"job {job_id} ended {status}{why}; its logs end with:\n{logs_tail}\n"
            f"(all of them: `pylon jobs logs {job_id}`)"
        )
