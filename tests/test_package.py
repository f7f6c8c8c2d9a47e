"""The package installs as a package (issue 43): the wheel `pip wheel .` builds holds every module and data file of
job/, and a fresh environment that installs that wheel (not the editable checkout) imports every module and runs
`python -m job --help`.

The fresh environment gets the wheel with --no-deps and its dependencies (torch, vLLM, Ray: ~7 GB, no network here)
from .venv's site-packages through a `.pth` line. A path line in a .pth file is only added to sys.path; the .pth
files inside that path (the editable install's finder, `__editable___drafter_datagen_*.pth`) are not run, so `job`
can only come from the wheel: the test checks `job.__file__` to be sure. ~10 s on 2 cores (the wheel ~2 s, the
imports ~6 s)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest
from conftest import REPO

JOB = REPO / "job"


def _source_files() -> set[str]:
    """Every file of job/ the package must ship: its modules and the data files beside them (no caches)."""
    return {p.relative_to(REPO).as_posix() for p in JOB.rglob("*")
            if p.is_file() and "__pycache__" not in p.parts and p.suffix not in (".pyc", ".pyo")}


def _installer(venv_python: Path, wheel: Path) -> list[str]:
    uv = Path(sys.executable).parent / "uv"  # `make install` puts uv into .venv; pip --python is the fallback
    if uv.exists():
        return [str(uv), "pip", "install", "--quiet", "--no-deps", "--python", str(venv_python), str(wheel)]
    return [sys.executable, "-m", "pip", "--python", str(venv_python), "install", "--quiet", "--no-deps",
            str(wheel)]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel built from a copy of the checkout's pyproject.toml and job/ (a build in the checkout would leave
    build/ and egg-info beside the sources)."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    src.mkdir()
    shutil.copy(REPO / "pyproject.toml", src)
    shutil.copytree(JOB, src / "job", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                    "--wheel-dir", str(tmp / "dist"), "./src"], cwd=tmp, check=True, timeout=300)
    (found,) = (tmp / "dist").glob("drafter_datagen-*.whl")
    return found


def test_the_wheel_holds_every_module_and_data_file(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    missing = sorted(_source_files() - names)
    assert not missing, f"{wheel.name} lacks {len(missing)} file(s) of job/: {missing}"
    # The stages and the files they read at run time, by name: what a packaging slip lost before.
    for must in ("job/generate/run.py", "job/hidden_states/run.py", "job/export/__init__.py",
                 "job/runview/plan.py", "job/trainers/__main__.py", "job/builtin/data/corpus.txt",
                 "job/builtin/data/chat_template.jinja", "job/trainers/requirements.txt"):
        assert must in names, must
    entry_points = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert "drafter-datagen = job.cli:main" in entry_points


def test_a_fresh_environment_runs_the_installed_wheel(wheel, tmp_path):
    venv = tmp_path / "fresh"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    subprocess.run(_installer(python, wheel), check=True, timeout=300)
    fresh_site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                     capture_output=True, text=True, check=True).stdout.strip())
    (fresh_site / "zz_dependencies_from_dot_venv.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")

    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    code = """
import importlib, pkgutil, sys
import job
assert job.__file__.startswith(sys.argv[1]), f"job imported from {job.__file__}, not from the installed wheel"
names = [m.name for m in pkgutil.walk_packages(job.__path__, "job.")]
for name in names:
    importlib.import_module(name)
print(len(names), "modules")
from job.builtin.corpus import CORPUS_PATH
from job.builtin.tokenizer import CHAT_TEMPLATE_PATH
assert CORPUS_PATH.stat().st_size > 0 and CHAT_TEMPLATE_PATH.read_text().strip()
"""
    # cwd outside the checkout: `python -c` and `-m` put the current directory first on sys.path.
    proc = subprocess.run([str(python), "-c", code, str(fresh_site)], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    modules = int(proc.stdout.split()[0])
    expected = sum(1 for f in _source_files() if f.endswith(".py")) - 1  # every module but job/__init__.py itself
    assert modules == expected, proc.stdout

    for argv in (["-m", "job", "--help"], ["-m", "job", "generate", "--help"], ["-m", "job", "plan", "--help"]):
        proc = subprocess.run([str(python), *argv], cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=120)
        assert proc.returncode == 0 and "usage: python -m job" in proc.stdout, proc.stderr[-3000:]
    assert "hidden-states" in subprocess.run([str(venv / "bin" / "drafter-datagen"), "--help"], cwd=tmp_path,
                                             env=env, capture_output=True, text=True, timeout=120).stdout
