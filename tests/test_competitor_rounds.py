"""The side-by-side protocol of the competitor benchmarks (benchmarks/competitors/round_process.py and
vllm_rounds.py): a script in another Python answers one JSON line per round while its logs, and those
of the processes it starts, go to a log file; a script that fails at start or in a round is an error
naming what it said, and its process is gone. vllm_lora.py over a stand-in `vllm` package whose LoRA
engine fails reports the base figures and the LoRA error instead of stopping."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import textwrap
from pathlib import Path
from types import ModuleType

import pytest

COMPETITORS = Path(__file__).parents[1] / "benchmarks" / "competitors"


def _round_process() -> ModuleType:
    spec = importlib.util.spec_from_file_location("round_process", COMPETITORS / "round_process.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


rounds = _round_process()


def _script(tmp_path: Path, body: str) -> list[str]:
    path = tmp_path / "competitor.py"
    path.write_text(textwrap.dedent(body))
    return [sys.executable, str(path)]


def _env(*paths: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(str(p) for p in (*paths, COMPETITORS))}


def test_rounds_answer_on_stdout_while_logs_go_to_the_log(tmp_path):
    command = _script(
        tmp_path,
        """
        import subprocess, sys
        from vllm_rounds import serve_rounds

        def setup():
            print("INFO a library logging to stdout")
            subprocess.run([sys.executable, "-c", "print('INFO an engine process logging to stdout')"], check=True)
            count = [0]
            def run_round():
                count[0] += 1
                print("INFO round", count[0])
                return {"round": count[0]}
            return {"version": "1.0"}, run_round

        serve_rounds(setup)
        """,
    )
    log = tmp_path / "competitor.log"
    with rounds.RoundProcess(command, log, _env()) as competitor:
        assert competitor.ready == {"version": "1.0"}
        assert [competitor.round(), competitor.round()] == [{"round": 1}, {"round": 2}]
        process = competitor._process
    assert process.returncode == 0
    text = log.read_text()
    for line in ("INFO a library logging to stdout", "INFO an engine process logging to stdout", "INFO round 2"):
        assert line in text


def test_a_failed_setup_is_an_error_with_its_message_and_log(tmp_path):
    command = _script(
        tmp_path,
        """
        from vllm_rounds import serve_rounds

        def setup():
            print("INFO loading the model")
            raise ValueError("no pooling runner for BertModel")

        serve_rounds(setup)
        """,
    )
    with pytest.raises(rounds.CompetitorError) as failure:
        rounds.RoundProcess(command, tmp_path / "competitor.log", _env())
    message = str(failure.value)
    assert "competitor.py failed during start: ValueError: no pooling runner for BertModel" in message
    assert "INFO loading the model" in message and str(tmp_path / "competitor.log") in message


def test_a_script_dying_in_a_round_is_an_error_with_its_exit_code(tmp_path):
    command = _script(
        tmp_path,
        """
        import os
        from vllm_rounds import serve_rounds

        def run_round():
            print("INFO out of memory", flush=True)
            os._exit(3)

        serve_rounds(lambda: ({}, run_round))
        """,
    )
    competitor = rounds.RoundProcess(command, tmp_path / "competitor.log", _env())
    with pytest.raises(rounds.CompetitorError, match="exited with code 3 during a round") as failure:
        competitor.round()
    assert "INFO out of memory" in str(failure.value)
    competitor.close()


def test_a_script_that_is_not_the_protocol_is_refused(tmp_path):
    command = _script(tmp_path, "print('hello')\n")
    with pytest.raises(rounds.CompetitorError, match="printed 'hello' where an answer was expected"):
        rounds.RoundProcess(command, tmp_path / "competitor.log", _env())


FAKE_VLLM = {
    "vllm/__init__.py": """
        __version__ = "0.0-test"

        class _Completion:
            def __init__(self, n):
                self.token_ids = list(range(n))

        class _Output:
            def __init__(self, n):
                self.outputs = [_Completion(n)]

        class SamplingParams:
            def __init__(self, temperature, max_tokens, ignore_eos):
                self.max_tokens = max_tokens

        class LLM:
            def __init__(self, model, enable_lora=False, **kwargs):
                if enable_lora:
                    raise NotImplementedError("LoRA is not supported on this platform")

            def generate(self, prompts, params, lora_request=None, use_tqdm=True):
                return [_Output(params.max_tokens) for _ in prompts]
        """,
    "vllm/inputs.py": """
        def TokensPrompt(prompt_token_ids):
            return {"prompt_token_ids": prompt_token_ids}
        """,
    "vllm/lora/__init__.py": "",
    "vllm/lora/request.py": """
        class LoRARequest:
            def __init__(self, name, int_id, path):
                self.lora_name, self.lora_int_id, self.lora_path = name, int_id, path
        """,
}


def test_vllm_lora_reports_the_lora_engine_error_and_the_base_figures(tmp_path):
    """A stand-in for vLLM whose LoRA engine refuses to start: the script still runs the base engine
    each round and says why the LoRA one did not run."""
    for name, text in FAKE_VLLM.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(textwrap.dedent(text))
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps([[1, 2, 3]] * 4))
    command = [sys.executable, str(COMPETITORS / "vllm_lora.py"), "--model", "base", "--prompts", str(prompts),
               "--adapters", "a0", "a1", "--max-tokens", "5"]  # fmt: skip
    with rounds.RoundProcess(command, tmp_path / "vllm.log", _env(tmp_path)) as vllm:
        error = "NotImplementedError: LoRA is not supported on this platform"
        assert vllm.ready == {"vllm": "0.0-test", "lora_error": error}
        answer = vllm.round()
    assert answer["base"] > 0 and answer["lora"] is None and answer["lora_error"] == error
