"""`tachy serve --replicas N` (or --autoscale, --config, --model NAME=PATH): the application on Ray Serve,
on a local Ray instance or a cluster joined with --ray-address, until SIGINT/SIGTERM."""

from __future__ import annotations

import argparse
import logging
import signal
import threading

from tachyllm.ray_serve.config import check_model_paths, from_args
from tachyllm.ray_serve.listeners import check_node_ip, local_ray_options

logger = logging.getLogger("tachyllm.ray_serve")

APP_NAME = "tachyllm"


def serve_on_ray(args: argparse.Namespace) -> int:
    config = from_args(args)  # a bad config fails before Ray starts
    check_model_paths(config)
    node_options = {} if args.ray_address else local_ray_options(args.host)  # before Ray is imported
    import ray
    from ray import serve

    from tachyllm.ray_serve.app import application
    from tachyllm.ray_serve.hub import hub_actor_name

    # "local": a new instance of our own, never one that RAY_ADDRESS or an earlier `ray start` names.
    address = args.ray_address or "local"
    ray.init(address=address, include_dashboard=False, logging_level=logging.WARNING, **node_options)
    if node_options:
        try:
            check_node_ip(args.host)
        except RuntimeError:
            ray.shutdown()
            raise
    # After ray.init, which installs a SIGTERM handler of its own that exits at once.
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": args.host, "port": args.port})
        serve.run(application(config, args), name=APP_NAME, route_prefix="/")
        for model in config.models:
            scale = model.autoscaling or {"min_replicas": model.replicas, "max_replicas": model.replicas}
            logger.info(
                "serving %r: %s-%s replicas, %d threads each, router %s",
                model.name, scale["min_replicas"], scale["max_replicas"], model.threads_per_replica,
                config.router.policy,
            )  # fmt: skip
        logger.info("listening on http://%s:%d (Ray Serve)", args.host, args.port)
        stop.wait()
        logger.info("shutting down the Ray Serve application")
    finally:
        serve.delete(APP_NAME)
        try:
            ray.kill(ray.get_actor(hub_actor_name(APP_NAME), namespace="serve"))
        except ValueError:  # never created
            pass
        if args.ray_address is None:  # the Ray instance is ours: stop it (a cluster's stays up)
            serve.shutdown()
            ray.shutdown()
    return 0
