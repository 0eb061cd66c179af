"""The Python SDK for notebooks: handles on the work a `Client` submits, all through Ray's public APIs
(the Jobs API, Serve's REST API on the dashboard, and the deployments' own HTTP).

    import pylon
    client = pylon.connect()
    data = client.prepare_data(sources=["/usr/lib/python3.11"], include="*.py", output="/data/stdlib", seq_len=256)
    data.wait()                                   # -> "SUCCEEDED" (JobFailedError with the logs' end if it failed)
    run = client.train("train.yaml")              # or a TrainJobSpec, or a dict of its fields -> Run
    run.logs(follow=True)                         # stream the job's logs here until it ends
    run.metrics()                                 # pandas DataFrame, one row per optimizer step
    run.plot()                                    # the loss curve, a matplotlib Figure (drawn inline)
    run.evaluations()                             # held-out loss and perplexity, one row per evaluation
    run.checkpoints()                             # committed steps, e.g. [150, 200]
    svc = client.deploy({"kind": "Deployment", "name": "gpt", "model": run.run_uri + "/export"})
    svc.complete("def ", max_tokens=32)           # -> text;  stream=True yields the text as it comes
    svc.delete()

`Job` is any Ray job (`client.jobs()` lists them, `pylon jobs ...` drives them); `Run` is a training job with
its run directory; `DataJob` a `pylon data prepare` job with its output; `BatchRun` a `pylon batch` job with its
answers; `Service` a Serve application. API keys are read from the environment variable a Deployment names, kept
in the `Service` object only, and never shown by its repr.
"""

from __future__ import annotations

import contextlib
import html
import json
import math
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any

from pylon.display import html_table
from pylon.errors import JobFailedError, PylonError
from pylon.jobs.run_dir import eval_line, loss_figure, read_completions, read_metrics
from pylon.sdk.serve import delete

if TYPE_CHECKING:
    from pylon.sdk.client import Client


TERMINAL_JOB_STATES = ("SUCCEEDED", "FAILED", "STOPPED")


@dataclass
class JobInfo:
    job_id: str
    status: str
    entrypoint: str
    start_time: float | None
    message: str | None = None
    end_time: float | None = None
    metadata: dict[str, str] = field(default_factory=dict)  # Pylon's jobs: pylon_kind, pylon_name, ...

    @property
    def kind(self) -> str | None:
        """What Pylon submitted it as (TrainJob, Dataset, BatchJob), or None for any other job."""
        return self.metadata.get("pylon_kind")


LOG_TAIL_LINES = 30


def follow_logs(
    client: Client,
    job_id: str,
    *,
    out=None,
    poll_s: float = 1.0,
    progress: bool = False,
    total_steps: int | None = None,
) -> str:
    """Write a job's logs to `out` (default: stdout) as they grow, until it ends; returns its final status.
    With `progress`, a training job's step records (`{"step": N, "loss": ...}` lines) also move a progress
    bar on stderr, shown only on a terminal (`total_steps` gives it an end)."""
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(
            total=total_steps, unit="step", desc=job_id, file=sys.stderr, dynamic_ncols=True, disable=None
        )  # None: off when stderr is not a terminal (scripts, CI, notebooks' pipes)
        if bar.disable:
            bar = None
    shown = 0
    try:
        while True:
            status = client.job_status(job_id)  # before the logs: once it has ended, the logs read next are whole
            logs = client.job_logs(job_id)
            if len(logs) > shown:
                stream = out or sys.stdout  # looked up each time: a notebook swaps sys.stdout per cell
                new = logs[shown:]
                if bar is None:
                    stream.write(new)
                    stream.flush()
                else:
                    _advance(bar, new)
                    bar.write(new.rstrip("\n"), file=stream)  # clears the bar, prints, redraws it
                shown = len(logs)
            if status in TERMINAL_JOB_STATES:
                return status
            time.sleep(poll_s)
    finally:
        if bar is not None:
            bar.close()


def _advance(bar, text: str) -> None:
    """Move `bar` to the last step record in `text` (the train job prints one every few steps)."""
    for line in text.splitlines():
        if line.startswith('{"step": '):
            try:
                record = json.loads(line)
            except ValueError:
                continue
            bar.n = int(record.get("step", bar.n))
            bar.set_postfix(
                loss=f"{record.get('loss', float('nan')):.4f}",
                tok_s=f"{record.get('tokens_per_s', 0):,.0f}",
                refresh=False,
            )
    bar.refresh()


class _LiveLine:
    """One line of progress that updates in place: a display in Jupyter (`update_display`), a tqdm bar on a
    terminal, nothing but the final line elsewhere (scripts, CI)."""

    def __init__(self, label: str, *, total: int | None):
        self.label, self.total = label, total
        self.step, self.loss, self.tokens_per_s, self.extra = 0, None, None, ""
        self.started = time.monotonic()
        self._handle = self._bar = None
        if _in_jupyter():
            from IPython.display import HTML, display

            self._handle = display(HTML(self._html("PENDING")), display_id=True)
        else:
            from tqdm import tqdm

            self._bar = tqdm(total=total, unit="step", desc=label, file=sys.stderr, dynamic_ncols=True, disable=None)

    def record(self, record: dict) -> None:
        self.step = int(record.get("step", self.step))
        self.loss = record.get("loss", self.loss)
        self.tokens_per_s = record.get("tokens_per_s", self.tokens_per_s)

    def note(self, text: str) -> None:
        self.extra = text

    def text(self, status: str) -> str:
        parts = [f"{self.label}: {status}", f"step {self.step}" + (f"/{self.total}" if self.total else "")]
        if self.loss is not None:
            parts.append(f"loss {self.loss:.4f}")
        if self.tokens_per_s:
            parts.append(f"{self.tokens_per_s:,.0f} tokens/s")
        parts.append(f"{time.monotonic() - self.started:.0f} s")
        return " · ".join(parts) + (f" ({self.extra})" if self.extra else "")

    def _html(self, status: str) -> str:
        done = self.step / self.total if self.total else 0.0
        return (
            f'<div class="pylon-progress"><progress value="{done:.3f}" max="1" style="width:16em"></progress> '
            f"<code>{html.escape(self.text(status))}</code></div>"
        )

    def show(self, status: str) -> None:
        self.status = status
        if self._handle is not None:
            from IPython.display import HTML

            self._handle.update(HTML(self._html(status)))
        elif self._bar is not None and not self._bar.disable:
            self._bar.n = self.step
            self._bar.set_postfix_str(self.text(status).split(": ", 1)[1], refresh=True)

    def close(self) -> None:
        if self._bar is not None:
            disabled = self._bar.disable
            self._bar.close()
            if disabled:  # not a terminal: say where it ended, once
                print(self.text(getattr(self, "status", "?")), file=sys.stderr)


def _in_jupyter() -> bool:
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and getattr(shell, "kernel", None) is not None


def _tail(text: str, lines: int = LOG_TAIL_LINES) -> str:
    return "\n".join(text.rstrip().splitlines()[-lines:])


def _when(ts: float | None) -> str | None:
    return datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M:%S") if ts else None


class Job:
    """A Ray job on the cluster, by its submission id."""

    def __init__(self, client: Client, job_id: str, *, name: str | None = None, start_time: float | None = None):
        self._client = client
        self.job_id = job_id
        self.name = name or job_id
        self.start_time = start_time

    @classmethod
    def from_info(cls, client: Client, info: JobInfo) -> Job:
        return cls(client, info.job_id, name=info.metadata.get("pylon_name"), start_time=info.start_time)

    def status(self) -> str:
        """The Ray job status: PENDING, RUNNING, SUCCEEDED, FAILED or STOPPED."""
        return self._client.job_status(self.job_id)

    def logs(self, follow: bool = False) -> str | None:
        """The job's logs so far; with `follow`, written to stdout as they come until the job ends (and
        None returned, so a notebook does not show them twice; `wait()` gives the final status)."""
        if follow:
            follow_logs(self._client, self.job_id)
            return None
        return self._client.job_logs(self.job_id)

    def wait(self, timeout: float | None = None, *, check: bool = True) -> str:
        """Block until the job ends and return its final status. A FAILED job raises JobFailedError, whose
        message ends with the last lines of its logs (a notebook's next cell should not run on a failed
        run); `check=False` returns "FAILED" instead. STOPPED (someone stopped it) is returned, not raised.
        `timeout` in seconds (None: no limit) ends in ClusterError."""
        status = self._client.wait_job(self.job_id, timeout_s=math.inf if timeout is None else timeout)
        if check and status == "FAILED":
            message = self._client.job_info(self.job_id).message
            raise JobFailedError(self.job_id, status, _tail(self._client.job_logs(self.job_id)), message)
        return status

    def stop(self, timeout: float = 60.0) -> str:
        """Stop the job (SIGTERM, then SIGKILL) and wait for it to end; returns its final status."""
        self._client.stop_job(self.job_id)
        return self._client.wait_job(self.job_id, timeout_s=timeout, poll_s=0.5)

    # -- display ----------------------------------------------------------------------------------------

    def _status_or_unknown(self) -> str:
        try:
            return self.status()
        except Exception:  # a repr must not raise: the cluster may be gone
            return "unknown"

    def _fields(self) -> list[tuple[str, Any]]:
        return [("name", self.name), ("job_id", self.job_id), ("status", self._status_or_unknown())]

    def _rows(self) -> list[tuple[str, Any]]:
        return [
            *self._fields(),
            ("started", _when(self.start_time)),
            ("dashboard", f"{self._client.dashboard_url}/#/jobs/{self.job_id}"),
        ]

    def __repr__(self) -> str:
        return f"{type(self).__name__}(" + ", ".join(f"{k}={v!r}" for k, v in self._fields()) + ")"

    def _repr_html_(self) -> str:

        return html_table(f"{type(self).__name__} '{self.name}'", self._rows())


class Run(Job):
    """A training run: its Ray job and its run directory (`<checkpoint.storage>/<name>`)."""

    def __init__(
        self,
        client: Client,
        job_id: str,
        *,
        name: str | None,
        run_uri: str | None,
        start_time: float | None = None,
        steps: int | None = None,
    ):
        super().__init__(client, job_id, name=name, start_time=start_time)
        self.run_uri = run_uri
        self.steps = steps

    @classmethod
    def from_info(cls, client: Client, info: JobInfo) -> Run:
        steps = info.metadata.get("pylon_steps")
        return cls(
            client,
            info.job_id,
            name=info.metadata.get("pylon_name"),
            run_uri=info.metadata.get("pylon_run_uri"),
            start_time=info.start_time,
            steps=int(steps) if steps and steps.isdigit() else None,
        )

    def _uri(self) -> str:
        if not self.run_uri:
            raise PylonError(
                f"job {self.job_id}: its run directory is unknown (it was not submitted by "
                "`pylon train` or `client.train`)"
            )
        return self.run_uri

    def watch(self, *, poll_s: float = 2.0, timeout: float | None = None) -> str:
        """Follow the run until its job ends, with a live display of where it is: in Jupyter one line that
        updates in place (status, step of steps, loss, tokens/s, elapsed), elsewhere a progress bar on stderr.
        Returns the final status (the logs stay with `logs()`)."""
        display = _LiveLine(f"run '{self.name or self.job_id}'", total=self.steps)
        deadline = None if timeout is None else time.monotonic() + timeout
        seen = 0
        try:
            while True:
                status = self._client.job_status(self.job_id)
                logs = self._client.job_logs(self.job_id)
                for line in logs[seen:].splitlines():
                    if line.startswith('{"step": '):
                        with contextlib.suppress(ValueError):
                            display.record(json.loads(line))
                    elif line.startswith("resumed "):
                        display.note(line.strip())
                    elif "evaluation at step " in line:  # rank 0's held-out loss, behind a worker's log prefix
                        display.note(line[line.index("evaluation at step ") :].strip())
                seen = len(logs)
                display.show(status)
                if status in TERMINAL_JOB_STATES:
                    return status
                if deadline is not None and time.monotonic() > deadline:
                    raise PylonError(f"run '{self.name}' still {status} after {timeout:.0f} s")
                time.sleep(poll_s)
        finally:
            display.close()

    def metrics(self):
        """Rank 0's per-step records (`metrics.jsonl`) as a pandas DataFrame: step, loss, lr, tokens,
        tokens_per_s, step_time_s, data_wait_fraction, mfu, peak_memory_bytes, ... (no rows before the
        first checkpoint: records are committed with checkpoints)."""
        import pandas as pd

        return pd.DataFrame(read_metrics(self._uri()))

    def evaluations(self):
        """The held-out evaluations (`"kind": "eval"` records of `metrics.jsonl`; with `data.validation_fraction`
        > 0, at the end and every `eval.every_steps` steps) as a pandas DataFrame: step, val_loss,
        val_perplexity, val_tokens, val_sequences, ... (the last is also the export's `eval.json`)."""
        import pandas as pd

        return pd.DataFrame(read_metrics(self._uri(), kind="eval"))

    def completions(self):
        """Objective grpo's and rloo's sampled completions (`completions.jsonl`: `grpo.log_completions` a step, TRL's
        completions table) as a pandas DataFrame: step, prompt, completion, answer, rewards (each function's
        score), reward, advantage, tokens, ended (with its eos); committed with checkpoints, as metrics are."""
        import pandas as pd

        return pd.DataFrame(read_completions(self._uri()))

    def plot(self):
        """The loss curve as a matplotlib Figure (Jupyter draws it inline; `.savefig(path)` keeps it), with the
        validation loss beside it when the run evaluates on held-out data."""

        records = read_metrics(self._uri())
        if not records:
            raise PylonError(
                f"run '{self.name}' has no metrics yet at {self.run_uri} (they are written with each checkpoint)"
            )
        return loss_figure(records, title=self.name, evals=read_metrics(self._uri(), kind="eval"))

    def checkpoints(self) -> list[int]:
        """The steps of the run's committed checkpoints, oldest first (what a resume or export can use)."""
        from pylon.jobs.checkpoint import list_committed

        return [c.step for c in list_committed(self._uri())]

    def export(self, out: str, *, lora: str | None = None, step: int | None = None) -> str:
        """Export the latest (or `step`'s) committed checkpoint as one Hugging Face model at `out`, here in
        this process (as `pylon export`); returns `out`. The job itself exports to `<run_uri>/export`."""
        from pylon.jobs.export import export_run

        return export_run(self._uri(), out, step=step, lora=lora)

    def cost(self, *, prices: str | None = None) -> dict:
        """The run's ledger, as `pylon cost RUN --json` prints it: accelerator_hours, cpu_hours, bytes_read,
        bytes_written (and by kind), egress_bytes, cost_usd, goodput (wall time by part, and its productive
        fraction) and the planner's `predicted` figures; current while the run trains (docs/operating.md)."""
        from pylon.jobs.ledger import report

        return report(self._uri(), prices=prices)

    def _fields(self) -> list[tuple[str, Any]]:
        return [*super()._fields(), ("run_uri", self.run_uri)]

    def _rows(self) -> list[tuple[str, Any]]:
        rows = super()._rows()
        try:
            records = read_metrics(self.run_uri, kind=None) if self.run_uri else []
        except Exception:
            records = []
        steps = [r for r in records if r.get("kind", "train") == "train"]
        evals = [r for r in records if r.get("kind") == "eval"]
        if steps:
            last = steps[-1]
            rows.append(
                ("last step", f"{last['step']}: loss {last['loss']:.4f}, {last.get('tokens_per_s', 0):,.0f} tokens/s")
            )
        if evals:
            rows.append(("validation", eval_line(evals[-1]).removeprefix("evaluation at ")))
        return rows


class OutputJob(Job):
    """A job that writes to an output URI (its submission's `pylon_output`)."""

    def __init__(
        self, client: Client, job_id: str, *, name: str | None, output: str | None, start_time: float | None = None
    ):
        super().__init__(client, job_id, name=name, start_time=start_time)
        self.output = output

    @classmethod
    def from_info(cls, client: Client, info: JobInfo):
        return cls(
            client,
            info.job_id,
            name=info.metadata.get("pylon_name"),
            output=info.metadata.get("pylon_output"),
            start_time=info.start_time,
        )

    def _fields(self) -> list[tuple[str, Any]]:
        return [*super()._fields(), ("output", self.output)]


class DataJob(OutputJob):
    """A `pylon data prepare` job and the dataset it writes."""

    def manifest(self):
        """The prepared dataset's committed manifest (`ShardManifest`: shards, rows, tokens, tokenizer)."""
        from pylon.data.shards import read_manifest

        return read_manifest(self.output)


class BatchRun(OutputJob):
    """A `pylon batch` job (offline batch inference) and the answers it writes at its output."""

    def manifest(self) -> dict:
        """The job's `_batch.json`: its state (running, done), input, parts and counts (lines answered and failed,
        prompt and generated tokens)."""
        from pylon import storage
        from pylon.serving.api.batch import MANIFEST

        return storage.read_json(storage.join(self.output, MANIFEST))

    def results(self) -> Iterator[dict]:
        """The answered lines, part after part, each in input order (the Batch API's output lines, or the records
        with their replies under `output_format: conversations`)."""
        from pylon.serving.api.batch import RESULTS

        return self._lines(RESULTS)

    def errors(self) -> Iterator[dict]:
        """The lines refused or failed, each with its custom_id (or file:line) and error."""
        from pylon.serving.api.batch import ERRORS

        return self._lines(ERRORS)

    def _lines(self, sub: str) -> Iterator[dict]:
        from pylon import storage

        where = storage.join(self.output, sub)
        for name in storage.listdir(where):
            for line in storage.read_text(storage.join(where, name)).splitlines():
                if line.strip():
                    yield json.loads(line)


class Service:
    """A model served on Ray Serve behind OpenAI-compatible HTTP: `complete`, `chat`, and its state."""

    def __init__(self, client: Client, name: str, url: str, *, api_key: str | None = None, timeout_s: float = 300.0):
        self._client = client
        self.name = name
        self.url = url
        self.timeout_s = timeout_s
        self._api_key = api_key  # memory only: never in a repr, a log or a file

    # -- state, from Serve's REST API -------------------------------------------------------------------

    def _app(self) -> dict | None:
        return self._client.serve_applications().get("applications", {}).get(self.name)

    def status(self) -> str:
        """Serve's application status (as `ray.serve.status()` has it): DEPLOYING, RUNNING, UNHEALTHY,
        DEPLOY_FAILED, DELETING; NOT_FOUND once it is gone."""
        app = self._app()
        return str(app.get("status")) if app else "NOT_FOUND"

    def replicas(self) -> int:
        """How many replicas are RUNNING."""
        app = self._app() or {}
        return sum(
            1 for d in app.get("deployments", {}).values() for r in d.get("replicas", []) if r.get("state") == "RUNNING"
        )

    def cost(self, *, prices: str | None = None) -> dict:
        """The deployment's ledger, as `pylon cost NAME --deployment --json` prints it: replica_hours, cpu_hours,
        accelerator_hours, tokens_in, tokens_out, idle_fraction, cost_usd, cost_per_million_output_tokens_usd and
        `predicted`. Read from the replicas' records under $PYLON_LEDGER_URI (else this machine's Pylon home)."""
        from pylon.serving.api.ledger import report

        return report(self.name, prices=prices)

    def delete(self, timeout: float = 60.0) -> None:
        """Remove the application from Serve and wait until Serve no longer lists it (its replicas stop)."""

        delete(self.name, address=self._client._where)
        # serve.delete returns once the controller let go of the app; its REST view may trail by a moment.
        deadline = time.monotonic() + timeout
        while self._app() is not None:
            if time.monotonic() > deadline:
                raise PylonError(
                    f"service '{self.name}' is still listed by Serve {timeout:.0f} s after deleting it "
                    f"(status {self.status()})"
                )
            time.sleep(0.5)

    # -- requests ---------------------------------------------------------------------------------------

    def complete(
        self, prompt: str, *, max_tokens: int = 64, temperature: float | None = None, stream: bool = False, **params
    ) -> str | list[str] | Iterator[str]:
        """`POST /v1/completions`: the continuation of `prompt` as text, or with `stream` an iterator of
        text pieces as they are generated. `params`: any of the API's (docs/http.md): top_p, top_k, min_p, seed,
        stop, stop_token_ids, ignore_eos, min_tokens, presence_penalty, frequency_penalty, repetition_penalty,
        logit_bias, n (n > 1: a list of n continuations, not streamed). `temperature` None is the server's default
        (1.0); 0 is greedy."""
        body = self._body(max_tokens, temperature, params, prompt=prompt)
        if stream:
            _one_choice(params)
            return self._stream("/v1/completions", body, lambda choice: choice.get("text"))
        choices = self._post("/v1/completions", body).json()["choices"]
        return [c["text"] for c in choices] if params.get("n", 1) != 1 else choices[0]["text"]

    def chat(
        self,
        messages: str | list[dict],
        *,
        max_tokens: int | None = 64,
        temperature: float | None = None,
        stream: bool = False,
        **params,
    ) -> str | Iterator[str]:
        """`POST /v1/chat/completions`: the assistant's reply to `messages` (a list of {role, content}, or
        one user message as a string), or with `stream` an iterator of its text pieces. `params` as `complete`'s
        (n > 1: a list of n replies, not streamed)."""
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        body = self._body(max_tokens, temperature, params, messages=list(messages))
        if stream:
            _one_choice(params)
            return self._stream("/v1/chat/completions", body, lambda choice: choice.get("delta", {}).get("content"))
        choices = self._post("/v1/chat/completions", body).json()["choices"]
        return (
            [c["message"]["content"] for c in choices] if params.get("n", 1) != 1 else choices[0]["message"]["content"]
        )

    def embed(self, texts: str | list[str], *, dimensions: int | None = None) -> list[float] | list[list[float]]:
        """`POST /v1/embeddings`: the vector of `texts` (one text), or one vector per text in order: each the text's
        last-token final hidden state, L2-normalised; `dimensions`: the first that many values, normalised again
        (docs/http.md, "Embeddings")."""
        body: dict = {"model": self.name, "input": texts, "encoding_format": "float"}
        if dimensions is not None:
            body["dimensions"] = int(dimensions)
        data = sorted(self._post("/v1/embeddings", body).json()["data"], key=lambda d: d["index"])
        vectors = [d["embedding"] for d in data]
        return vectors[0] if isinstance(texts, str) else vectors

    def classify(self, inputs: str | list[str] | list[dict], *, raw: bool = False) -> dict | list[dict]:
        """`POST /classify` of a classifier (a reward model, a cross-encoder: docs/http.md, "Classifiers"): for one
        text, its {"label", "probs"}; for a list of texts, one each in order; for a chat (a list of {role, content}),
        its conversation's. `raw`: the logits instead of probabilities (a reward model's reward)."""
        chat = isinstance(inputs, list) and bool(inputs) and all(isinstance(m, dict) for m in inputs)
        body: dict = {"model": self.name, "messages" if chat else "input": inputs, "use_activation": not raw}
        data = sorted(self._post("/classify", body).json()["data"], key=lambda d: d["index"])
        results = [{"label": d["label"], "probs": d["probs"]} for d in data]
        return results if isinstance(inputs, list) and not chat else results[0]

    def score(self, first: str | list[str], second: str | list[str]) -> float | list[float]:
        """`POST /v1/score`: the score of the pair (`first`, `second`), or of `first` (one text) against each text of
        `second`, or of two lists pair by pair: a cross-encoder's, or the cosine of an embedding model's vectors."""
        data = self._post("/v1/score", {"model": self.name, "text_1": first, "text_2": second}).json()["data"]
        scores = [d["score"] for d in sorted(data, key=lambda d: d["index"])]
        return scores if isinstance(second, list) else scores[0]

    def rerank(self, query: str, documents: list[str], *, top_n: int | None = None) -> list[tuple[int, float]]:
        """`POST /v1/rerank`: (index in `documents`, relevance score) by relevance, the best first (`top_n` of
        them)."""
        body: dict = {"model": self.name, "query": query, "documents": list(documents), "return_documents": False}
        if top_n is not None:
            body["top_n"] = int(top_n)
        return [(r["index"], r["relevance_score"]) for r in self._post("/v1/rerank", body).json()["results"]]

    def _body(self, max_tokens, temperature, params: dict, **fields) -> dict:
        body = {"model": self.name, **fields, **params}
        if max_tokens is not None:
            body["max_tokens"] = int(max_tokens)
        if temperature is not None:
            body["temperature"] = float(temperature)  # the API is strict: 0 is not a float there
        return body

    def _post(self, path: str, body: dict, *, stream: bool = False):
        import requests

        headers = {"Authorization": f"Bearer {self._api_key}"} if self._api_key else {}
        try:
            r = requests.post(f"{self.url}{path}", json=body, headers=headers, stream=stream, timeout=self.timeout_s)
        except requests.RequestException as e:
            raise PylonError(f"service '{self.name}': no answer from {self.url}{path} ({type(e).__name__})") from None
        if r.status_code != 200:
            try:
                message = r.json()["error"]["message"]
            except Exception:
                message = r.text[:500]
            hint = ""
            if r.status_code == 401:
                hint = (
                    " (this Service has no API key: pass api_key= to client.service() or client.services())"
                    if not self._api_key
                    else " (the API key was refused)"
                )
            r.close()
            raise PylonError(f"service '{self.name}': {path} answered HTTP {r.status_code}: {message}{hint}")
        return r

    def _stream(self, path: str, body: dict, text_of) -> Iterator[str]:
        # The request is made now, so a refused one raises here rather than at the first next().
        response = self._post(path, {**body, "stream": True}, stream=True)

        def pieces() -> Iterator[str]:
            with response:
                for raw in response.iter_lines():
                    line = raw.decode("utf-8")  # per line: a UTF-8 character never spans a newline
                    if not line.startswith("data: "):
                        continue
                    if line == "data: [DONE]":
                        return
                    event = json.loads(line[len("data: ") :])
                    if "error" in event:
                        raise PylonError(f"service '{self.name}': {event['error'].get('message', event['error'])}")
                    for choice in event.get("choices", []):
                        if text := text_of(choice):
                            yield text

        return pieces()

    # -- display ----------------------------------------------------------------------------------------

    def _status_or_unknown(self) -> str:
        try:
            return self.status()
        except Exception:  # a repr must not raise: the cluster may be gone
            return "unknown"

    def __repr__(self) -> str:  # the API key never appears here
        return f"Service(name={self.name!r}, url={self.url!r}, status={self._status_or_unknown()!r})"

    def _repr_html_(self) -> str:

        try:
            replicas = self.replicas()
        except Exception:
            replicas = "unknown"
        return html_table(
            f"Service '{self.name}'",
            [
                ("name", self.name),
                ("url", self.url),
                ("OpenAI base_url", f"{self.url}/v1"),
                ("status", self._status_or_unknown()),
                ("running replicas", replicas),
                ("API key", "set" if self._api_key else "none"),
            ],
        )


def _one_choice(params: dict) -> None:
    """A stream of text pieces is one choice's: n > 1 is not streamed here."""
    if params.get("n", 1) != 1:
        raise PylonError(f"stream=True streams one choice; with n={params['n']} leave stream off (a list comes back)")
