"""The Ray Serve request router of the engine deployment: a routing.py policy behind Ray's interface.

Ray Serve runs this router inside whichever process holds the deployment's handle (the ingress), picks
among the replicas the Serve controller reports running, and sends the request to the first replica in
our ranking that has room (`max_ongoing_requests`), backing off and asking again when none has.
The replicas' own reports of their load and health come from the fleet's board (board.py), which the
ingress reads every second.
"""

from __future__ import annotations

from ray.serve.request_router import FIFOMixin, PendingRequest, ReplicaID, RequestRouter, RunningReplica

from . import board
from .routing import ReplicaLoad, make_policy


def _prompt_ids(pending: PendingRequest | None) -> list[int]:
    if pending is None or not pending.args or not isinstance(pending.args[0], dict):
        return []  # a call without a prompt (describe): any replica will do
    return pending.args[0].get("prompt_token_ids", [])


def replica_load(replica: RunningReplica) -> ReplicaLoad:
    s = board.LATEST.get(replica.replica_id.unique_id, {})
    return ReplicaLoad(replica.replica_id.unique_id, int(s.get("waiting", 0)), int(s.get("running", 0)),
                       float(s.get("kv_usage", 0.0)), s.get("health_problem"))


class FleetRequestRouter(FIFOMixin, RequestRouter):
    def initialize_state(self, policy: str = "prefix-aware", **policy_kwargs) -> None:
        self.policy = make_policy(policy, **policy_kwargs)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        ranking = self.policy.rank(_prompt_ids(pending_request), [replica_load(r) for r in candidate_replicas])
        return [[by_id[rid]] for rid in ranking]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        self.policy.routed(replica_id.unique_id, _prompt_ids(pending_request))

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self.policy.completed(replica_id.unique_id)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.policy.forget(replica_id.unique_id)
