"""PrefixAffinityRouter: the LLM deployment's Serve request router (`request_router_config.request_router_class`).

Serve pickles a request router's whole module *by value* into the deployment's config
(`RequestRouterConfig._serialize_request_router_cls`), and keeps the first copy it was given while the config's
public fields stay the same. So this module holds the class alone, and the class imports its logic
(pylon.serving.api.routing) when it runs: the installed Pylon decides, and objects such as `RoutingKey` are the
installed module's own classes, not copies.
"""

from __future__ import annotations

from ray.serve._private.request_router.request_router import LocalityMixin, MultiplexMixin, RequestRouter


class PrefixAffinityRouter(LocalityMixin, MultiplexMixin, RequestRouter):
    """Runs in PylonRouter's handle (the LLM deployment's) and in each decoding replica's handle to its prefill
    replicas (a deployment's `prefill`; the call's first argument is its RoutingKey). The decision is `routing.rank`'s
    order: its first replica alone, then the rest. PylonRouter's `choose_replica(RoutingKey, _reserve=False)` takes
    that first replica; a call through the handle goes there unless Serve finds its queue full
    (`max_ongoing_requests`), then to the least loaded of the rest. It counts each candidate's requests live with
    Serve's queue-length probe (one small RPC per replica). A call without a RoutingKey (another handle to the
    deployment) gets Serve's power-of-two choices."""

    def initialize_state(self, capacity: int = 1, **kwargs) -> None:
        """`capacity`: a replica's sequence slots (`data_parallel x max_num_seqs`; request_router_kwargs)."""
        self._pylon_views: dict = {}
        self._pylon_capacity = capacity

    async def choose_replicas(self, candidate_replicas, pending_request=None):
        from pylon.serving.api import routing

        key = routing.key_of(pending_request)
        if key is None or not candidate_replicas:
            from ray.serve._private.request_router import PowerOfTwoChoicesRequestRouter

            return await PowerOfTwoChoicesRequestRouter.choose_replicas(self, candidate_replicas, pending_request)
        current = routing.views_of(self._pylon_views, self._replicas, candidate_replicas, self._pylon_capacity)
        probe = routing.to_probe(current, key, candidate_replicas)
        probed = {r.replica_id: n for r, n in await self._probe_queue_lens(probe, 0) if n is not None}
        order = routing.rank(current, key, candidate_replicas, probed)
        return [order[:1], order[1:]]
