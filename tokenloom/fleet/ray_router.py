"""The Ray Serve request router of the engine deployment: a routing.py policy behind Ray's interface.

Ray Serve runs this router inside whichever process holds the deployment's handle (the ingress), picks
among the replicas the Serve controller reports running, and sends the request to the first replica in
our ranking that has room (`max_ongoing_requests`), backing off and asking again when none has.
The replicas' own reports of their load and health come from the fleet's board (board.py), which the
ingress reads every second; so do the prefixes each replica's cache still holds (prefix_summary.py),
merged into the policy once per read, which is how a router that has just started (its ingress replica
restarted) learns where the fleet's earlier prompts are cached.
"""

from __future__ import annotations

from . import ray_env  # noqa: F401  (before Ray: Ray Serve reads its pacing when imported)

# isort: split
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
        self._merged_board: dict | None = None  # the read of the board last merged into the policy

    def _merge_cache_reports(self, replicas: list[RunningReplica]) -> None:
        """Once per read of the board (the front replaces board.LATEST each time), what each live replica
        says its prefix cache holds. A dead replica's last report can stay on the board for a while: only
        candidates count, so a forgotten replica is not learned back."""
        latest = board.LATEST
        if latest is self._merged_board:
            return
        self._merged_board = latest
        for replica in replicas:
            rid = replica.replica_id.unique_id
            if hashes := latest.get(rid, {}).get("cached_prefixes"):
                self.policy.cache_reported(rid, hashes)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        self._merge_cache_reports(candidate_replicas)
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        if pending_request is not None and pending_request.metadata.call_method == "mailbox":
            # A front's mailbox call goes to the replica it names (its second argument). If that one is
            # gone, any other: it refuses the call (replica.py), which is how the front learns it.
            return [[by_id.get(pending_request.args[1], candidate_replicas[0])]]
        ranking = self.policy.rank(_prompt_ids(pending_request), [replica_load(r) for r in candidate_replicas])
        return [[by_id[rid]] for rid in ranking]

    def on_send_request(self, replica_id: ReplicaID) -> None:
        # Counted in flight the moment it is sent: Ray reports a request routed only once its replica has
        # answered that it accepts it, and a burst ranked before those answers would all see the same
        # loads and go to one replica. Every send ends in on_request_completed, accepted or rejected.
        super().on_send_request(replica_id)
        self.policy.sent(replica_id.unique_id)

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        self.policy.placed(replica_id.unique_id, _prompt_ids(pending_request))

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self.policy.completed(replica_id.unique_id)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.policy.forget(replica_id.unique_id)
