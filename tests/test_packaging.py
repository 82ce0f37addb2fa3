"""The package as a user installs it: a wheel built from this checkout carries the native run
copy where a C compiler exists, installs without one, and says which copy path it runs.

Each case builds a wheel with pip (in pip's isolated build environment, as a user's install
does), installs it into a fresh virtual environment without its dependencies, and asks the
installed kvxferd which copy path it runs. torch and numpy come from the test's own
environment on PYTHONPATH (a second CPU torch would cost a minute and a gigabyte); PYTHONPATH
holds no kvxferd, so the one imported is the wheel's.
"""

from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(not shutil.which("cc") and not shutil.which("gcc"),
                                reason="no C compiler: the build with one cannot be shown here")


def build_wheel(tmp: Path, env: dict[str, str] | None = None) -> tuple[Path, str]:
    source = tmp / "src"  # a copy: the build must not leave files in the checkout
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(".git", ".venv*", "build", "*.egg-info", "_runcopy*.so",
                                                                 "__pycache__", ".pytest_cache", ".hypothesis"))
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", str(tmp / "dist"), str(source)],
                         capture_output=True, text=True, env={**os.environ, **(env or {})}, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    (wheel,) = (tmp / "dist").glob("kvxferd-*.whl")
    return wheel, out.stdout + out.stderr


def installed_copy_path(tmp: Path, wheel: Path) -> dict[str, str]:
    env_dir = tmp / "venv"
    venv.create(env_dir, with_pip=True)
    python = env_dir / "bin" / "python"
    out = subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    probe = "import json, kvxferd.datapath.runcopy as r; print(json.dumps({**r.copy_path(), 'module': r.__file__}))"
    deps = os.pathsep.join(site.getsitepackages())
    got = subprocess.run([str(python), "-c", probe], capture_output=True, text=True, timeout=120, cwd=tmp,
                         env={**os.environ, "PYTHONPATH": deps})
    assert got.returncode == 0, got.stderr[-3000:]
    found = json.loads(got.stdout.strip().splitlines()[-1])
    assert found["module"].startswith(str(env_dir)), found  # the wheel's kvxferd, not the checkout's
    return found


def test_a_wheel_carries_the_native_copy_and_loads_it(tmp_path):
    wheel, log = build_wheel(tmp_path)
    with zipfile.ZipFile(wheel) as z:
        libraries = [n for n in z.namelist() if n.startswith("kvxferd/datapath/_runcopy") and n.endswith(".so")]
    assert len(libraries) == 1, z.namelist()
    assert "Deprecat" not in log and "license" not in log.lower(), log[-3000:]  # no warnings of ours
    found = installed_copy_path(tmp_path, wheel)
    assert found["path"] == "native" and found["library"].endswith(Path(libraries[0]).name), found


def test_without_a_compiler_the_wheel_installs_and_says_torch_copies_run(tmp_path):
    wheel, log = build_wheel(tmp_path, {"CC": str(tmp_path / "no-such-cc"), "LDSHARED": str(tmp_path / "no-such-cc")})
    with zipfile.ZipFile(wheel) as z:
        assert not [n for n in z.namelist() if "_runcopy" in n and n.endswith(".so")]
    found = installed_copy_path(tmp_path, wheel)
    assert found["path"] == "torch" and "no C compiler" in found["reason"] and "reinstall" in found["reason"], found
