"""The repository root is safe to work in, and the package installs from a wheel as it runs from source.

Nothing in the root may shadow a standard-library module or an installed distribution whatever the
current directory: ``operator/`` and ``kernels/`` are namespace portions (no ``__init__.py``), which lose
to the standard library's own ``operator`` module and to the ``kernels`` distribution (which
transformers imports) on import, while ``kvpilot.operator`` and ``kvpilot.kernels`` still map to them.
"""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _importable_names(folder: Path) -> dict[str, Path]:
    """What ``import NAME`` finds in ``folder`` ahead of the standard library: modules and regular
    packages (a folder without ``__init__.py`` is a namespace portion and never wins over a module)."""
    found = {}
    for entry in folder.iterdir():
        if entry.is_file() and entry.suffix == ".py":
            found[entry.stem] = entry
        elif entry.is_dir() and (entry / "__init__.py").is_file():
            found[entry.name] = entry
    return found


def test_nothing_in_the_root_shadows_a_standard_library_module():
    shadowing = {
        name: str(path.relative_to(REPO))
        for name, path in _importable_names(REPO).items()
        if name in sys.stdlib_module_names
    }
    assert shadowing == {}
    # The one room whose name is a standard-library module stays a namespace portion.
    assert "operator" in sys.stdlib_module_names
    assert (REPO / "operator").is_dir() and not (REPO / "operator" / "__init__.py").exists()


def test_nothing_in_the_root_shadows_an_installed_distribution():
    # pytest puts the root on sys.path (tests/ is a package), and so does `python -m` started there: a
    # regular package of the root would be imported in place of any installed package of its name.
    installed = importlib.metadata.packages_distributions()
    shadowing = {
        name: installed[name] for name in _importable_names(REPO) if name in installed and name != "kvpilot"
    }
    assert shadowing == {}
    # transformers imports the `kernels` distribution (a dependency from 5.25 on) when it loads a model
    # class; the kernels room stays a namespace portion whether that distribution is installed or not.
    assert (REPO / "kernels").is_dir() and not (REPO / "kernels" / "__init__.py").exists()


def test_transformers_loads_a_model_class_with_the_root_first_on_sys_path():
    code = (
        "import sys, importlib.util\n"
        f"sys.path.insert(0, {str(REPO)!r})\n"
        "spec = importlib.util.find_spec('kernels')\n"
        "import transformers\n"
        "transformers.LlamaConfig\n"
        "print(spec.origin if spec else None)"
    )
    probe = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=300
    )
    assert probe.returncode == 0, probe.stderr[-2000:]
    # None: no `kernels` distribution and the room's namespace portion; else the distribution's own.
    origin = probe.stdout.split()[-1]
    assert origin == "None" or Path(origin).parent != REPO / "kernels", origin


@pytest.fixture(scope="module")
def bare_venv(tmp_path_factory) -> Path:
    """A fresh virtual environment with nothing but pip, as a new user creates one."""
    where = tmp_path_factory.mktemp("bare-venv") / "venv"
    base = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base, "-m", "venv", str(where)], check=True, cwd=REPO, timeout=300)
    return where / "bin" / "python"


def test_a_bare_venv_works_in_the_repository_root(bare_venv):
    # `python -m pip` imports runpy, which imports the standard library's operator module.
    pip = subprocess.run(
        [str(bare_venv), "-m", "pip", "--version"], capture_output=True, text=True, cwd=REPO, timeout=120
    )
    assert pip.returncode == 0, pip.stderr
    probe = subprocess.run(
        [str(bare_venv), "-c", "import operator; print(operator.eq(1, 1), operator.__file__)"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
    )
    assert probe.returncode == 0, probe.stderr
    ok, where = probe.stdout.split()
    assert ok == "True" and not where.startswith(str(REPO))
    # A venv created from the root works too (`make test`'s first step when python3 is a venv's).
    nested = subprocess.run(
        [str(bare_venv), "-m", "venv", "--without-pip", str(bare_venv.parents[1] / "nested")],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert nested.returncode == 0, nested.stderr


def test_the_project_venv_imports_every_room_from_the_root():
    code = (
        "import operator, kvpilot.operator.api.names as n, kvpilot.engine.config as c\n"
        "import kvpilot.kernels.backend as k\n"
        "print(operator.eq(2, 2), n.__file__, c.__file__, k.__file__)"
    )
    probe = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120
    )
    assert probe.returncode == 0, probe.stderr
    ok, *files = probe.stdout.split()
    assert ok == "True"
    assert [Path(f).relative_to(REPO).parts[0] for f in files] == ["operator", "engine", "kernels"]
    run_module = subprocess.run(
        [sys.executable, "-m", "kvpilot.operator", "--help"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert run_module.returncode == 0, run_module.stderr
    assert "operator" in run_module.stdout


def test_the_wheel_holds_every_room_and_imports_without_the_checkout(tmp_path):
    # Built from a copy of what the Dockerfile's wheel stage copies: setuptools builds in the source
    # tree's build/, which would keep files since removed from the checkout (and leave it behind).
    source = tmp_path / "src"
    for name in ("pyproject.toml", "README.md"):
        source.mkdir(exist_ok=True)
        shutil.copy2(REPO / name, source / name)
    for room in ("kvpilot", "engine", "kernels", "operator"):
        shutil.copytree(REPO / room, source / room, ignore=shutil.ignore_patterns("__pycache__"))
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path / "dist"), str(source)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=600,
    )
    assert build.returncode == 0, build.stderr
    (wheel,) = (tmp_path / "dist").glob("kvpilot-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = {
        str(path.relative_to(REPO).with_name(path.name)).replace(os.sep, "/")
        for room in ("engine", "kernels", "operator")
        for path in (REPO / room).rglob("*.py")
        if "__pycache__" not in path.parts
    }
    in_wheel = {n.removeprefix("kvpilot/") for n in names if n.startswith("kvpilot/") and n.endswith(".py")}
    assert expected <= in_wheel, sorted(expected - in_wheel)[:10]
    assert "kvpilot/operator/__init__.py" not in names and "kvpilot/kernels/__init__.py" not in names
    # The CPU attention kernel builds from its sources on first use: they ship in the wheel.
    sources = {
        f"kvpilot/kernels/{p.relative_to(REPO / 'kernels')}" for p in (REPO / "kernels" / "csrc").iterdir()
    }
    assert sources and sources <= names, sorted(sources - names)

    target = tmp_path / "site"
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(target)
    code = (
        "import kvpilot, kvpilot.operator.api.names as n, kvpilot.operator.remediation.policy as p\n"
        "import kvpilot.kernels.backend as k\n"
        "print(kvpilot.__path__[0], n.__file__, p.__file__, k.__file__)"
    )
    env = {**os.environ, "PYTHONPATH": str(target)}
    probe = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120
    )
    assert probe.returncode == 0, probe.stderr
    assert all(path.startswith(str(target)) for path in probe.stdout.split()), probe.stdout
