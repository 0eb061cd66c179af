"""`pylon batch`: offline batch inference. Every request of a JSONL input answered by Pylon's serving engine on the
cluster's workers, the answers written to object storage (`BatchJobSpec`).

What it matches: vLLM's `run_batch` (an OpenAI Batch API file in, its output file out, one process) and Ray Data
LLM's processors (a dataset's rows through engines on an actor pool). What it adds: each engine answers through the
replica's own request handling (`PylonLLMServer`, called in-process, no HTTP), so a batch line means exactly what
the same body POSTed to a Deployment means, chat templates, tools, structured outputs, reasoning, embeddings and
errors included; the input is read in parts whose answers are committed whole, so a stopped job submitted again
goes on from the parts done; and a record with `messages` or `prompt` (a dataset `pylon data prepare` takes) is a
request too, answered, if asked, as the same record with the model's reply (`output_format: conversations`): the
data a model's own replies make, to train a drafting head on (objective eagle3) or to distil.

Layout of `output`: `results/part-NNNNN.jsonl` (answered lines, in input order), `errors/part-NNNNN.jsonl` (lines
refused or failed: OpenAI's error file, each naming its file, line and field), `stats/part-NNNNN.json` (a part's
counts), `attempts/part-NNNNN.json` (where an engine died answering a part: how often), `_batch.json` (what the job
is, its counts and tokens, each submission's; `state` running or done). A part's errors and counts are written
before its results: a results part is the mark that the part is done. An engine that dies takes its actor with it
(Ray Data restarts it and hands it its parts again), and a part an engine died on `MAX_ATTEMPTS` times is committed
with its unanswered lines as errors, so that one line that kills engines cannot hold the job forever.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from pylon import home, settings, storage
from pylon.errors import PylonError, SpecError
from pylon.serving.api.batch_lines import (  # noqa: F401 (CHAT, COMPLETIONS: this module's too)
    CHAT,
    COMPLETIONS,
    LineError,
    Request,
    call,
    error_line,
    openai_line,
    request_of,
)
from pylon.specs import BatchJobSpec, load_spec

log = logging.getLogger("pylon.batch")

PARQUET = ".parquet"  # an input file of records in rows; any other: JSONL
RESULTS, ERRORS, STATS, ATTEMPTS, MANIFEST = "results", "errors", "stats", "attempts", "_batch.json"
MAX_ATTEMPTS = 3  # times a part is answered on an engine that dies before its lines left unanswered are errors
COUNTS = ("lines", "answered", "failed", "tokens_in", "tokens_out")


# -- the input: files, parts, lines ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Part:
    """Lines [start, stop) of one input file (0-based), answered together and committed whole."""

    index: int
    file: str  # its URI
    name: str  # as errors name it: the file's name
    start: int
    stop: int
    offset: int  # the byte where line `start` begins

    def results(self, output: str) -> str:
        return storage.join(output, RESULTS, f"part-{self.index:05d}.jsonl")

    def errors(self, output: str) -> str:
        return storage.join(output, ERRORS, f"part-{self.index:05d}.jsonl")

    def stats(self, output: str) -> str:
        return storage.join(output, STATS, f"part-{self.index:05d}.json")

    def attempts(self, output: str) -> str:
        return storage.join(output, ATTEMPTS, f"part-{self.index:05d}.json")


def input_files(uri: str) -> list[str]:
    """`input`'s files: itself, or the `.jsonl` and `.parquet` files directly in the directory it names, in name
    order."""
    if not storage.exists(uri):
        raise PylonError(f"input: {uri} does not exist")
    fs, path = storage.resolve(uri)
    if not fs.isdir(path):
        return [uri]
    files = [storage.join(uri, n) for n in storage.listdir(uri) if n.endswith((".jsonl", PARQUET))]
    if not files:
        raise PylonError(f"input: {uri} is a directory with no .jsonl or .parquet files in it")
    return files


def _parquet(uri: str):
    """A Parquet file's reader (pyarrow), through the storage layer's filesystem."""
    import pyarrow.parquet as pq

    fs, path = storage.resolve(uri)
    try:
        return pq.ParquetFile(fs.open(path, "rb"))
    except Exception as e:  # (pyarrow's ArrowInvalid and its kin: not a Parquet file)
        raise PylonError(f"input: {uri}: not a readable Parquet file ({e})") from None


def _parquet_rows(uri: str, start: int, stop: int) -> list[dict]:
    """Rows [start, stop) of a Parquet file as records, reading only the row groups that hold them."""
    reader = _parquet(uri)
    rows, first = [], 0
    for group in range(reader.num_row_groups):
        count = reader.metadata.row_group(group).num_rows
        if first + count > start and first < stop:
            table = reader.read_row_group(group)
            rows += table.slice(max(start - first, 0), min(stop, first + count) - max(start, first)).to_pylist()
        first += count
        if first >= stop:
            break
    return rows


def _raw_lines(uri: str, offset: int = 0):
    """The lines of one input file from byte `offset`, as bytes with their line ends."""
    fs, path = storage.resolve(uri)
    with fs.open(path, "rb") as f:
        f.seek(offset)
        yield from f


def plan_parts(files: list[str], chunk_lines: int, *, progress: bool = False) -> tuple[list[Part], list[dict]]:
    """The parts of `files` and each file's {file, lines, bytes}. Reads every line once (a bar of bytes with
    `progress`): custom_ids must be unique across the input (OpenAI's Batch API refuses a file where they are not),
    else a PylonError naming both lines."""
    from tqdm import tqdm

    parts, listing, seen, done = [], [], {}, 0
    sizes = {uri: _size(uri) for uri in files} if progress else {}
    bar = tqdm(
        total=sum(sizes.values()),
        unit="B",
        unit_scale=True,
        desc="reading the input",
        file=sys.stderr,
        disable=not progress,
        mininterval=5,
    )
    for uri in files:
        name = uri.rstrip("/").rsplit("/", 1)[-1]
        if uri.endswith(PARQUET):  # rows: counted from the file's footer, custom_ids read as one column
            reader = _parquet(uri)
            count, size = reader.metadata.num_rows, sizes.get(uri) or _size(uri)
            ids = (
                reader.read(columns=["custom_id"]).column(0).to_pylist()
                if "custom_id" in reader.schema_arrow.names
                else []
            )
            for row, custom_id in enumerate(ids, 1):
                if isinstance(custom_id, str):
                    _unique(custom_id, f"{name}:{row}", seen)
            listing.append({"file": name, "lines": count, "bytes": size})
            done += size
            bar.update(done - bar.n)
            for start in range(0, count, chunk_lines):
                parts.append(Part(len(parts), uri, name, start, min(count, start + chunk_lines), 0))
            continue
        starts, size, count = [], 0, 0
        for raw in _raw_lines(uri):
            if count % chunk_lines == 0:
                starts.append(size)
                bar.update(done + size - bar.n)
            count, size = count + 1, size + len(raw)
            if b'"custom_id"' not in raw:
                continue
            try:
                custom_id = json.loads(raw).get("custom_id")
            except (ValueError, AttributeError):
                continue  # answered as an error line of its own
            if isinstance(custom_id, str):
                _unique(custom_id, f"{name}:{count}", seen)
        listing.append({"file": name, "lines": count, "bytes": size})
        done += size
        bar.update(done - bar.n)
        for k, offset in enumerate(starts):
            start = k * chunk_lines
            parts.append(Part(len(parts), uri, name, start, min(count, start + chunk_lines), offset))
    bar.close()
    return parts, listing


def _size(uri: str) -> int:
    fs, path = storage.resolve(uri)
    return fs.size(path)


def _unique(custom_id: str, where: str, seen: dict[str, str]) -> None:
    if custom_id in seen:
        raise PylonError(
            f"input: {where}: custom_id {custom_id!r} is also {seen[custom_id]}'s; each request's custom_id must be "
            "unique, so that its answer can be told apart"
        )
    seen[custom_id] = where


def part_lines(part: Part) -> list[tuple[int, str | dict]]:
    """A part's lines that are not blank, with their line numbers (1-based); a Parquet file's rows, as records."""
    if part.file.endswith(PARQUET):
        return list(enumerate(_parquet_rows(part.file, part.start, part.stop), part.start + 1))
    lines = []
    for lineno, raw in enumerate(_raw_lines(part.file, part.offset), part.start + 1):
        if lineno > part.stop:
            break
        line = raw.decode("utf-8", errors="replace").rstrip("\r\n")
        if line.strip():
            lines.append((lineno, line))
    return lines


# -- one line as a request ------------------------------------------------------------------------------------------


def check_defaults(spec: BatchJobSpec) -> None:
    """The spec's `body` read as each endpoint's request reads it, before any engine starts: a field a request
    does not take is a SpecError naming `body.<field>`, not an error on every line."""
    from pylon.serving.api import protocol
    from pylon.serving.errors import InvalidRequest

    probes = (
        (protocol.ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}]}),
        (protocol.CompletionRequest, {"prompt": "x"}),
    )
    failures = []
    for cls, minimal in probes:
        try:
            protocol.parse_request(cls, json.dumps({"model": spec.name, **spec.body, **minimal}).encode())
            return  # one endpoint takes them: lines meant for it are answered
        except InvalidRequest as e:
            failures.append(e)
    e = failures[0]
    field = f"body.{e.param}" if getattr(e, "param", None) else "body"
    raise SpecError([f"BatchJob '{spec.name}': {field}: {e}"])


# -- answers --------------------------------------------------------------------------------------------------------


def conversations(request: Request, answer: dict) -> list[dict]:
    """`output_format: conversations`: the record (or Batch API line's request) with each choice's reply, as `pylon
    data prepare` reads records: a chat's messages with the assistant's reply appended; a completion's prompt with
    its `completion`."""
    base = dict(request.record) if request.record is not None else {"custom_id": request.custom_id}
    out = []
    for choice in answer.get("choices", []):
        if "message" in choice:
            message = {k: v for k, v in choice["message"].items() if v is not None and k != "refusal"}
            record = {k: v for k, v in base.items() if k != "prompt"}
            record["messages"] = [*request.body["messages"], message]
        else:
            record = {**base, "prompt": request.body.get("prompt"), "completion": choice.get("text", "")}
        out.append(record)
    return out


# -- an engine on the cluster ---------------------------------------------------------------------------------------


class EngineDied(PylonError):
    """The engine died while it answered a part: the part is not committed, and is answered again."""


PARTS_AT_ONCE = 2  # parts an engine answers at once: the next one's lines fill the batch as the last one's end


class PartAnswerer:
    """One engine of the job (a Ray Data actor): a `PylonLLMServer` answering the parts it is given, each part's lines
    in flight together (continuous batching) and `PARTS_AT_ONCE` parts at a time, so that the engine's batch stays
    full as a part's last lines end; each part's files committed whole as it ends."""

    def __init__(self, spec: dict):
        from pylon.serving.api.http import OpenAIApp
        from pylon.serving.api.server import PylonLLMServer

        self.spec = BatchJobSpec.model_validate(spec)
        self.server = PylonLLMServer(self.spec.deployment().model_dump(mode="json"))
        self.app = OpenAIApp(self.server)
        engine = self.spec.engine
        # requests in the engine at once, every part's: enough waiting that a finished one's place is filled at the
        # next step, and no more (a part's lines past it wait their turn here, in order)
        self.in_flight = 2 * engine.max_num_seqs * engine.data_parallel
        self._gate: asyncio.Semaphore | None = None
        self._loop: asyncio.AbstractEventLoop | None = None  # answer_parts' own (Ray Data's actor runs __call__'s)
        self.requests = 0
        self.node = _node_id()  # where a part was answered, in its counts' file

    def __del__(self):  # Ray Data drops the pool's callables as the job's dataset ends
        self.close()

    def close(self) -> None:
        """The engine shut down, the replica's gauge task ended (on `answer_parts`' loop, run to its end)."""
        server = getattr(self, "server", None)
        if server is None:
            return
        gauges, loop = server._gauges_task, getattr(self, "_loop", None)
        if gauges is not None and not gauges.done():
            if loop is not None and not loop.is_closed():
                gauges.cancel()
                loop.run_until_complete(asyncio.gather(gauges, return_exceptions=True))
            else:  # on the actor's event loop, which runs in another thread
                try:
                    gauges.get_loop().call_soon_threadsafe(gauges.cancel)
                except RuntimeError:  # that loop has closed: nothing runs the task any more
                    pass
        if loop is not None:
            loop.close()
        server.close()

    async def __call__(self, batch: dict) -> dict:
        parts = [Part(**{k: _plain(batch[k][i]) for k in batch}) for i in range(len(batch["index"]))]
        try:
            rows = await asyncio.gather(*(self.answer(p) for p in parts))
        except EngineDied as e:  # this actor goes with its engine: Ray Data restarts it and hands it its parts again
            log.error("%s; this engine's actor exits to be restarted", e)
            for handler in logging.getLogger().handlers:
                handler.flush()
            os._exit(1)
        return {k: [r[k] for r in rows] for k in rows[0]}

    def answer_parts(self, parts: list[Part], at_once: int = PARTS_AT_ONCE) -> list[dict]:
        """`parts` answered in this thread, `at_once` at a time, as the job's pool answers them (tests, benchmarks)."""
        if self._loop is None:
            self._loop = asyncio.new_event_loop()

        async def all_of() -> list[dict]:
            slots = asyncio.Semaphore(at_once)

            async def one(part: Part) -> dict:
                async with slots:
                    return await self.answer(part)

            return await asyncio.gather(*(one(p) for p in parts))

        return self._loop.run_until_complete(all_of())

    async def answer(self, part: Part) -> dict:
        """Answer `part` and commit its files (its errors and counts, then its results: the mark that it is done);
        nothing when an earlier attempt committed it (an engine restarted mid-job)."""
        output = self.spec.output
        if await asyncio.to_thread(storage.exists, part.results(output)):
            return {"index": part.index, **dict.fromkeys(COUNTS, 0)}
        engine = self.server.engine
        if not engine.check_health():
            raise EngineDied(f"part {part.index}: the engine is not running")
        t0 = time.monotonic()
        results, errors, stats = await self._answer(part)
        if not engine.check_health():  # its lines in flight were answered 503: not what the part's answers are
            attempts = await asyncio.to_thread(_attempts, part.attempts(output)) + 1
            where = f"part {part.index} ({part.name} lines {part.start + 1}-{part.stop})"
            if attempts < MAX_ATTEMPTS:
                await asyncio.to_thread(storage.atomic_write_json, part.attempts(output), {"attempts": attempts})
                raise EngineDied(
                    f"{where}: the engine died while it answered it (attempt {attempts} of {MAX_ATTEMPTS})"
                )
            log.error(
                "%s: the engine died on each of its %d attempts; its lines left unanswered are committed as errors "
                "(status 503)",
                where,
                MAX_ATTEMPTS,
            )

        def commit() -> None:
            storage.atomic_write_text(part.errors(output), "".join(_json_line(e) for e in errors))
            storage.atomic_write_json(part.stats(output), {**stats, "node": self.node})
            storage.atomic_write_text(part.results(output), "".join(_json_line(r) for r in results))

        await asyncio.to_thread(commit)
        log.info(
            "part %d (%s lines %d-%d): %s in %.1f s",
            part.index,
            part.name,
            part.start + 1,
            part.stop,
            stats,
            time.monotonic() - t0,
        )
        return {"index": part.index, **stats}

    async def _answer(self, part: Part) -> tuple[list, list, dict]:
        lines = await asyncio.to_thread(part_lines, part)
        if self._gate is None:
            self._gate = asyncio.Semaphore(self.in_flight)
        gate = self._gate

        async def one(lineno: int, line: str):
            where = f"{part.name}:{lineno}"
            custom_id = None
            try:
                try:
                    obj = json.loads(line) if isinstance(line, str) else line  # (a Parquet row: a record already)
                except ValueError as e:
                    raise LineError(f"{where}: not JSON ({e})") from None
                if isinstance(obj, dict) and isinstance(obj.get("custom_id"), str):
                    custom_id = obj["custom_id"]
                request = request_of(obj, where, self.spec.name, self.spec.body)
            except LineError as e:
                return None, None, error_line(custom_id, where, e)
            async with gate:
                status, body, request_id = await self.ask(request.url, request.body)
            return request, body, openai_line(request.custom_id, status, body, request_id)

        answered = await asyncio.gather(*(one(n, line) for n, line in lines))
        results, errors = [], []
        stats = {"lines": len(lines), "answered": 0, "failed": 0, "tokens_in": 0, "tokens_out": 0}
        for request, body, line in answered:
            ok = line["response"] is not None and line["response"]["status_code"] < 400
            if not ok:
                stats["failed"] += 1
                errors.append(line)
                continue
            stats["answered"] += 1
            usage = body.get("usage") or {}
            stats["tokens_in"] += int(usage.get("prompt_tokens") or usage.get("input_tokens") or 0)
            stats["tokens_out"] += int(usage.get("completion_tokens") or usage.get("output_tokens") or 0)
            if self.spec.output_format == "conversations" and "choices" in body:
                results.extend(conversations(request, body))
            else:
                results.append(line)
        return results, errors, stats

    async def ask(self, path: str, body: dict) -> tuple[int, dict, str]:
        """POST `body` to the replica's own request handling, in this process: (status, JSON answer, request id)."""
        self.requests += 1
        request_id = f"batch-{os.getpid()}-{self.requests}"
        status, answer = await call(self.app, path, body, request_id)
        return status, answer, request_id


def _node_id() -> str:
    """The Ray node this process runs on ("" outside Ray)."""
    import ray

    return ray.get_runtime_context().get_node_id() if ray.is_initialized() else ""


def _attempts(uri: str) -> int:
    """The attempts an engine that died made at a part (0: none recorded)."""
    return int(storage.read_json(uri)["attempts"]) if storage.exists(uri) else 0


def _json_line(obj: dict) -> str:
    return json.dumps(obj, ensure_ascii=False, default=str) + "\n"  # (a Parquet record's dates: as text)


def _plain(value):
    """A Ray Data batch's value (a numpy scalar) as the plain Python value a Part holds."""
    return value.item() if hasattr(value, "item") else value


# -- the job --------------------------------------------------------------------------------------------------------


def _identity(spec: BatchJobSpec, listing: list[dict]) -> dict:
    """What makes two submissions the same job: a rerun with the same identity goes on from the parts written."""
    return {
        "model": spec.model,
        "input": listing,
        "body": spec.body,
        "output_format": spec.output_format,
        "chunk_lines": spec.chunk_lines,
        "engine": spec.engine.model_dump(mode="json"),
    }


def _start(spec: BatchJobSpec, identity: dict, *, overwrite: bool) -> dict | None:
    """Claim `output` for this job: a new directory, or one an earlier submission of the same job left (its
    manifest returned, to go on from); another job's answers are refused unless `overwrite` (then removed)."""
    manifest_uri = storage.join(spec.output, MANIFEST)
    earlier = storage.read_json(manifest_uri) if storage.exists(manifest_uri) else None
    if earlier is not None and overwrite:
        for sub in (RESULTS, ERRORS, STATS, ATTEMPTS):
            if storage.exists(storage.join(spec.output, sub)):
                storage.remove(storage.join(spec.output, sub), recursive=True)
        storage.remove(manifest_uri)
        earlier = None
    if earlier is not None and earlier.get("identity") != identity:
        changed = sorted(k for k in identity if earlier.get("identity", {}).get(k) != identity[k])
        raise PylonError(
            f"output: {spec.output} holds the answers of another batch (it differs in {', '.join(changed)}); "
            "choose another output, or submit with --overwrite to replace them"
        )
    if earlier is None and storage.exists(spec.output) and storage.listdir(spec.output):
        raise PylonError(
            f"output: {spec.output} is not empty and holds no batch's answers; choose another output directory"
        )
    return earlier


def run(spec: BatchJobSpec, *, overwrite: bool = False, progress: bool = True) -> dict:
    """Answer every line of `spec.input` on the connected cluster; returns the job's `_batch.json`."""
    import ray

    from pylon.jobs.run_dir import storage_problems

    working_dir = home.job_working_dir()
    if working_dir is None:  # the actors may start in another directory: relative paths pinned to this one's
        spec = spec.model_copy(update={f: _absolute(getattr(spec, f)) for f in ("model", "input", "output")})
    check_defaults(spec)
    if not ray.is_initialized():
        if os.environ.get("RAY_JOB_ID") or settings.value(settings.RAY_ADDRESS):
            ray.init(log_to_driver=True)
        else:
            home.init_ray(log_to_driver=True)
    nodes = sum(1 for n in ray.nodes() if n.get("Alive"))
    problems = storage_problems(
        {"model": spec.model, "input": spec.input, "output": spec.output}, nodes, working_dir=working_dir
    )
    if problems:
        raise SpecError([f"BatchJob '{spec.name}': {p}" for p in problems])
    t0 = time.time()
    files = input_files(spec.input)
    parts, listing = plan_parts(files, spec.chunk_lines, progress=progress)
    identity = _identity(spec, listing)
    earlier = _start(spec, identity, overwrite=overwrite)
    done = {p.index for p in parts if storage.exists(p.results(spec.output))} if earlier is not None else set()
    todo = [p for p in parts if p.index not in done]
    total_lines = sum(f["lines"] for f in listing)
    manifest = {
        "kind": "BatchJob",
        "name": spec.name,
        "identity": identity,
        "state": "running",
        "parts": len(parts),
        "lines": total_lines,
        "started": t0,
        "runs": [*(earlier or {}).get("runs", []), {"started": t0, "parts": len(todo)}],
    }
    storage.atomic_write_json(storage.join(spec.output, MANIFEST), manifest)
    print(
        f"BatchJob '{spec.name}': {total_lines:,} lines in {len(files)} file(s), {len(parts)} part(s) of up to "
        f"{spec.chunk_lines} lines"
        + (f"; {len(done)} part(s) answered by an earlier submission, going on from them" if done else ""),
        flush=True,
    )
    seqs = spec.engine.max_num_seqs * spec.engine.data_parallel
    if todo and spec.chunk_lines * PARTS_AT_ONCE < seqs:
        print(
            f"note: chunk_lines {spec.chunk_lines}: an engine holds {PARTS_AT_ONCE} parts' lines at a time, fewer than "
            f"the {seqs} sequences it batches (engine.max_num_seqs); parts of {-(-seqs // PARTS_AT_ONCE)} lines or "
            "more keep it full",
            flush=True,
        )
    now = _answer_parts(spec, todo, progress=progress) if todo else dict.fromkeys(COUNTS, 0)
    counts = dict.fromkeys(COUNTS, 0)  # every part's: this submission's and earlier ones'
    nodes = set()
    for part in parts:
        stats = storage.read_json(part.stats(spec.output))
        for k in COUNTS:
            counts[k] += int(stats[k])
        nodes.add(stats.get("node", ""))
    seconds = time.time() - t0
    manifest["runs"][-1].update(seconds=round(seconds, 3), counts=now)
    manifest.update(
        state="done",
        counts=counts,
        nodes=sorted(nodes - {""}),  # the Ray nodes whose engines answered its parts
        ended=time.time(),
        results=storage.join(spec.output, RESULTS),
        errors=storage.join(spec.output, ERRORS),
    )
    storage.atomic_write_json(storage.join(spec.output, MANIFEST), manifest)
    print(
        f"BatchJob '{spec.name}': {counts['answered']:,} answered, {counts['failed']:,} failed (see "
        f"{storage.join(spec.output, ERRORS)}), {counts['tokens_in']:,} prompt and {counts['tokens_out']:,} generated "
        f"tokens; answers in {storage.join(spec.output, RESULTS)}. This submission: {now['lines']:,} lines in "
        f"{seconds:.1f} s, {now['tokens_out'] / max(seconds, 1e-9):,.1f} generated tokens/s",
        flush=True,
    )
    return manifest


def _answer_parts(spec: BatchJobSpec, todo: list[Part], *, progress: bool) -> dict:
    """`todo` through `spec.replicas` engines on a Ray Data actor pool, one part a call, a bar counting lines;
    returns their counts."""
    import ray.data
    from tqdm import tqdm

    from pylon.data.reader import pin_ray_data_helpers_here

    pin_ray_data_helpers_here()
    context = ray.data.DataContext.get_current()
    context.enable_progress_bars = False  # this job's own bar counts lines
    parts = ray.data.from_items([asdict(p) for p in todo], override_num_blocks=len(todo))
    answered = parts.map_batches(
        PartAnswerer,
        fn_constructor_kwargs={"spec": spec.model_dump(mode="json")},
        batch_size=1,
        compute=ray.data.ActorPoolStrategy(
            size=min(spec.replicas, len(todo)),
            max_tasks_in_flight_per_actor=PARTS_AT_ONCE,
            max_concurrent_calls_per_actor=PARTS_AT_ONCE,
        ),
        num_cpus=spec.replica.num_cpus,
        num_gpus=spec.replica.num_gpus,
        **({"label_selector": dict(spec.replica.labels)} if spec.replica.labels else {}),
    )  # (Ray Data restarts a pool's actor that dies, and retries its part: max_restarts, max_task_retries -1)
    lines = {p.index: p.stop - p.start for p in todo}
    counts = dict.fromkeys(COUNTS, 0)
    with tqdm(
        total=sum(lines.values()),
        unit="line",
        desc=f"batch {spec.name}",
        file=sys.stderr,
        disable=not progress,  # (in a job's log too: it is how `pylon jobs logs` shows where a batch is)
        mininterval=5,
    ) as bar:
        for row in answered.iter_rows():
            for key in COUNTS:
                counts[key] += int(row[key])
            bar.update(lines[int(row["index"])])
            bar.set_postfix(answered=counts["answered"], failed=counts["failed"], refresh=False)
    return counts


def _absolute(uri: str) -> str:
    if "://" in uri:
        return uri
    return str(Path(uri).expanduser().resolve())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m pylon.serving.api.batch",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--config", required=True, help="YAML file with one BatchJob document")
    parser.add_argument("--overwrite", action="store_true", help="replace another batch's answers at the output")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    spec = load_spec(args.config, BatchJobSpec)
    manifest = run(spec, overwrite=args.overwrite)
    counts = manifest["counts"]
    return 1 if counts.get("lines", 0) and not counts.get("answered", 0) else 0


if __name__ == "__main__":
    sys.exit(main())
