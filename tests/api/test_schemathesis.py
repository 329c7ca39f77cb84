"""Property-based fuzzing of every operation in the OpenAPI schema: never a 5xx.

Runs against a live server with a tiny random model (so thousands of generations cost
milliseconds); the schema, validation and error paths are the same code as with a real model.
Operations are driven with hypothesis directly (schemathesis's pytest plugin is not needed).
"""

from __future__ import annotations

import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error

from tests.api.conftest import tiny_server


def test_no_server_errors():
    srv = tiny_server(max_queue=64, request_timeout=20.0, max_document_tokens=400)
    try:
        schema = schemathesis.openapi.from_url(srv.url + "/openapi.json")
        seen = []
        for result in schema.get_all_operations():
            op = result.ok()
            seen.append(f"{op.method.upper()} {op.path}")

            @given(case=op.as_strategy())
            @settings(
                max_examples=40,
                deadline=None,
                database=None,
                suppress_health_check=list(HealthCheck),
            )
            def run(case):
                case.call_and_validate(checks=[not_a_server_error], timeout=60)

            run()
        assert {"POST /qa", "POST /v1/chat/completions", "POST /v1/completions"} <= set(seen)
    finally:
        srv.stop()
