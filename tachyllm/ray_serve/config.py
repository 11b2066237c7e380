"""What a Ray Serve deployment of tachyllm runs: its models (each a deployment of engine replicas) and
how requests are routed to replicas. Built from `tachy serve` flags or from a models.yaml file; every
mistake is one ConfigError line that names the entry and the key.

models.yaml:

    models:
      - name: smollm            # what clients send as "model"
        model: /path/to.gguf    # optional: the embedded default model
        replicas: 2             # or autoscale: {min_replicas: 1, max_replicas: 4, ...}
        threads_per_replica: 1  # compute threads of each replica (default: cores / replicas)
        engine:                 # engine options: the `tachy serve` engine flags, without the dashes
          max_num_seqs: 64
          enable_lora: true
        lora_modules:           # LoRA adapters served as models of their own (needs engine.enable_lora)
          sql: /path/to/sql-adapter        # name: PEFT directory or GGUF LoRA file
    router:
      policy: prefix            # prefix (default), power_of_two (Ray's default router), round_robin
      load_margin: 8
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import os
import re
from dataclasses import dataclass, field
from typing import Any

from tachyllm.config import EngineConfig
from tachyllm.engine_args import add_engine_args, engine_config
from tachyllm.errors import ConfigError
from tachyllm.loading.default_model import DEFAULT_MODEL_NAME
from tachyllm.server.options import LoRAModule

MAX_EVENT_INTERVAL_S = 2.0
ROUTER_POLICIES = ("prefix", "power_of_two", "round_robin")

# Ray Serve's autoscaling_config keys that a model may set, and tachyllm's defaults for them (Ray's
# own target of 2 ongoing requests per replica would scale an engine that batches 64 far too early).
AUTOSCALING_DEFAULTS: dict[str, float] = {
    "target_ongoing_requests": 32,
    "upscale_delay_s": 10.0,
    "downscale_delay_s": 60.0,
    "metrics_interval_s": 2.0,
    "look_back_period_s": 10.0,
}
AUTOSCALING_KEYS = ("min_replicas", "max_replicas", "initial_replicas", *AUTOSCALING_DEFAULTS)
MODEL_KEYS = (
    "name", "model", "replicas", "autoscale", "threads_per_replica", "num_cpus", "max_ongoing_requests", "engine",
    "lora_modules",
)  # fmt: skip
ROUTER_KEYS = ("policy", "load_margin", "event_interval_s")


@dataclass
class RouterConfig:
    policy: str = "prefix"
    # A prefix hit is taken while its replica's queue is at most this many requests longer than the
    # shortest queue; beyond that the request goes to the less loaded of two replicas.
    load_margin: int = 8
    # How often a replica sends its batch of prefix-cache events (and its metrics) to the router.
    event_interval_s: float = 0.2


@dataclass
class ModelDeployment:
    name: str
    engine: EngineConfig
    replicas: int = 1
    autoscaling: dict[str, float] | None = None  # Ray Serve's autoscaling_config; None: fixed `replicas`
    threads_per_replica: int = 1
    max_ongoing_requests: int | None = None  # Ray Serve's cap per replica (default: 2 x max_num_seqs)
    num_cpus: float | None = None  # Ray's logical CPUs per replica (default: threads_per_replica)
    # LoRA adapters served as models of their own on this model's replicas (needs engine.enable_lora).
    lora_modules: list[LoRAModule] = field(default_factory=list)

    @property
    def deployment_name(self) -> str:
        return "engine-" + re.sub(r"[^A-Za-z0-9_.-]+", "_", self.name)

    @property
    def ray_num_cpus(self) -> float:
        return self.threads_per_replica if self.num_cpus is None else self.num_cpus

    @property
    def ongoing_limit(self) -> int:
        return self.max_ongoing_requests or 2 * self.engine.max_num_seqs


@dataclass
class ScaleOutConfig:
    models: list[ModelDeployment]
    router: RouterConfig = field(default_factory=RouterConfig)


def parse_autoscale(text: str) -> tuple[int, int]:
    """--autoscale MIN:MAX."""
    low, sep, high = text.partition(":")
    try:
        bounds = int(low), int(high)
    except ValueError:
        bounds = None
    if not sep or bounds is None or not 0 <= bounds[0] <= bounds[1] or bounds[1] < 1:
        raise argparse.ArgumentTypeError(f"expected MIN:MAX with 0 <= MIN <= MAX and MAX >= 1, got {text!r}")
    return bounds


def autoscaling_config(low: int, high: int, overrides: dict[str, Any] | None = None) -> dict[str, float]:
    config: dict[str, float] = {"min_replicas": low, "max_replicas": high, **AUTOSCALING_DEFAULTS}
    config.update(overrides or {})
    return config


def default_threads(num_replicas: int) -> int:
    return max(1, (os.cpu_count() or 1) // max(1, num_replicas))


def from_args(args: argparse.Namespace) -> ScaleOutConfig:
    """The deployment `tachy serve --replicas/--autoscale/--model NAME=PATH` asks for: every model with
    the command line's engine options."""
    if args.config:
        flags = {
            "--model": args.model_all,
            "--replicas": args.replicas,
            "--autoscale": args.autoscale,
            "--threads-per-replica": args.threads_per_replica,
            "--served-model-name": args.served_model_name,
            "--router": args.router != RouterConfig.policy,
            "--router-load-margin": args.router_load_margin != RouterConfig.load_margin,
            "--lora-modules": args.lora_modules,
        }
        given = [flag for flag, value in flags.items() if value]
        given += ["--" + f.replace("_", "-") for f in changed_engine_options(engine_config(args))]
        if given:
            raise ConfigError(f"--config gives the models; {', '.join(given)} would be ignored: set them in the file")
        return load_config(args.config)
    base = engine_config(args)
    named = [spec.partition("=") if "=" in spec else ("", "", spec) for spec in args.model_all or [base.model or ""]]
    if len(named) > 1 and not all(name for name, _, _ in named):
        raise ConfigError("several --model flags serve several models: give each as NAME=PATH")
    if len(named) == 1 and not named[0][0] and args.served_model_name:
        named = [(args.served_model_name[0], "=", named[0][2])]
    check_unique([name for name, _, _ in named], "--model")
    replicas = args.replicas or 1
    scaled = args.autoscale is not None
    threads = args.threads_per_replica or default_threads(len(named) * (args.autoscale[1] if scaled else replicas))
    models = []
    for name, _, path in named:
        engine = dataclasses.replace(base, model=path or None, threads=threads)
        models.append(
            ModelDeployment(
                name=name or engine_model_name(engine),
                engine=engine,
                replicas=replicas,
                autoscaling=autoscaling_config(*args.autoscale) if scaled else None,
                threads_per_replica=threads,
            )
        )
    assign_lora_modules(models, args.lora_modules)
    check_unique([name for m in models for name in (m.name, *(a.name for a in m.lora_modules))], "--lora-modules")
    return ScaleOutConfig(models, RouterConfig(policy=args.router, load_margin=args.router_load_margin))


def assign_lora_modules(models: list[ModelDeployment], modules: list[LoRAModule]) -> None:
    """Each --lora-modules adapter to its model: the one model, or the one its base_model_name names (its
    parent in /v1/models is that model's name)."""
    for module in modules:
        if module.base_model_name is None and len(models) > 1:
            raise ConfigError(
                f"--lora-modules {module.name!r}: several models are served; name its model with vLLM's JSON "
                '{"name": ..., "path": ..., "base_model_name": MODEL}'
            )
        model = models[0] if len(models) == 1 else next((m for m in models if m.name == module.base_model_name), None)
        if model is None:
            served = ", ".join(m.name for m in models)
            raise ConfigError(f"--lora-modules {module.name!r}: base_model_name {module.base_model_name!r} is not "
                              f"a served model ({served})")  # fmt: skip
        if not model.engine.enable_lora:
            raise ConfigError(f"--lora-modules {module.name!r}: needs --enable-lora")
        model.lora_modules.append(module)


def changed_engine_options(engine: EngineConfig) -> list[str]:
    """The engine options not at their defaults."""
    default = EngineConfig()
    return [f.name for f in dataclasses.fields(EngineConfig) if getattr(engine, f.name) != getattr(default, f.name)]


def check_model_paths(config: ScaleOutConfig) -> None:
    """Refuses a model file that does not exist here before Ray starts (on a cluster, every node needs
    the models at the same paths), rather than as replicas failing to start."""
    for model in config.models:
        if model.engine.model and not os.path.exists(model.engine.model):
            raise ConfigError(f"model {model.name!r}: {model.engine.model!r} does not exist")
        for adapter in model.lora_modules:
            if not os.path.exists(adapter.path):
                raise ConfigError(
                    f"model {model.name!r}: LoRA adapter {adapter.name!r}: {adapter.path!r} does not exist"
                )


def engine_model_name(engine: EngineConfig) -> str:
    """The name a model is served under when none is given, as a single-engine server names it."""
    return engine.model or DEFAULT_MODEL_NAME


def load_config(path: str) -> ScaleOutConfig:
    try:
        import yaml
    except ImportError:
        raise ConfigError("--config needs PyYAML: pip install -e '.[ray]'") from None
    try:
        with open(path) as f:
            document = yaml.safe_load(f)
    except OSError as e:
        raise ConfigError(f"{path}: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML ({str(e).splitlines()[0]})") from None
    return parse_config(document, path)


def parse_config(document: Any, where: str = "config") -> ScaleOutConfig:
    document = mapping(document, where, ("models", "router"))
    entries = document.get("models")
    if not isinstance(entries, list) or not entries:
        raise ConfigError(f"{where}: 'models' must be a non-empty list of models")
    models = [parse_model(entry, f"{where}: models[{i}]", len(entries)) for i, entry in enumerate(entries)]
    check_unique([name for m in models for name in (m.name, *(a.name for a in m.lora_modules))], f"{where}: models")
    router = mapping(document.get("router", {}), f"{where}: router", ROUTER_KEYS)
    config = RouterConfig(**router)
    if config.policy not in ROUTER_POLICIES:
        raise ConfigError(f"{where}: router.policy must be one of {', '.join(ROUTER_POLICIES)}, got {config.policy!r}")
    margin, interval = config.load_margin, config.event_interval_s
    if not is_int(margin) or margin < 0:
        raise ConfigError(f"{where}: router.load_margin must be an integer >= 0, got {margin!r}")
    # The hub takes a replica silent for 10 s for dead.
    if not is_number(interval) or not 0 < interval <= MAX_EVENT_INTERVAL_S:
        raise ConfigError(f"{where}: router.event_interval_s must be in (0, {MAX_EVENT_INTERVAL_S}], got {interval!r}")
    return ScaleOutConfig(models, config)


def parse_model(entry: Any, where: str, num_models: int) -> ModelDeployment:
    entry = mapping(entry, where, MODEL_KEYS)
    name = entry.get("name")
    if not isinstance(name, str) or not name:
        raise ConfigError(f"{where}: 'name' is required (the model name clients ask for)")
    where = f"{where} ({name})"
    options = dict(mapping(entry.get("engine", {}), f"{where}: engine", None))
    if "model" in entry:
        options["model"] = entry["model"]
    if "threads" in options:
        raise ConfigError(f"{where}: give threads_per_replica, not engine.threads")
    replicas = entry.get("replicas", 1)
    if not is_int(replicas) or replicas < 1:
        raise ConfigError(f"{where}: replicas must be an integer >= 1, got {replicas!r}")
    autoscaling = None
    if "autoscale" in entry:
        if "replicas" in entry:
            raise ConfigError(f"{where}: give either replicas or autoscale, not both")
        knobs = dict(mapping(entry["autoscale"], f"{where}: autoscale", AUTOSCALING_KEYS))
        low, high = knobs.pop("min_replicas", 1), knobs.pop("max_replicas", None)
        if not is_int(high) or not is_int(low) or not 0 <= low <= high or high < 1:
            raise ConfigError(
                f"{where}: autoscale needs integers 0 <= min_replicas <= max_replicas and max_replicas >= 1"
            )
        for key, value in knobs.items():
            if not is_number(value) or value < 0:
                raise ConfigError(f"{where}: autoscale.{key} must be a number >= 0, got {value!r}")
        autoscaling = autoscaling_config(low, high, knobs)
    most = autoscaling["max_replicas"] if autoscaling else replicas
    threads = entry.get("threads_per_replica", default_threads(int(most) * num_models))
    if not is_int(threads) or threads < 1:
        raise ConfigError(f"{where}: threads_per_replica must be an integer >= 1, got {threads!r}")
    options["threads"] = threads
    ongoing = entry.get("max_ongoing_requests")
    if ongoing is not None and (not is_int(ongoing) or ongoing < 1):
        raise ConfigError(f"{where}: max_ongoing_requests must be an integer >= 1, got {ongoing!r}")
    num_cpus = entry.get("num_cpus")
    if num_cpus is not None and (not is_number(num_cpus) or num_cpus < 0):
        raise ConfigError(f"{where}: num_cpus must be a number >= 0, got {num_cpus!r}")
    engine = engine_options(options, where)
    adapters = parse_lora_modules(entry.get("lora_modules", {}), f"{where}: lora_modules")
    if adapters and not engine.enable_lora:
        raise ConfigError(f"{where}: lora_modules needs engine.enable_lora: true")
    return ModelDeployment(name, engine, replicas, autoscaling, threads, ongoing, num_cpus, adapters)


def parse_lora_modules(value: Any, where: str) -> list[LoRAModule]:
    """A model's lora_modules: a mapping of adapter names to paths (a PEFT directory or a GGUF LoRA file)."""
    adapters = []
    for name, path in mapping(value, where, None).items():
        if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
            raise ConfigError(f"{where}: expected adapter names mapped to paths, got {name!r}: {path!r}")
        adapters.append(LoRAModule(name, path))
    return adapters


def engine_options(options: dict[str, Any], where: str) -> EngineConfig:
    """An EngineConfig from a mapping of engine options, parsed by the very flags `tachy serve` has."""
    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    argv = []
    for key, value in options.items():
        name = str(key).replace("-", "_")
        if name not in fields:
            raise ConfigError(f"{where}: unknown engine option {key!r}{did_you_mean(name, fields)}")
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            argv.append(flag if value else f"--no-{flag[2:]}")
        elif value is None:
            argv += [flag, "none"]
        else:
            argv += [flag, json.dumps(value) if isinstance(value, dict | list) else str(value)]
    parser = argparse.ArgumentParser(prog=where, add_help=False, exit_on_error=False)
    add_engine_args(parser)
    try:
        args, extra = parser.parse_known_args(argv)
    except argparse.ArgumentError as e:
        raise ConfigError(f"{where}: engine option {e.argument_name}: {e.message}") from None
    if extra:  # a bool given to an option that takes a value, or the reverse
        raise ConfigError(f"{where}: engine option values {extra} do not fit their options")
    try:
        return engine_config(args)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{where}: {e}") from None


def mapping(value: Any, where: str, allowed: tuple[str, ...] | None) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ConfigError(f"{where}: expected a mapping of keys to values, got {type(value).__name__}")
    if allowed is not None:
        for key in value:
            if key not in allowed:
                raise ConfigError(f"{where}: unknown key {key!r}{did_you_mean(str(key), allowed)}")
    return value


def did_you_mean(name: str, choices: Any) -> str:
    close = difflib.get_close_matches(name, list(choices), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def check_unique(names: list[str], where: str) -> None:
    seen = set()
    for name in names:
        if name in seen:
            raise ConfigError(f"{where}: the model name {name!r} is given twice")
        seen.add(name)


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)
