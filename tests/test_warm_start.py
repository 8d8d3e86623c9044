"""Warm starts: the tiny default model and the CPU kernels live in the user cache, keyed by content, so another
working dir (another checkout, a Ray job's copy) reuses them, and concurrent builders build once."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from raylm.cluster.models.default_model import build_default_model, served_model_name
from raylm.configs import ModelConfig

REPO_ROOT = Path(__file__).resolve().parents[1]
BUILDING_MODEL = "raylm: building the tiny model tiny-llama"
BUILDING_KERNELS = "raylm: building the CPU kernels"


def run_python(code: str, cwd: Path, **env: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", code], cwd=cwd, env={**os.environ, "PYTHONPATH": str(cwd), **env},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(process: subprocess.Popen[str]) -> tuple[str, str]:
    out, err = process.communicate(timeout=300)
    assert process.returncode == 0, err
    return out.strip(), err


@pytest.mark.slow
def test_tiny_model_is_built_once_into_the_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                 capfd: pytest.CaptureFixture[str]) -> None:
    cache = tmp_path / "cache"
    code = "from raylm.cluster.models.default_model import build_default_model; print(build_default_model())"
    # Two processes at once: one builds, the other waits for it on the lock and takes its folder.
    results = [finish(p) for p in [run_python(code, REPO_ROOT, RAYLM_CACHE_DIR=str(cache)) for _ in range(2)]]
    assert sum(err.count(BUILDING_MODEL) for _, err in results) == 1
    paths = {Path(out) for out, _ in results}
    assert len(paths) == 1
    path = paths.pop()
    assert path.name == "tiny-llama" and path.parent.parent == cache / "models"
    assert sorted(p.name for p in (cache / "models").iterdir()) == [path.parent.name, f"{path.parent.name}.lock"]

    monkeypatch.setenv("RAYLM_CACHE_DIR", str(cache))
    assert build_default_model() == path
    assert BUILDING_MODEL not in capfd.readouterr().err
    assert served_model_name(ModelConfig()) == "tiny-llama"


def test_cpu_kernels_are_reused_from_another_checkout(tmp_path: Path) -> None:
    """Two copies of the code in other folders (new paths, new file times) load the same build from the user cache:
    the second one builds nothing."""
    code = "import raylm.runner.cpu_kernels as k; m = k.load(); assert m is not None; print(m.__file__)"
    outputs = []
    for name in ("checkout-a", "checkout-b"):
        for package in ("configs", "common", "runner"):
            shutil.copytree(REPO_ROOT / "raylm" / package, tmp_path / name / "raylm" / package,
                            ignore=shutil.ignore_patterns("__pycache__"))
        shutil.copy(REPO_ROOT / "raylm" / "__init__.py", tmp_path / name / "raylm")
        outputs.append(finish(run_python(code, tmp_path / name)))
    (library_a, _), (library_b, err_b) = outputs
    assert BUILDING_KERNELS not in err_b
    assert library_b == library_a or Path(library_b).parent.name in library_a  # a's may be the build's temp folder
    assert not library_b.startswith(str(tmp_path))
