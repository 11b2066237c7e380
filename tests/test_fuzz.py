"""Property-based fuzzing of the HTTP API with schemathesis, driven by the server's own
/openapi.json: every operation, schema-valid and schema-invalid requests. The server must never
answer 5xx, must answer only the statuses and content types it documents, with bodies that match
its response schemas, and must refuse (4xx) whatever the schema does not allow."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import schemathesis
from helpers.server import running_server
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode, checks

# Small limits keep each generated request cheap on a 2-core machine (n x max_tokens x prompts).
FLAGS = ["--max-model-len", "64", "--max-n", "2", "--max-prompts-per-request", "2", "--max-request-tokens", "256"]
EXAMPLES = 50  # per operation and mode: ~15 s in all on 2 cores
CHECKS = [
    checks.not_a_server_error,
    checks.status_code_conformance,
    checks.content_type_conformance,
    checks.response_headers_conformance,
    checks.response_schema_conformance,
    checks.negative_data_rejection,
]


@pytest.fixture(scope="module")
def api(tiny_model_factory) -> Iterator[schemathesis.BaseSchema]:
    with running_server(str(tiny_model_factory("llama")), *FLAGS) as base:
        yield schemathesis.openapi.from_url(f"{base}/openapi.json")


def test_every_operation_survives_fuzzing(api):
    """schemathesis' pytest plugin does not run under this pytest; its strategies run under hypothesis directly."""
    failures, operations = [], 0
    for result in api.get_all_operations():
        operation = result.ok()
        operations += 1
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):

            @given(case=operation.as_strategy(generation_mode=mode))
            @settings(max_examples=EXAMPLES, deadline=None, database=None, suppress_health_check=list(HealthCheck))
            def fuzz(case) -> None:
                case.call_and_validate(checks=CHECKS)

            try:
                fuzz()
            except Unsatisfiable:  # no input breaks this operation's schema (no body, any string)
                assert mode == GenerationMode.NEGATIVE
            except Exception as e:  # keep going: one report with every operation's failure
                failures.append(f"{operation.label} ({mode}): {e}")
    assert operations >= 8
    assert not failures, "\n\n".join(failures)
