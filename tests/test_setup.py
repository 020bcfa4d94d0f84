"""The set-up files agree with each other.

pyproject.toml (loose ranges), environment.yml (conda), constraints.txt (exact pins),
the Makefile's commands in .ci/run and in the README: each is edited by hand, so these
tests catch the drift between them.
"""
from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Conda names that differ from the PyPI name of the same distribution.
CONDA_TO_PYPI = {"pytorch": "torch"}
# Allowed only on the conda side: the interpreter, pip itself, and graphviz (the `dot`
# program objgraph draws with; it has no PyPI equivalent).
CONDA_ONLY = {"python", "pip", "graphviz"}

_NAME = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)")


def normalise(name: str) -> str:
    """PEP 503 normalisation, plus conda's names for the same packages."""
    name = re.sub(r"[-_.]+", "-", name).lower()
    return CONDA_TO_PYPI.get(name, name)


def split_requirement(req: str) -> tuple[str, str]:
    """'jupyterlab >=4.2,<5' -> ('jupyterlab', '>=4.2,<5'), ignoring extras and markers."""
    match = _NAME.match(req)
    assert match, f"cannot read a package name from {req!r}"
    rest = req[match.end():].split(";")[0]
    rest = re.sub(r"^\s*\[[^\]]*\]", "", rest)
    return normalise(match.group(1)), rest.replace(" ", "")


def pyproject_requirements() -> dict[str, str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = list(project["dependencies"])
    extras = project.get("optional-dependencies", {})
    for extra in ("course", "test"):
        assert extra in extras, f"pyproject.toml lacks the [{extra}] extra"
        reqs += extras[extra]
    return dict(split_requirement(r) for r in reqs)


def _conda_dependencies_by_hand(text: str) -> list:
    """The top-level `dependencies:` list of a simple environment.yml, without PyYAML."""
    deps: list = []
    inside = False
    for line in text.splitlines():
        stripped = line.split("#", 1)[0].rstrip()
        if not stripped:
            continue
        if not line[0].isspace():
            inside = stripped == "dependencies:"
            continue
        item = re.match(r"^  - (.*)$", stripped)
        if inside and item:
            value = item.group(1).strip()
            deps.append({"pip": []} if value == "pip:" else value)
        elif inside and deps and isinstance(deps[-1], dict):
            sub = re.match(r"^\s+- (.*)$", stripped)
            if sub:
                deps[-1]["pip"].append(sub.group(1).strip())
    return deps


def conda_dependencies() -> list:
    text = (ROOT / "environment.yml").read_text()
    try:
        import yaml
    except ImportError:
        return _conda_dependencies_by_hand(text)
    return yaml.safe_load(text)["dependencies"]


def conda_requirements() -> dict[str, str]:
    reqs = {}
    for dep in conda_dependencies():
        if isinstance(dep, dict):  # the `pip:` section: installs this repository only
            continue
        # conda match specs: "python=3.11", "numpy", "jupyterlab>=4.2,<5"
        name, spec = split_requirement(str(dep))
        reqs[name] = spec
    return reqs


def constraint_pins() -> dict[str, str]:
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        assert "==" in line, f"constraints.txt: {line!r} is not an exact pin"
        name, version = line.split("==", 1)
        pins[normalise(name)] = version.strip()
    return pins


def test_environment_yml_has_the_dependencies_of_pyproject():
    pip_side = set(pyproject_requirements())
    conda_side = set(conda_requirements())
    missing_in_conda = sorted(pip_side - conda_side)
    missing_in_pip = sorted(conda_side - pip_side - CONDA_ONLY)
    assert not missing_in_conda and not missing_in_pip, (
        f"environment.yml lacks {missing_in_conda} (in pyproject.toml); "
        f"pyproject.toml lacks {missing_in_pip} (in environment.yml)"
    )


def test_environment_yml_uses_the_same_ranges_and_installs_this_package():
    pip_side = pyproject_requirements()
    conda_side = conda_requirements()
    differ = {
        name: (pip_side[name], conda_side[name])
        for name in pip_side.keys() & conda_side.keys()
        if pip_side[name] != conda_side[name]
    }
    assert not differ, f"ranges differ (pyproject.toml, environment.yml): {differ}"
    pip_sections = [d for d in conda_dependencies() if isinstance(d, dict)]
    assert pip_sections == [{"pip": ["-e ."]}], pip_sections


def test_constraints_pin_every_dependency_within_its_range():
    from packaging.specifiers import SpecifierSet

    pins = constraint_pins()
    reqs = pyproject_requirements()
    unpinned = sorted(set(reqs) - set(pins))
    assert not unpinned, f"constraints.txt does not pin {unpinned}"
    outside = {
        name: (pins[name], spec)
        for name, spec in reqs.items()
        if spec and not SpecifierSet(spec).contains(pins[name], prereleases=True)
    }
    assert not outside, f"pins outside pyproject.toml's ranges (pin, range): {outside}"
    assert "gclab" not in pins, "constraints.txt must not pin gclab itself"


# README asks for "Python 3.11": the pins must install on any 3.11, Debian 12's 3.11.2 included (soupsieve
# 4.1.2, frozen from a .venv of 3.11.7, asks for 3.11.5 or later, and `make setup` failed there).
OLDEST_PYTHON = "3.11.0"


def test_every_pin_installs_on_any_python_3_11():
    """Each pinned distribution installed in this .venv (the pin's own version) accepts OLDEST_PYTHON."""
    from importlib import metadata

    from packaging.specifiers import SpecifierSet

    refused = {}
    for name, version in constraint_pins().items():
        try:
            installed = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue            # not installed here (another platform's); its pin is checked where it is
        wanted = installed.metadata.get("Requires-Python")
        if installed.version.split("+")[0] == version and wanted and not SpecifierSet(wanted).contains(OLDEST_PYTHON):
            refused[f"{name}=={version}"] = wanted
    assert not refused, f"pins that refuse Python {OLDEST_PYTHON} (Requires-Python): {refused}"


def test_constraints_pin_torch_exactly():
    # Without a local tag: "+cpu" would not match a CUDA wheel, and an unpinned torch
    # pulls gigabytes of CUDA packages.
    assert constraint_pins().get("torch") == "2.13.0"


def test_ci_runs_make_test():
    ci = ROOT / ".ci" / "run"
    text = ci.read_text()
    assert text.startswith("#!"), ".ci/run needs a shebang"
    assert "set -euo pipefail" in text
    assert re.search(r"^\s*make test\b", text, re.MULTILINE), ".ci/run must call `make test`"
    assert ci.stat().st_mode & 0o111, ".ci/run must be executable"


def test_readme_shows_the_two_commands():
    readme = (ROOT / "README.md").read_text()
    for command in ("make lab", "make test"):
        assert command in readme, f"README.md does not show `{command}`"


def test_the_kernel_is_registered_per_checkout_as_the_notebooks_name_it():
    from gclab.grader import course
    makefile = (ROOT / "Makefile").read_text()
    installs = re.findall(r"ipykernel install .*", makefile)
    assert installs, "the Makefile registers no Jupyter kernel"
    for line in installs:
        assert "--user" not in line and "--sys-prefix" in line, f"a kernel for the whole user: {line}"
        assert f"--name {course.KERNEL_NAME}" in line and f'--display-name "{course.KERNEL_DISPLAY_NAME}"' in line
    lab = re.search(r"^lab:.*\n((?:\t.*\n)+)", makefile, re.M).group(1)
    assert 'JUPYTER_PATH="$(CURDIR)/$(VENV)/share/jupyter"' in lab
    assert "JUPYTER_CONFIG_PATH=" in lab and "$(if $(AUTHOR),autograder,lab)" in lab


def test_the_learners_lab_turns_nbgrader_off():
    import json
    server = json.loads((ROOT / "lab" / "jupyter_server_config.json").read_text())
    extensions = server["ServerApp"]["jpserver_extensions"]
    assert extensions and not any(extensions.values())
    assert all(name.startswith("nbgrader.") for name in extensions)
    assert server["KernelSpecManager"]["allowed_kernelspecs"] == ["python3"]
    page = json.loads((ROOT / "lab" / "labconfig" / "page_config.json").read_text())
    assert page["disabledExtensions"] == {"@jupyter/nbgrader": True}


def test_readme_warns_about_cuda_downloads_before_anything_else():
    readme = (ROOT / "README.md").read_text()
    command = 'make setup PIP_ARGS="--extra-index-url https://download.pytorch.org/whl/cpu"'
    assert command in readme and command in (ROOT / "Makefile").read_text()
    assert readme.index(command) < readme.index("## Lessons"), "the CPU-wheel command must come before the lessons"
    assert "several GB of CUDA packages" in readme[:readme.index("## Lessons")]
