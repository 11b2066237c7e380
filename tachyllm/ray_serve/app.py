"""The Ray Serve application: one deployment of EngineReplicas per model, behind an ingress that serves
the OpenAI-compatible API (the same FastAPI routes as `tachy serve`) and calls each model's replicas
through a DeploymentHandle, routed by the configured request router.

`application(config, server_args)` builds it for `tachy serve --replicas`; `build_app(args)` is the
builder for Ray's own `serve run tachyllm.ray_serve:build_app config=models.yaml` and `serve deploy`.
"""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

from ray import serve
from ray.serve.config import RequestRouterConfig

from tachyllm.errors import ConfigError
from tachyllm.lora.request import LoRARequest
from tachyllm.ray_serve.config import (
    MAX_EVENT_INTERVAL_S,
    ModelDeployment,
    ScaleOutConfig,
    check_model_paths,
    load_config,
    parse_config,
)
from tachyllm.ray_serve.hub import routing_hub
from tachyllm.ray_serve.listeners import serve_grpc_on_node_ip
from tachyllm.ray_serve.remote_engine import RemoteEngine
from tachyllm.ray_serve.replica import EngineReplica, RemoteError
from tachyllm.ray_serve.router import PrefixCacheRouter, RoundRobinRouter
from tachyllm.ray_serve.router_metrics import router_metrics
from tachyllm.server.app import assemble_app, metrics_options, server_state
from tachyllm.server.options import LoRAModule, server_args
from tachyllm.server.state import ServedModel


def router_config(model: ModelDeployment, config: ScaleOutConfig) -> RequestRouterConfig | None:
    policy = config.router.policy
    if policy == "power_of_two":
        return None  # Ray Serve's default
    if policy == "round_robin":
        return RequestRouterConfig(request_router_class=RoundRobinRouter)  # type: ignore[arg-type]  # see below
    kwargs = {
        "deployment": model.deployment_name,
        "model_name": model.name,
        "load_margin": config.router.load_margin,
        "poll_interval_s": config.router.event_interval_s,
    }
    # Ray's config takes the class (its stubs type the field as the dict it is serialized into).
    return RequestRouterConfig(request_router_class=PrefixCacheRouter, request_router_kwargs=kwargs)  # type: ignore[arg-type]


# Ray Serve's default (10 s) would leave a hung engine serving errors for half a minute before three
# failed checks replace it.
HEALTH_CHECK_PERIOD_S = 5.0
INGRESS_MAX_ONGOING_REQUESTS = 100_000
# How long a scrape waits for the replicas' current metrics (hub.py): a replica answers within one
# event interval (at most MAX_EVENT_INTERVAL_S); only a hung one is given as of its last report.
FRESH_METRICS_WAIT_S = MAX_EVENT_INTERVAL_S + 1.0


def engine_deployment(model: ModelDeployment, config: ScaleOutConfig, options: argparse.Namespace):
    settings: dict[str, Any] = {
        "name": model.deployment_name,
        "max_ongoing_requests": model.ongoing_limit,
        "ray_actor_options": {"num_cpus": model.ray_num_cpus},
        "graceful_shutdown_timeout_s": options.shutdown_timeout,
        "health_check_period_s": HEALTH_CHECK_PERIOD_S,
        # An engine that fails to build (a bad option only the engine can tell) fails again.
        "max_constructor_retry_count": 2,
    }
    if model.autoscaling is not None:
        settings["autoscaling_config"] = model.autoscaling
    else:
        settings["num_replicas"] = model.replicas
    if (routing := router_config(model, config)) is not None:
        settings["request_router_config"] = routing
    # serve.deployment(cls) is a Deployment; Ray's stubs type only its decorator-factory form.
    deployment = serve.deployment(EngineReplica).options(**settings)  # type: ignore[attr-defined]
    return deployment.bind(model, config.router, options.engine_iteration_timeout, metrics_options(options))


@serve.ingress()
class Ingress:
    """The HTTP front: tachyllm's routes over one RemoteEngine per model."""

    # Ray Serve awaits an async constructor.
    async def __init__(  # type: ignore[misc]
        self,
        engines: dict[str, Any],
        deployments: dict[str, str],
        options: argparse.Namespace,
        adapters: dict[str, list[LoRAModule]],
    ):
        serve_grpc_on_node_ip()
        names = list(engines)
        infos = await asyncio.gather(*(engines[name].describe.remote() for name in names))
        models = [
            ServedModel([name], RemoteEngine(name, engines[name], info), options.tool_call_parser)
            for name, info in zip(names, infos)
        ]
        for base in list(models):
            models += await adapter_models(base, engines[base.name], adapters.get(base.name, []))
        app_name = serve.get_replica_context().app_name
        hub = routing_hub(app_name)

        def replica_metrics(name: str):
            async def collect() -> list[tuple[dict[str, str], bytes]]:
                reports = await hub.metrics.remote(deployments[name], FRESH_METRICS_WAIT_S)
                return [({"replica": replica}, text) for replica, text in reports if text]

            return collect

        async def routing_metrics() -> list[tuple[dict[str, str], bytes]]:
            return [({}, router_metrics().render())]

        sources = [replica_metrics(name) for name in names] + [routing_metrics]
        self._state = server_state(models, options, sources)
        self._options = options
        # Traced when a model's engine is (its --otlp-traces-endpoint): the spans are made here, the front.
        self._tracing = next((info.trace_options for info in infos if info.trace_options is not None), None)

    def __serve_build_asgi_app__(self):
        return assemble_app(self._state, self._options, self._tracing)


async def adapter_models(base: ServedModel, handle: Any, modules: list[LoRAModule]) -> list[ServedModel]:
    """A model per LoRA adapter of `base` (its models.yaml lora_modules, or --lora-modules), served by
    base's replicas: each adapter read and checked by a replica at start (a bad one fails the
    application with its error), its content digest kept for the router's block hashes."""
    engine = base.engine
    assert isinstance(engine, RemoteEngine)
    served = []
    for int_id, module in enumerate(modules, start=1):
        digest = await handle.check_adapter.remote(module.path)
        if isinstance(digest, RemoteError):
            raise ConfigError(f"model {base.name!r}: LoRA adapter {module.name!r}: {digest.message}")
        lora = LoRARequest(module.name, int_id, module.path)
        engine.adapter_digests[lora] = digest
        served.append(ServedModel([module.name], engine, base.tool_call_parser, lora=lora, parent=base.name))
    return served


def application(config: ScaleOutConfig, options: argparse.Namespace):
    """`options`: the server options (a `tachy serve` namespace, or server_args()); LoRA adapters come
    with the models (`config`), which --lora-modules were assigned to."""
    if options.allow_runtime_lora_updating:
        raise ConfigError(
            "--allow-runtime-lora-updating is served by a single engine, not on Ray Serve: give each model's "
            "adapters in lora_modules (docs/scale_out.md)"
        )
    engines = {model.name: engine_deployment(model, config, options) for model in config.models}
    # Ray Serve's default of 5 ongoing requests per replica would cap the whole endpoint at 5 streams.
    ingress = serve.deployment(Ingress).options(  # type: ignore[attr-defined]  # as EngineReplica's above
        name="ingress", ray_actor_options={"num_cpus": 0}, max_ongoing_requests=INGRESS_MAX_ONGOING_REQUESTS
    )
    deployments = {model.name: model.deployment_name for model in config.models}
    adapters = {model.name: model.lora_modules for model in config.models}
    return ingress.bind(engines, deployments, options, adapters)


def build_app(args: dict[str, Any]):
    """`serve run tachyllm.ray_serve:build_app config=models.yaml [api_key=...]`: the models of a
    models.yaml (or an inline `models:` list in a Serve config's `args`), with server options given
    as further args (the `tachy serve` server flags, underscored)."""
    args = dict(args)
    if "config" in args:
        config = load_config(args.pop("config"))
    elif "models" in args:
        config = parse_config({"models": args.pop("models"), "router": args.pop("router", {})}, "args")
    else:
        raise ConfigError("build_app needs config=<models.yaml> (or a models list in args)")
    if "lora_modules" in args:
        raise ConfigError("build_app: give LoRA adapters per model (lora_modules in the models list), not as an arg")
    check_model_paths(config)
    options = server_args(args)
    if "allowed_hosts" not in args:
        # Where Ray's proxy listens is the Serve config's (http_options), not ours: answer any Host
        # unless told otherwise, as a server bound to all addresses does.
        options.allowed_hosts = ["*"]
    return application(config, options)
