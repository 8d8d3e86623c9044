"""`raylm bench serve` against a running OpenAI server: a concurrency sweep and a request-rate sweep, as a table and
a JSON file."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from raylm.cluster.entrypoints.cli import main
from tests.http_server import served_engine


def test_bench_serve_sweeps_concurrency_and_rate(llama_path: Path, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    with served_engine(llama_path) as (server, _):
        common = ["bench", "serve", "--url", server.base_url, "--num-requests", "6", "--output-len", "4"]
        assert main([*common, "--concurrency", "1", "3", "--output-json", str(tmp_path / "c.json")]) == 0
        assert main([*common, "--request-rate", "50", "inf", "--output-json", str(tmp_path / "r.json")]) == 0
        assert main([*common, "--concurrency", "0"]) == 2  # a clear error, not a hang
    out = capsys.readouterr()
    assert "| concurrency 3 |" in out.out and "| rate inf/s |" in out.out
    assert "--concurrency values must be >= 1" in out.err
    for name, loads in (("c.json", ["concurrency 1", "concurrency 3"]), ("r.json", ["rate 50/s", "rate inf/s"])):
        report = json.loads((tmp_path / name).read_text())
        assert [point["load"] for point in report["points"]] == loads
        for point in report["points"]:
            assert point["output_throughput"] > 0 and point["request_throughput"] > 0
            assert len(point["ttft_ms"]) == 3 and point["ttft_ms"][0] <= point["ttft_ms"][2]
            assert len(point["itl_ms"]) == 3 and point["e2e_ms"][0] > 0
