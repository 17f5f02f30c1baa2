"""The fleet as a Ray Serve application: `tokenloom serve --data-parallel-size N`, or `serve run`.

Two deployments (three with disaggregated prefill), and a board:
- `engine`: N replicas of `EngineReplica` (replica.py), each an engine with its own KV cache and
  `cores / N` torch threads, routed to by `FleetRequestRouter` (ray_router.py) with the policy of
  `--routing-policy`. With `--prefill-replicas P`, P more replicas (`prefill`) compute each prompt's
  K/V first and hand it to an `engine` replica (disaggregated prefill; see replica.py). Ray Serve restarts a replica that dies or fails its health check, and scales
  between `min_replicas` and `max_replicas` on queue depth when `--autoscaling-config` is given.
- the board: where the replicas post their load, health and metrics every second, in the cluster's
  key-value store (board.py): no deployment, no process of its own.
- `ingress`: the same FastAPI app as `tokenloom serve` (tokenloom/server) over a `FleetClient`
  (client.py): same routes, auth, errors and limits. `tokenloom serve -dp N` serves it from its own
  process, on --host/--port (start_fleet), and deploys no ingress replica unless prefill is
  disaggregated; under `serve run`, Ray Serve's HTTP proxy fronts it.

`serve run tokenloom.fleet.serve_run:build model=... data-parallel-size=2` builds it from `tokenloom
serve`'s own flags (serve_run.py).
"""

from __future__ import annotations

import argparse
import functools
import logging

from . import ray_env  # noqa: F401  (before Ray: Ray Serve reads its pacing when imported)

# isort: split
import ray
from ray import serve
from ray.serve.config import RequestRouterConfig

from ..model.load import usable_cores
from . import board
from .board import FleetBoard
from .ray_router import FleetRequestRouter
from .replica import EngineReplica

logger = logging.getLogger("tokenloom.fleet")

HEALTH_CHECK_PERIOD_S = 2.0
HEALTH_CHECK_TIMEOUT_S = 10.0
APP_NAME = "tokenloom"
INGRESS_MAX_ONGOING = 100_000  # the ingress only forwards; the replicas' queues are the limit


def fleet_front(args: argparse.Namespace, engines, prefill, notice_board, facts, front: str | None = None):
    """The same FastAPI app as `tokenloom serve` (tokenloom/server) over a FleetClient (`front`: see there)."""
    from ..model.load import model_path
    from ..model.tokenizer import load_tokenizer
    from ..server.app import build_app
    from ..server.dashboard import DashboardOptions
    from ..server.loading import app_options, default_served_name
    from .client import FleetClient
    from .metrics import FleetMetrics

    path = model_path(args.model)
    client = FleetClient(engines, load_tokenizer(path), facts, notice_board, prefill, front)
    names = args.served_model_name or [default_served_name(args.model, path)]
    return build_app(client, names, metrics=FleetMetrics(board.latest), model_path=path,
                     dashboard=DashboardOptions(False),  # a page per replica is not built yet
                     **app_options(args))


@serve.ingress()
class FleetIngress:
    """The HTTP front as a deployment, behind Ray Serve's proxy: `serve run` (serve_run.py). `tokenloom
    serve -dp N` serves HTTP from its own process instead (start_fleet), one Ray hop fewer per token."""

    def __init__(self, engines, prefill, notice_board, serve_args: dict):
        self.engines, self.prefill, self.board = engines, prefill, notice_board
        self.args = argparse.Namespace(**serve_args)

    async def __serve_build_asgi_app__(self):
        from .client import ModelFacts

        # Ray Serve restarts this replica if it dies. Read the board before serving, so the new one's
        # router ranks its first requests with the replicas' load and cached prefixes (ray_router.py),
        # as the old one did, instead of starting blind.
        await board.refresh(self.board)
        facts = ModelFacts(**await self.engines.describe.remote())
        return fleet_front(self.args, self.engines, self.prefill, self.board, facts,
                           front=ray.get_runtime_context().get_actor_name())


def build_fleet(args: argparse.Namespace, with_ingress: bool = True):
    """The Ray Serve application for parsed `tokenloom serve` flags. `with_ingress=False` (a front that
    serves HTTP itself, `tokenloom serve -dp N`): the engine deployment is the root, and no ingress replica
    idles beside it (a process of its own: about 2% of a core and 0.5 GB). Disaggregated prefill keeps
    the ingress, the one deployment that binds both engine deployments."""
    autoscaling = args.autoscaling_config
    replicas = args.data_parallel_size
    most = autoscaling.get("max_replicas", replicas) if autoscaling else replicas
    cores = max(1, usable_cores() // (most + args.prefill_replicas))  # each replica's share at most
    engine_args = {k: v for k, v in vars(args).items() if k != "func"}
    engine_args["num_threads"] = args.num_threads or cores
    notice_board = FleetBoard()  # its replicas know the application's name (`serve run` gives it later)
    prefill = None
    if args.prefill_replicas:
        # Prefill replicas are where prefixes are cached: they take the routing policy; decode
        # replicas get their K/V handed over and are picked by load.
        prefill = _engine_deployment("prefill", args, cores, args.routing_policy, args.prefill_replicas
                                     ).bind(engine_args, notice_board, args.routing_policy == "prefix-aware")
    decode_policy = "least-loaded" if args.prefill_replicas else args.routing_policy
    engines = _engine_deployment("engine", args, cores, decode_policy, replicas, autoscaling
                                 ).bind(engine_args, notice_board, decode_policy == "prefix-aware")
    if not with_ingress and prefill is None:
        return engines
    ingress = serve.deployment(FleetIngress, name="ingress", ray_actor_options={"num_cpus": 0},
                               max_ongoing_requests=INGRESS_MAX_ONGOING, logging_config={"enable_access_log": False})
    return ingress.bind(engines, prefill, notice_board, engine_args)


def _engine_deployment(name: str, args: argparse.Namespace, cores: int, policy: str, replicas: int,
                       autoscaling: dict | None = None):
    router_kwargs = {"policy": policy, **({"block_size": args.block_size} if policy == "prefix-aware" else {})}
    return serve.deployment(
        EngineReplica, name=name,
        num_replicas=None if autoscaling else replicas,
        autoscaling_config=autoscaling,
        ray_actor_options={"num_cpus": cores},
        # Ray only caps what it sends a replica; the engine's own queue (--max-queue-len) says 503.
        max_ongoing_requests=args.max_queue_len + args.max_num_seqs,
        max_queued_requests=args.max_queue_len,
        health_check_period_s=HEALTH_CHECK_PERIOD_S,
        health_check_timeout_s=HEALTH_CHECK_TIMEOUT_S,
        graceful_shutdown_timeout_s=args.shutdown_timeout,
        logging_config={"enable_access_log": False},  # the engine logs one line per request itself
        request_router_config=RequestRouterConfig(
            request_router_class=FleetRequestRouter, request_router_kwargs=router_kwargs),
    )


def check_fleet_args(args: argparse.Namespace) -> None:
    if args.data_parallel_size < 1:
        raise ValueError(f"--data-parallel-size: must be at least 1, got {args.data_parallel_size}")
    if args.prefill_replicas < 0:
        raise ValueError(f"--prefill-replicas: must be at least 0, got {args.prefill_replicas}")
    if args.lora_modules or args.enable_lora:
        raise ValueError("--enable-lora: adapters are not served by a fleet (--data-parallel-size) yet")


def start_fleet(args: argparse.Namespace, config):
    """`tokenloom serve --data-parallel-size N`: a local Ray cluster and the deployments, without Ray's
    HTTP proxy; returns the front app, which this process serves (server/cli.py), calling the replicas
    through their handles. `stop_fleet()` ends the cluster."""
    from ..model import catalog
    from .client import ModelFacts

    check_fleet_args(args)
    for source, field in ((config.model, "model"), (config.draft_model, "speculative_config.model")):
        catalog.pull_missing(catalog.missing_pull(source, field))  # once, before N replicas want it
    # Ray runs its workers at nice 15 (below its own daemons); here the workers are the engines, and a
    # niced engine loses its cores to Ray's housekeeping: steps of 0.65 s instead of 10 ms were measured.
    ray.init(num_cpus=usable_cores(), include_dashboard=False, namespace="tokenloom",
             _system_config={"worker_niceness": 0})
    serve.start(http_options={"location": "NoServer"})
    serve.run(build_fleet(args, with_ingress=False), name=APP_NAME, route_prefix=None)
    handle = functools.partial(serve.get_deployment_handle, app_name=APP_NAME)
    engines, notice_board = handle("engine"), FleetBoard(APP_NAME)
    prefill = handle("prefill") if args.prefill_replicas else None
    logger.info("fleet: %d engine replica(s)%s, routing %s", args.data_parallel_size,
                f" and {args.prefill_replicas} prefill replica(s)" if prefill else "", args.routing_policy)
    facts = ModelFacts(**engines.describe.remote().result())
    return fleet_front(args, engines, prefill, notice_board, facts)


def stop_fleet() -> None:
    serve.shutdown()
    ray.shutdown()
