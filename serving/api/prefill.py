"""Prefill-decode disaggregation across replicas (a deployment's `prefill`; vLLM's disaggregated prefilling, SGLang's
PD disaggregation, Ray Serve LLM's `build_pd_openai_app`, NVIDIA Dynamo's).

A prompt's prefill is one long, compute-bound pass; decoding is many short, memory-bound ones. On one engine a long
prompt's chunks share steps with every sequence being decoded, and each of those steps takes as long as the chunk:
every stream stalls while a long prompt arrives. With `prefill`, a deployment runs replicas of its own for prompts
(`<name>-prefill`, `PylonPrefillServer`, each an engine of the deployment's spec, placed by `prefill.replica`, on
nodes of their own) and its replicas decode:

    client ──HTTP──▶ replica (decodes) ──prompt ids──▶ prefill replica: computes the prompt, one token
                         ▲                                 │
                         └──── its blocks' keys and values ┘ (Ray's object store: across nodes, no copy on one)

The replica that took the request tokenizes it and looks its prompt up in its own engine's prefix cache (as its
engine last reported it). Where at least `prefill.min_prompt_tokens` of the prompt are not there, it asks a prefill
replica for them (`RemotePrefill.blocks`), naming how many leading blocks it already holds; the prefill replica
runs the prompt as a request of one token (its own prefix cache serving what it holds) and returns the blocks its
asker lacks (pylon.serving.engine.kv_transfer). The replica then starts the request on its own engine with the
blocks, which the engine takes into its prefix cache before it schedules the request: it computes only the prompt's
last partial block (at least its last token), and decodes. A chat's next turn sends only its new blocks.

Outputs do not change: the blocks are the keys and values this engine would have computed, and its prefix cache
decides what is used. Where a prefill replica fails, is slow past `prefill.timeout_s` or is of another KV layout, the
replica computes the prompt itself (counted in `pylon_prefill_requests_total{where="failed"}`): a request is never
lost to the split. Prompts with images, an adapter loaded on demand or prompt log-probabilities, and a model with
recurrent layers, are computed where they are decoded.
"""

from __future__ import annotations

import asyncio
import logging
import time

from pylon.errors import PylonError
from pylon.serving.api import routing, slo
from pylon.serving.api.ledger import ReplicaLedger
from pylon.serving.api.replica_engine import accelerator_name, start_engine
from pylon.serving.engine.images import ImagePrompt
from pylon.serving.engine.kv_cache import prompt_prefix
from pylon.serving.engine.sampling import SamplingParams
from pylon.serving.engine.sched_batch import serve_cpu_as_batch
from pylon.serving.errors import EngineDeadError, InvalidRequest
from pylon.specs import DeploymentSpec

log = logging.getLogger("pylon.serving")
_SECONDS = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60]


def prefill_params(params: SamplingParams, first_block: int) -> SamplingParams:
    """What a prefill replica runs for `params`' prompt: one greedy token, the prompt read as the decoding engine
    reads it (special tokens, truncation, the adapter and cache salt its blocks' names start from), its blocks from
    `first_block` on sent back."""
    return SamplingParams(
        max_tokens=1,
        temperature=0,
        add_special_tokens=params.add_special_tokens,
        truncate_prompt_tokens=params.truncate_prompt_tokens,
        truncation_side=params.truncation_side,
        adapter=params.adapter,
        cache_salt=params.cache_salt,
        priority=params.priority,
        kv_export_from=first_block,
    )


class PylonPrefillServer:
    """A prefill replica (`<name>-prefill`): the deployment's engine, computing prompts for its decoding replicas."""

    def __init__(self, spec: dict):
        self.spec = DeploymentSpec.model_validate(spec)
        t0 = time.monotonic()
        self.engine = start_engine(self.spec)
        log.info("prefill replica of %s loaded in %.1f s", self.spec.name, time.monotonic() - t0)
        if self.engine.generation.snapshots:
            self.engine.shutdown()
            raise PylonError(_RECURRENT.format(name=self.spec.name))
        serve_cpu_as_batch(self.engine.device, f"prefill replica of {self.spec.name}")
        # its hours and cost in the deployment's ledger (its prompts apart: pylon.serving.api.ledger)
        self.ledger = ReplicaLedger(
            self.spec.model_dump(mode="json"), accelerator=accelerator_name(self.engine.device), role="prefill"
        )
        self._reporting: asyncio.Task | None = None
        self.latency = slo.LatencyWindow()  # each prompt's time here, for autoscaling on prefill.autoscaling's target

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve's custom autoscaling metrics of this prefill replica (as a decoding replica's: `PylonLLMServer.
        record_autoscaling_stats`): its prompts' time here, from arrival to their blocks being ready, as the time to
        first token it adds."""
        return self.latency.stats()

    def record_routing_stats(self) -> dict:
        """Serve's routing stats of this prefill replica (as a decoding replica's: `PylonLLMServer.
        record_routing_stats`): the hashes of the blocks its engines hold cached and its engines' sequence slots,
        which the decoding replicas' handles route their prompts by (pylon.serving.api.routing)."""
        return routing.replica_stats(self.engine, self.spec)

    def check_health(self) -> None:
        if not self.engine.check_health():
            raise EngineDeadError("the prefill replica's engine is not running")
        if self._reporting is None and self.ledger.due():  # before any prompt: alive all the same
            self.ledger.write()

    def __del__(self):
        ledger = self.__dict__.get("ledger")
        if ledger is not None:
            ledger.write(ended=True)
        engine = self.__dict__.get("engine")
        if engine is not None:
            engine.shutdown()

    async def prefill(self, key, request_id: str, prompt: list[int], params: SamplingParams):
        """Compute `prompt` (token ids) as a request of one token and return its blocks (`KVTransfer`, None where it has
        no full block to send). InvalidRequest for a prompt the engine refuses. `key`: the prompt's RoutingKey, which
        the caller's handle routed the call by (pylon.serving.api.request_router)."""
        self._ensure_metrics()
        started, last = time.monotonic(), None
        async for out in self.engine.generate(request_id, prompt, params):
            last = out
        if last is None:
            return None
        ended = time.monotonic()
        self.latency.add(ended - started)
        self.ledger.finished(last.num_prompt_tokens, 0, started, ended)
        return last.kv_transfer

    def _ensure_metrics(self) -> None:
        if self._reporting is None:
            self._reporting = asyncio.get_running_loop().create_task(self._report())

    async def _report(self) -> None:
        """The engine's counters as Prometheus metrics: blocks and bytes sent, prompt tokens computed."""
        from ray.serve import metrics

        def counter(name, desc):
            c = metrics.Counter(name, description=desc, tag_keys=("model",))
            c.set_default_tags({"model": self.spec.name})
            return c

        counters = {
            "kv_transfer_sent_blocks_total": counter(
                "pylon_kv_transfer_sent_blocks_total", "KV blocks a prefill replica sent to decoding replicas"
            ),
            "kv_transfer_sent_bytes_total": counter(
                "pylon_kv_transfer_sent_bytes_total", "Bytes of KV blocks a prefill replica sent to decoding replicas"
            ),
            "prefill_tokens_computed_total": counter(
                "pylon_prefill_tokens_computed_total", "Prompt tokens the engine computed (not found in a cache)"
            ),
        }
        reported = dict.fromkeys(counters, 0)
        while True:
            stats = self.engine.stats()
            if self.ledger.due():  # storage I/O (object storage, maybe) off the event loop
                await asyncio.to_thread(self.ledger.write)
            for name, metric in counters.items():
                total = getattr(stats, name)
                if total > reported[name]:
                    metric.inc(total - reported[name])
                    reported[name] = total
            await asyncio.sleep(1.0)


_RECURRENT = (
    "prefill: {name}'s model has recurrent layers, whose states no KV block holds, so its prompts cannot be computed "
    "on other replicas; remove `prefill` from the spec"
)


class RemotePrefill:
    """A decoding replica's side: which prompts go to the prefill replicas (`handle`: `<name>-prefill`'s), and the
    blocks they send back."""

    def __init__(self, handle, spec: DeploymentSpec, engine):
        if engine.generation.snapshots:
            raise PylonError(_RECURRENT.format(name=spec.name))
        self.handle, self.spec, self.engine = handle, spec, engine
        self.block_size = spec.engine.block_size
        self._failures = 0
        from ray.serve import metrics

        self.requests = metrics.Counter(
            "pylon_prefill_requests_total",
            description="Prompts by where they were computed: remote (a prefill replica's blocks taken), local "
            "(short of prefill.min_prompt_tokens new tokens, or not eligible), failed (a prefill replica failed or "
            "timed out: computed here)",
            tag_keys=("model", "where"),
        )
        self.requests.set_default_tags({"model": spec.name})
        self.seconds = metrics.Histogram(
            "pylon_prefill_remote_seconds",
            description="Time a request waited for a prefill replica's blocks (part of its time to first token)",
            boundaries=_SECONDS,
            tag_keys=("model",),
        )
        self.seconds.set_default_tags({"model": spec.name})
        # Where more than one prefill replica may run, this replica's handle routes each prompt to the one caching
        # the longest prefix of it (PrefixAffinityRouter, as the ingress routes requests among decoding replicas).
        self.routed = None
        if spec.prefill.replica_range()[1] > 1:
            self.routed = metrics.Counter(
                "pylon_prefill_routed_total",
                description="Prompts sent to prefill replicas by what chose the replica: prefix (the one caching "
                "the longest prefix of the prompt), load (none caches any, or the one that does is busy: the least "
                "loaded)",
                tag_keys=("model", "by"),
            )
            self.routed.set_default_tags({"model": spec.name})

    def _eligible(self, prompt, params: SamplingParams) -> bool:
        return not (
            isinstance(prompt, ImagePrompt)  # (an image's placeholders hash as its contents, and it runs a tower)
            or params.adapter_path is not None  # (loaded on demand from this replica's copy)
            or params.prompt_logprobs is not None  # (their entries come with blocks this replica computed)
            or params.embed
            or params.max_tokens == 0
        )

    async def blocks(self, request_id: str, prompt, params: SamplingParams):
        """The prompt's blocks this replica's engine lacks, from a prefill replica (a `KVTransfer` for
        `SamplingParams.kv_import`), or None: computed here (short, not eligible, or the prefill replica failed)."""
        if not self._eligible(prompt, params):
            self.requests.inc(tags={"where": "local"})
            return None
        try:
            ids, hashes = prompt_prefix(self.engine.tokenizer, prompt, self.block_size, params)
        except Exception:  # the engine refuses it with the reason
            return None
        if params.truncate_prompt_tokens is None and len(ids) > self.spec.engine.max_model_len:
            return None  # (the engine refuses it, saying so: no prefill replica need read it first)
        held = self.engine.cached_prefix_blocks(hashes)
        if len(ids) - held * self.block_size < self.spec.prefill.min_prompt_tokens:
            self.requests.inc(tags={"where": "local"})
            return None
        started = time.monotonic()
        key = routing.RoutingKey(tuple(h[: routing.HASH_BYTES] for h in hashes))
        response = self.handle.prefill.remote(key, request_id, ids, prefill_params(params, held))
        try:
            transfer = await asyncio.wait_for(_result(response), self.spec.prefill.timeout_s)
        except InvalidRequest:  # (this engine refuses it too, naming the parameter)
            return None
        except asyncio.CancelledError:  # (the client went away: the prefill replica need not go on)
            response.cancel()
            raise
        except Exception as e:  # noqa: BLE001 (any failure of the prefill replica: the prompt is computed here)
            response.cancel()
            self._failures += 1
            if self._failures == 1 or self._failures % 100 == 0:
                log.warning(
                    "%s: a prefill replica did not answer (%s); computing the prompt here (%d so far)",
                    self.spec.name,
                    f"no answer in {self.spec.prefill.timeout_s:g} s (prefill.timeout_s)"
                    if isinstance(e, TimeoutError)
                    else f"{type(e).__name__}: {e}",
                    self._failures,
                )
            self.requests.inc(tags={"where": "failed"})
            return None
        finally:
            by = routing.decision(key)  # (what the handle's router decided, in this process: "prefix:N" or "load")
        self.seconds.observe(time.monotonic() - started)
        self.requests.inc(tags={"where": "remote"})
        if self.routed is not None:
            self.routed.inc(tags={"by": by.split(":")[0]})
        return transfer


async def _result(response):
    return await response
