"""Schemathesis drives the server from its own OpenAPI schema: no request may cause a 5xx."""

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error
from server import Server

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def api(tiny_folder):
    server = Server(tiny_folder, "--max-new-tokens-limit", "16")
    yield server
    server.stop()


def test_no_server_errors(api):
    schema = schemathesis.openapi.from_url(api.url + "/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/chat/completions", "/v1/completions", "/v1/models", "/health"}
    for operation in operations:

        @given(case=operation.as_strategy())
        @settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        def check(case):
            case.call_and_validate(checks=[not_a_server_error], timeout=30)

        check()
