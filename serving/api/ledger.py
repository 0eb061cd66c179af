"""A deployment's ledger: replica-hours, tokens in and out, cost per million output tokens, idle fraction.

Each replica keeps its own record, `<ledger root>/deployments/<name>/<replica>.json`, rewritten every
`UPDATE_EVERY_S` and when it stops: when it started (loading included), when it was last seen, the resources it
holds (the spec's `replica`), the tokens of the requests it finished, and how long it was busy (the union of its
finished requests' arrival-to-last-token intervals, taken in the order they finish). The ledger root is
`$PYLON_LEDGER_URI` when set (object storage every node and the client reach), else `$PYLON_HOME/ledger` on the
replica's node.

`report(name)` sums the replicas: replica-hours (and CPU/GPU-hours by the resources each held), tokens, the
idle fraction (replica time with nothing to do over replica time), the cost at the catalog's prices and the cost
per million output tokens at the load it measured. A deployment's prefill replicas (`prefill`) keep records too: their
hours and cost count in the deployment's, and their prompts apart (`prefill` in the report); the replicas that decode
count the requests and tokens. Requests are also counted by the model they named (the base
model, or one of its LoRA adapters), and the cost is split between those by their share of the tokens (prompt and
output): what each adapter's users cost on the shared replicas.
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import Any

from pylon import settings, storage

log = logging.getLogger("pylon.serving.ledger")

UPDATE_EVERY_S = 5.0
HOUR = 3600.0
DEPLOYMENTS_DIR = "deployments"


def ledger_root() -> str:
    return settings.value(settings.LEDGER_URI) or str(settings.pylon_home() / "ledger")


def deployment_uri(name: str, root: str | None = None) -> str:
    return storage.join(root or ledger_root(), DEPLOYMENTS_DIR, name)


class ReplicaLedger:
    """One replica's record: `finished(...)` per request; `write()` when `due()` (the replica's metrics loop)."""

    def __init__(self, spec: dict, *, accelerator: str | None = None, role: str = "decode"):
        """`role`: "decode" (a replica that takes requests), or "prefill" (a prefill replica, `prefill`: its hours and
        cost count, and its prompts apart; the replicas that decode them count the requests and tokens)."""
        name = spec["name"]
        held = (spec.get("prefill") or {}).get("replica") if role == "prefill" else None
        held = held or spec["replica"]
        replica = _replica_id()
        self.uri = storage.join(deployment_uri(name), f"{replica}.json")
        now = time.time()
        self.record: dict[str, Any] = {
            "deployment": name,
            "replica": replica,
            "model": spec["model"],
            "spec": spec,  # for the planner's prediction (a spec names API-key variables, never keys)
            "started_at": now,
            "updated_at": now,
            "ended_at": None,
            "role": role,
            "resources": {"CPU": held["num_cpus"], "GPU": held["num_gpus"]},
            "accelerator": accelerator,
            "requests": 0,
            "prompt_tokens": 0,
            "output_tokens": 0,
            "busy_s": 0.0,
            "by_model": {},  # model named (the base model or a LoRA adapter) -> requests, tokens
        }
        self._written_at = 0.0
        self._busy_until = float("-inf")  # the latest end of a finished request's interval
        self.write()

    def finished(
        self, prompt_tokens: int, output_tokens: int, start: float, end: float | None, model: str | None = None
    ) -> None:
        """A finished request: its tokens (also under `model`, the model it named: None for the base model), and its
        interval [start, end] (one clock) added to the busy time where it extends past the intervals before it."""
        r = self.record
        r["requests"] += 1
        r["prompt_tokens"] += int(prompt_tokens)
        r["output_tokens"] += int(output_tokens)
        mine = r["by_model"].setdefault(
            model or r["deployment"], {"requests": 0, "prompt_tokens": 0, "output_tokens": 0}
        )
        mine["requests"] += 1
        mine["prompt_tokens"] += int(prompt_tokens)
        mine["output_tokens"] += int(output_tokens)
        if end is not None and end > self._busy_until:
            r["busy_s"] += end - max(start, self._busy_until)
            self._busy_until = end

    def due(self) -> bool:
        """Whether the record was last written UPDATE_EVERY_S ago or more."""
        return time.time() - self._written_at >= UPDATE_EVERY_S

    def write(self, *, ended: bool = False) -> None:
        now = time.time()
        self.record["updated_at"] = now
        if ended:
            self.record["ended_at"] = now
        self._written_at = now
        try:
            storage.atomic_write_json(self.uri, self.record)
        except Exception as e:  # the ledger never stops serving
            log.warning("could not write the replica ledger %s: %s", self.uri, e)


def _replica_id() -> str:
    try:
        from ray import serve

        context = serve.get_replica_context()
        return str(getattr(context, "replica_tag", None) or context.replica_id.unique_id).replace("#", "-")
    except Exception:
        return f"replica-{uuid.uuid4().hex[:8]}"


def read_replicas(name: str, root: str | None = None) -> list[dict]:
    folder = deployment_uri(name, root)
    records = []
    for entry in storage.listdir(folder):
        if entry.endswith(".json"):
            try:
                records.append(storage.read_json(storage.join(folder, entry)))
            except Exception as e:
                log.warning("skipping replica ledger %s: %s", entry, e)
    return sorted(records, key=lambda r: r["started_at"])


def report(name: str, *, root: str | None = None, prices: str | None = None, now: float | None = None) -> dict:
    """The ledger of deployment `name`, from its replicas' records (a PylonError when there are none)."""
    from pylon.errors import PylonError
    from pylon.plan.catalog import load_catalog

    replicas = read_replicas(name, root)
    if not replicas:
        raise PylonError(
            f"no ledger for a deployment named '{name}' under {deployment_uri(name, root)}: its replicas write it "
            f"there as they serve (set {settings.LEDGER_URI} on the cluster and here to read it from another machine)"
        )
    now = time.time() if now is None else now
    catalog = load_catalog(prices)
    hours: dict[str, float] = {}
    replica_s = busy_s = 0.0
    tokens_in = tokens_out = requests = 0
    by_model: dict[str, dict[str, int]] = {}
    gpu_cost = 0.0
    accelerator = None
    stale_after = 3 * UPDATE_EVERY_S
    prefill = {"replicas": 0, "replica_hours": 0.0, "prompts": 0, "prompt_tokens": 0, "busy_s": 0.0}
    for r in replicas:
        end = r["ended_at"] or (now if now - r["updated_at"] < stale_after else r["updated_at"])
        held = max(0.0, end - r["started_at"])
        for resource, amount in r["resources"].items():
            hours[resource] = hours.get(resource, 0.0) + held * amount / HOUR
        if r.get("accelerator") and r["resources"].get("GPU"):
            accelerator = r["accelerator"]
            try:
                gpu_cost += held * r["resources"]["GPU"] / HOUR * catalog.get(accelerator).price_per_gpu_hour
            except PylonError:
                pass
        if r.get("role") == "prefill":  # (its prompts' requests and tokens are the decoding replicas')
            prefill["replicas"] += 1
            prefill["replica_hours"] += held / HOUR
            prefill["prompts"] += r["requests"]
            prefill["prompt_tokens"] += r["prompt_tokens"]
            prefill["busy_s"] += min(r["busy_s"], held)
            continue
        replica_s += held
        busy_s += min(r["busy_s"], held)
        tokens_in += r["prompt_tokens"]
        tokens_out += r["output_tokens"]
        requests += r["requests"]
        # (a record written before requests were counted by model: all of them the base model's)
        mine = r.get("by_model") or {
            name: {k: r[k] for k in ("requests", "prompt_tokens", "output_tokens")} if r["requests"] else {}
        }
        for model, counts in mine.items():
            total_of = by_model.setdefault(model, {"requests": 0, "prompt_tokens": 0, "output_tokens": 0})
            for k, v in counts.items():
                total_of[k] += v
    cost = {"accelerators": gpu_cost, "cpu": hours.get("CPU", 0.0) * catalog.vcpu_price_per_hour}
    total = sum(cost.values())
    decoding = [r for r in replicas if r.get("role") != "prefill"]
    live = [r for r in decoding if not r["ended_at"] and now - r["updated_at"] < stale_after]
    return {
        "kind": "deployment",
        "deployment": name,
        "ledger_uri": deployment_uri(name, root),
        "updated_at": now,
        "replicas": len(decoding),
        "replicas_live": len(live),
        "replica_hours": replica_s / HOUR,
        "resource_hours": hours,
        "cpu_hours": hours.get("CPU", 0.0),
        "accelerator_hours": hours.get("GPU", 0.0),
        "requests": requests,
        "tokens_in": tokens_in,
        "tokens_out": tokens_out,
        "output_tokens_per_s": tokens_out / busy_s if busy_s else 0.0,
        "idle_fraction": 1.0 - busy_s / replica_s if replica_s else 0.0,
        "cost_usd": total,
        "cost_breakdown_usd": cost,
        "cost_per_million_output_tokens_usd": total / tokens_out * 1e6 if tokens_out else None,
        "by_model": _by_model(by_model, total),
        "prices": {
            "source": catalog.prices_source,
            "accelerator": accelerator,
            "per_vcpu_hour": catalog.vcpu_price_per_hour,
        },
        "predicted": _predicted((decoding or replicas)[-1], catalog),
        **(
            {
                "prefill": {
                    "replicas": prefill["replicas"],
                    "replica_hours": prefill["replica_hours"],
                    "prompts": prefill["prompts"],
                    "prompt_tokens": prefill["prompt_tokens"],
                    "idle_fraction": 1.0 - prefill["busy_s"] / (prefill["replica_hours"] * HOUR)
                    if prefill["replica_hours"]
                    else 0.0,
                }
            }
            if prefill["replicas"]
            else {}
        ),
    }


def _by_model(counts: dict[str, dict[str, int]], cost: float) -> list[dict]:
    """Each model named (the base model, its adapters): its requests and tokens, its share of all the tokens
    (prompt and output), and that share of the cost; the costliest first."""
    tokens = sum(c["prompt_tokens"] + c["output_tokens"] for c in counts.values())
    rows = []
    for model, c in counts.items():
        if not c.get("requests"):
            continue
        share = (c["prompt_tokens"] + c["output_tokens"]) / tokens if tokens else 0.0
        rows.append(
            {
                "model": model,
                "requests": c["requests"],
                "tokens_in": c["prompt_tokens"],
                "tokens_out": c["output_tokens"],
                "token_share": share,
                "cost_usd": cost * share,
            }
        )
    return sorted(rows, key=lambda row: (-row["cost_usd"], row["model"]))


def _predicted(replica: dict, catalog) -> dict:
    """What the plan says: a replica-hour's cost at the catalog's prices, and on a GPU `pylon plan`'s decode
    throughput ceiling and cost per million output tokens (it has no CPU serving model)."""
    per_hour = replica["resources"].get("CPU", 0) * catalog.vcpu_price_per_hour
    out: dict[str, Any] = {"source": "the replica's resources at the catalog's prices"}
    accelerator = replica.get("accelerator")
    if accelerator and replica["resources"].get("GPU"):
        try:
            from pylon.plan.serve import plan_serve
            from pylon.specs import DeploymentSpec

            per_hour += replica["resources"]["GPU"] * catalog.get(accelerator).price_per_gpu_hour
            option = plan_serve(DeploymentSpec.model_validate(replica["spec"]), catalog=catalog, gpu=accelerator)
            option = option.rows[0]
            out.update(
                source=f"pylon plan on {option.accelerator.name}",
                output_tokens_per_s=option.batch_tps,
                cost_per_million_output_tokens_usd=option.cost_per_million_tokens,
            )
        except Exception as e:
            out["error"] = str(e)
    out["cost_per_replica_hour_usd"] = per_hour
    return out
