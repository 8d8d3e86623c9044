"""scripts/batch_job.py as docs/batch.md says to run it: `ray job submit --working-dir . -- python
scripts/batch_job.py ...` on a Ray head node this test starts (its own ports and temp dir, stopped by its process
group: never `ray stop`, which would stop every Ray on the machine). The rows written equal LLM.generate's."""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from raylm.cluster.entrypoints.llm import LLM
from raylm.common.sampling_params import SamplingParams

REPO_ROOT = Path(__file__).resolve().parents[1]
RAY = str(Path(sys.executable).with_name("ray"))
ENGINE = {"max_model_len": 64, "num_gpu_blocks_override": 64, "distributed_executor_backend": "uni"}
NUM_ROWS = 24


def _free_ports(n: int) -> list[int]:
    sockets = [socket.socket() for _ in range(n)]
    for probe in sockets:
        probe.bind(("127.0.0.1", 0))
    ports = [probe.getsockname()[1] for probe in sockets]
    for probe in sockets:
        probe.close()
    return ports


@pytest.fixture(scope="module")
def ray_env() -> dict[str, str]:
    return os.environ | {"RAY_AUTH_MODE": "token", "RAY_USAGE_STATS_ENABLED": "0", "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0"}


@pytest.fixture(scope="module")
def head_node(ray_env: dict[str, str]) -> Iterator[str]:
    """The dashboard address of a fresh head node (2 declared CPUs more than the cores: the replica asks for 1)."""
    gcs, dashboard, client, agent = _free_ports(4)
    temp_dir = tempfile.mkdtemp(prefix="rayjob", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    head = subprocess.Popen(
        [RAY, "start", "--head", "--block", "--num-cpus=4", f"--port={gcs}", f"--dashboard-port={dashboard}",
         "--dashboard-host=127.0.0.1", f"--ray-client-server-port={client}",
         f"--dashboard-agent-listen-port={agent}", f"--temp-dir={temp_dir}", "--include-dashboard=true"],
        # No drain on SIGTERM: Ray's default waits 30 s for the node to drain before it stops its processes.
        env=ray_env | {"RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0"}, start_new_session=True,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    address = f"http://127.0.0.1:{dashboard}"
    try:
        deadline = time.monotonic() + 120
        while not _answers(f"{address}/api/version"):  # cheaper to ask than `ray job list`, a Python start each
            assert head.poll() is None and time.monotonic() < deadline, "the head node did not come up"
            time.sleep(0.5)
        while subprocess.run([RAY, "job", "list", "--address", address], env=ray_env,
                             capture_output=True).returncode != 0:
            assert head.poll() is None and time.monotonic() < deadline, "the head node did not come up"
            time.sleep(1)
        yield address
    finally:
        os.killpg(head.pid, signal.SIGTERM)
        try:
            head.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)
        shutil.rmtree(temp_dir, ignore_errors=True)


def _answers(url: str) -> bool:
    """Whether an HTTP server answers at `url` (any status: the dashboard may ask for the token)."""
    try:
        urllib.request.urlopen(url, timeout=5).close()
    except urllib.error.HTTPError:
        return True
    except OSError:
        return False
    return True


def prompt_of(i: int) -> str:
    return f"job row {i}: " + "ha " * (i % 4)


@pytest.mark.slow
def test_batch_job_through_ray_job_submit(head_node: str, ray_env: dict[str, str], llama_path: Path,
                                          tmp_path: Path) -> None:
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps({"id": i, "prompt": prompt_of(i)}) + "\n"
                                                    for i in range(NUM_ROWS)))
    submitted = subprocess.run(
        [RAY, "job", "submit", "--address", head_node, "--working-dir", str(REPO_ROOT), "--",
         sys.executable, "scripts/batch_job.py", "--input", str(tmp_path / "prompts.jsonl"),
         "--output", str(tmp_path / "results"), "--output-format", "jsonl", "--model", str(llama_path),
         "--engine-kwargs", json.dumps(ENGINE), "--batch-size", "8", "--max-tokens", "8"],
        env=ray_env, capture_output=True, text=True, timeout=300)
    assert submitted.returncode == 0 and "succeeded" in submitted.stdout, submitted.stdout + submitted.stderr
    assert f"batch_job: {NUM_ROWS} rows" in submitted.stdout
    rows = [json.loads(line) for path in sorted((tmp_path / "results").glob("*.json*"))
            for line in path.read_text().splitlines()]
    assert sorted(row["id"] for row in rows) == list(range(NUM_ROWS))
    llm = LLM(model=str(llama_path), **ENGINE)
    try:
        expected = llm.generate([prompt_of(i) for i in range(NUM_ROWS)],
                                SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False)
    finally:
        llm.shutdown()
    assert {row["id"]: row["generated_tokens"] for row in rows} == {
        i: output.outputs[0].token_ids for i, output in enumerate(expected)}
