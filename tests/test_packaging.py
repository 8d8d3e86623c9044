"""`pip install .` installs one package, `raylm` (with its YAML presets and C++ kernel sources), and the `raylm`
command: nothing named `cluster`, `configs` or `worker` lands in site-packages beside other projects' packages."""
from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def test_the_wheel_holds_only_raylm_and_its_command(tmp_path: Path) -> None:
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(tmp_path), str(REPO_ROOT)], check=True, capture_output=True, timeout=300)
    (wheel,) = tmp_path.glob("raylm-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert {name.split("/")[0] for name in names} == {"raylm", wheel.name.split("-py3")[0] + ".dist-info"}
    assert {"raylm/configs/tiny.yaml", "raylm/configs/serve-tiny.yaml", "raylm/runner/csrc/cpu_kernels.cpp",
            "raylm/runner/csrc/quant/block_gemm.cpp", "raylm/runner/csrc/quant/block_formats.h"} <= set(names)
    entry_points = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert "raylm = raylm.cluster.entrypoints.cli:main" in entry_points
