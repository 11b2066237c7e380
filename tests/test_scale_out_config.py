"""What a Ray Serve deployment runs, from models.yaml or `tachy serve` flags (ray_serve/config.py): engine
options parsed by the engine's own flags, Ray Serve's autoscaling knobs with tachyllm's defaults, and every
mistake as one error line naming the entry and the key. No Ray needed."""

from __future__ import annotations

import re

import pytest

from tachyllm.entrypoints.cli import build_parser, main
from tachyllm.entrypoints.serve import uses_ray
from tachyllm.errors import ConfigError
from tachyllm.ray_serve.config import AUTOSCALING_DEFAULTS, from_args, load_config, parse_config
from tachyllm.server.options import server_args


def one_model(**entry) -> dict:
    return {"models": [{"name": "a", **entry}]}


def test_a_full_config():
    config = parse_config(
        {
            "models": [
                {"name": "a", "model": "/m/a", "replicas": 2, "threads_per_replica": 3,
                 "engine": {"max_num_seqs": 64, "kv-cache-dtype": "int8", "enable_prefix_caching": False,
                            "speculative_config": {"method": "ngram", "num_speculative_tokens": 3}}},
                {"name": "b", "autoscale": {"min_replicas": 1, "max_replicas": 4, "upscale_delay_s": 1},
                 "num_cpus": 0.5},
            ],
            "router": {"policy": "round_robin", "load_margin": 2},
        }
    )  # fmt: skip
    a, b = config.models
    assert (a.engine.model, a.engine.max_num_seqs, a.engine.kv_cache_dtype) == ("/m/a", 64, "int8")
    assert a.engine.enable_prefix_caching is False and a.engine.speculative_config is not None
    assert (a.replicas, a.autoscaling, a.threads_per_replica, a.engine.threads) == (2, None, 3, 3)
    assert a.ongoing_limit == 128 and a.ray_num_cpus == 3 and a.deployment_name == "engine-a"
    assert b.engine.model is None and b.ray_num_cpus == 0.5
    assert b.autoscaling == {**AUTOSCALING_DEFAULTS, "min_replicas": 1, "max_replicas": 4, "upscale_delay_s": 1}
    assert (config.router.policy, config.router.load_margin) == ("round_robin", 2)


@pytest.mark.parametrize(
    ("document", "message"),
    [
        (one_model(engine={"max_num_seq": 8}), "models[0] (a): unknown engine option 'max_num_seq' (did you mean "
         "'max_num_seqs'?)"),
        (one_model(engine={"max_num_seqs": "many"}), "engine option --max-num-seqs: invalid int value: 'many'"),
        (one_model(engine={"kv_cache_dtype": "int3"}), "kv_cache_dtype must be one of auto, fp8"),
        (one_model(engine={"threads": 2}), "give threads_per_replica, not engine.threads"),
        (one_model(replica=2), "models[0]: unknown key 'replica' (did you mean 'replicas'?)"),
        (one_model(replicas=0), "models[0] (a): replicas must be an integer >= 1, got 0"),
        (one_model(replicas="2"), "replicas must be an integer >= 1, got '2'"),
        (one_model(replicas=2, autoscale={"max_replicas": 3}), "give either replicas or autoscale, not both"),
        (one_model(autoscale={"min_replicas": 3, "max_replicas": 2}), "autoscale needs integers 0 <= min_replicas"),
        (one_model(autoscale={"max_replicas": 2, "target": 4}), "autoscale: unknown key 'target'"),
        (one_model(threads_per_replica=0), "threads_per_replica must be an integer >= 1"),
        ({"models": [{"name": "a"}, {"name": "a"}]}, "the model name 'a' is given twice"),
        ({"models": [{"model": "/m"}]}, "models[0]: 'name' is required"),
        ({"models": []}, "'models' must be a non-empty list"),
        ({"modles": []}, "unknown key 'modles' (did you mean 'models'?)"),
        ([1, 2], "expected a mapping of keys to values, got list"),
        ({**one_model(), "router": {"policy": "random"}}, "router.policy must be one of prefix, power_of_two"),
        ({**one_model(), "router": {"load_margin": -1}}, "router.load_margin must be an integer >= 0"),
        ({**one_model(), "router": {"event_interval_s": 0}}, "router.event_interval_s must be in (0, 2.0]"),
        (one_model(autoscale={"max_replicas": 2, "upscale_delay_s": "soon"}), "autoscale.upscale_delay_s must be a"),
    ],
)  # fmt: skip
def test_bad_configs_are_one_clear_line(document, message):
    with pytest.raises(ConfigError) as e:
        parse_config(document)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_yaml_files(tmp_path):
    good = tmp_path / "models.yaml"
    good.write_text("models:\n  - name: a\n    replicas: 2\n    engine:\n      max_num_seqs: 8\n")
    assert load_config(str(good)).models[0].engine.max_num_seqs == 8
    broken = tmp_path / "broken.yaml"
    broken.write_text("models: [\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(str(broken))
    with pytest.raises(ConfigError, match="No such file"):
        load_config(str(tmp_path / "missing.yaml"))


def test_the_cli_reports_a_bad_config_in_one_line_before_starting_ray(tmp_path, capsys):
    bad = tmp_path / "models.yaml"
    bad.write_text("models:\n  - name: a\n    replicas: 0\n")
    assert main(["serve", "--config", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"tachy: error: {bad}: models[0] (a): replicas must be an integer >= 1, got 0"


def parse(*flags: str):
    return build_parser().parse_args(["serve", *flags])


def test_flags():
    assert not uses_ray(parse()) and not uses_ray(parse("--model", "/m"))
    assert uses_ray(parse("--replicas", "2")) and uses_ray(parse("--model", "a=/m"))
    config = from_args(parse("--model", "a=/m/a", "--model", "b=/m/b", "--replicas", "2", "--max-num-seqs", "8"))
    assert [(m.name, m.engine.model, m.replicas, m.engine.max_num_seqs) for m in config.models] == [
        ("a", "/m/a", 2, 8),
        ("b", "/m/b", 2, 8),
    ]
    one = from_args(
        parse("--model", "/m/a", "--autoscale", "1:3", "--threads-per-replica", "2", "--router", "round_robin")
    )
    (model,) = one.models
    assert model.name == "/m/a" and model.autoscaling["max_replicas"] == 3 and model.engine.threads == 2
    assert one.router.policy == "round_robin"
    named = from_args(parse("--replicas", "2", "--served-model-name", "smol"))
    assert named.models[0].name == "smol" and named.models[0].engine.model is None
    with pytest.raises(ConfigError, match="given twice"):
        from_args(parse("--model", "a=/m/a", "--model", "a=/m/b"))
    with pytest.raises(ConfigError, match="give each as NAME=PATH"):
        from_args(parse("--model", "/m/a", "--model", "b=/m/b"))
    with pytest.raises(SystemExit):
        parse("--autoscale", "3:1")
    with pytest.raises(ConfigError, match="--config gives the models; --replicas would be ignored"):
        from_args(parse("--config", "m.yaml", "--replicas", "2"))
    with pytest.raises(ConfigError, match="--router, --max-num-seqs would be ignored"):
        from_args(parse("--config", "m.yaml", "--router", "round_robin", "--max-num-seqs", "8"))


def test_missing_model_files_are_refused_before_ray_starts(tmp_path, capsys):
    assert main(["serve", "--model", f"a={tmp_path / 'nope.gguf'}", "--replicas", "2"]) == 2
    assert capsys.readouterr().err.strip() == f"tachy: error: model 'a': '{tmp_path / 'nope.gguf'}' does not exist"


def test_several_models_without_names_are_refused_without_ray(capsys):
    assert main(["serve", "--model", "/m/a", "--model", "/m/b"]) == 2
    assert "give each as NAME=PATH" in capsys.readouterr().err


def test_server_options_for_ray_serve_builders():
    options = server_args({"api_key": "k", "max_n": "4", "allowed_hosts": ["a", "b"]})
    assert (options.api_key, options.max_n, options.allowed_hosts, options.port) == ("k", 4, ["a", "b"], 8000)
    with pytest.raises(ConfigError, match="unknown server option 'max_m'"):
        server_args({"max_m": 4})
    with pytest.raises(ConfigError, match="--max-n"):
        server_args({"max_n": "zero"})


def test_tensor_parallel_size_reaches_every_replica():
    """--replicas 2 --tensor-parallel-size 2: each replica's engine is a TP group of 2 ranks, which share
    the replica's threads (and its Ray CPU reservation)."""
    config = from_args(parse("--replicas", "2", "--tensor-parallel-size", "2", "--threads-per-replica", "2"))
    (model,) = config.models
    assert model.replicas == 2 and model.engine.tensor_parallel_size == 2
    assert model.engine.threads == 2 and model.ray_num_cpus == 2


LORA_ENGINE = {"enable_lora": True}


@pytest.mark.parametrize(
    "document, message",
    [
        (one_model(lora_modules={"sql": "/a/sql"}), "models[0] (a): lora_modules needs engine.enable_lora: true"),
        (one_model(engine=LORA_ENGINE, lora_modules=["sql=/a"]), "lora_modules: expected a mapping of keys to values"),
        (one_model(engine=LORA_ENGINE, lora_modules={"sql": ""}), "expected adapter names mapped to paths"),
        (one_model(engine=LORA_ENGINE, lora_modules={"a": "/a/sql"}), "the model name 'a' is given twice"),
        ({"models": [{"name": "a", "engine": LORA_ENGINE, "lora_modules": {"x": "/x"}},
                     {"name": "b", "engine": LORA_ENGINE, "lora_modules": {"x": "/y"}}]},
         "the model name 'x' is given twice"),
    ],
)  # fmt: skip
def test_bad_lora_modules_in_models_yaml(document, message):
    with pytest.raises(ConfigError) as e:
        parse_config(document)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_lora_modules_per_model(tmp_path, capsys):
    """models.yaml's lora_modules and --lora-modules give each model its adapters (checked to exist before
    Ray starts); with several models, --lora-modules names its model in vLLM's JSON form."""
    config = parse_config(
        {
            "models": [
                {"name": "a", "engine": LORA_ENGINE, "lora_modules": {"sql": "/a/sql", "chat": "/a/chat.gguf"}},
                {"name": "b"},
            ]
        }  # fmt: skip
    )
    assert [(m.name, m.path) for m in config.models[0].lora_modules] == [("sql", "/a/sql"), ("chat", "/a/chat.gguf")]
    assert config.models[1].lora_modules == []
    one = from_args(parse("--replicas", "2", "--enable-lora", "--lora-modules", "sql=/a/sql"))
    assert [m.name for m in one.models[0].lora_modules] == ["sql"]
    json_form = '{"name": "sql", "path": "/b/sql", "base_model_name": "b"}'
    two = from_args(parse("--model", "a=/m/a", "--model", "b=/m/b", "--enable-lora", "--lora-modules", json_form))
    assert [len(m.lora_modules) for m in two.models] == [0, 1]
    for flags, message in [
        (["--replicas", "2", "--lora-modules", "sql=/a"], "--lora-modules 'sql': needs --enable-lora"),
        (["--model", "a=/m/a", "--model", "b=/m/b", "--enable-lora", "--lora-modules", "sql=/a"],
         "several models are served; name its model"),
        (["--model", "a=/m/a", "--model", "b=/m/b", "--enable-lora", "--lora-modules", json_form.replace('"b"', '"c"')],
         "base_model_name 'c' is not a served model (a, b)"),
        (["--replicas", "2", "--enable-lora", "--lora-modules", "sql=/a", "x=/b", "sql=/c"],
         "the model name 'sql' is given twice"),
        (["--config", "m.yaml", "--lora-modules", "sql=/a"], "--lora-modules would be ignored"),
    ]:  # fmt: skip
        with pytest.raises(ConfigError, match=re.escape(message)):
            from_args(parse(*flags))
    model = tmp_path / "m.gguf"
    model.write_bytes(b"")
    missing = tmp_path / "missing-adapter"
    assert main(["serve", "--model", f"a={model}", "--replicas", "2", "--enable-lora",
                 "--lora-modules", f"sql={missing}"]) == 2  # fmt: skip
    err = capsys.readouterr().err.strip()
    assert err == f"tachy: error: model 'a': LoRA adapter 'sql': '{missing}' does not exist"
