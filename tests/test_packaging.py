"""What a user installs: dependencies bounded to the tested versions, install hints that work
without a PyPI release, and the two Triton flavours never used together."""

from __future__ import annotations

import importlib.metadata
import re
from pathlib import Path

import pytest

from flce.registry import probes

REPO = Path(__file__).resolve().parents[1]
tomllib = pytest.importorskip("tomllib", reason="tomllib is in the standard library from Python 3.11")
requirements = pytest.importorskip("packaging.requirements", reason="packaging is not installed")

# The user-facing extras and the core dependencies; the test extra's tools (pytest, ruff, ...) are
# for developers and pinned where it matters.
BOUNDED_GROUPS = ("dependencies", "triton", "ascend", "hf")


def _pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]


def _group(project: dict, name: str) -> list[str]:
    return project["dependencies"] if name == "dependencies" else project["optional-dependencies"][name]


@pytest.mark.parametrize("group", BOUNDED_GROUPS)
def test_dependencies_have_an_upper_bound(group: str) -> None:
    """An unbounded range resolves whatever is newest (torch 2.15 and the CUDA 13 stack, triton 3.9),
    none of it tested; pyproject.toml bounds each to the tested versions."""
    for text in _group(_pyproject(), group):
        requirement = requirements.Requirement(text)
        operators = {spec.operator for spec in requirement.specifier}
        if requirement.name == "pyyaml":
            continue  # a format library with a stable API; any 6.x
        assert operators & {"<", "<=", "==", "~="}, f"[{group}] {text}: no upper bound"


@pytest.mark.parametrize("name", ["torch", "triton"])
def test_the_tested_versions_satisfy_the_bounds(name: str) -> None:
    """The environment the suite runs in is inside the range pyproject.toml states."""
    project = _pyproject()
    texts = [t for g in ("dependencies", "triton") for t in _group(project, g)]
    (requirement,) = [requirements.Requirement(t) for t in texts if requirements.Requirement(t).name == name]
    try:
        installed = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        pytest.skip(f"{name} is not installed")
    assert requirement.specifier.contains(installed, prereleases=True), f"{name} {installed} outside {requirement}"


def test_install_hints_do_not_point_at_an_unpublished_package() -> None:
    """flce is not on PyPI: `pip install flce[...]` would fail (or install someone else's package)."""
    pattern = re.compile(r"pip install\s+['\"]?flce\[")
    paths = [REPO / "README.md", *sorted((REPO / "flce").rglob("*.py")), *sorted((REPO / "docs").glob("*.md"))]
    offenders = [f"{path.relative_to(REPO)}:{number}" for path in paths
                 for number, line in enumerate(path.read_text().splitlines(), 1) if pattern.search(line)]
    assert not offenders, f"install hints for a PyPI package that does not exist: {offenders}"


@pytest.mark.parametrize("installed", [{"triton": "3.6.0"}, {"triton-ascend": "3.2.0"},
                                       {"triton": "3.6.0", "triton-ascend": "3.2.0"}])
def test_both_triton_flavours_make_triton_unavailable(monkeypatch: pytest.MonkeyPatch, installed: dict) -> None:
    def version(name: str) -> str:
        if name not in installed:
            raise importlib.metadata.PackageNotFoundError(name)
        return installed[name]

    monkeypatch.setattr(probes.importlib.metadata, "version", version)
    monkeypatch.setattr(probes.importlib.util, "find_spec", lambda name: object() if name == "triton" else None)
    present, reason = probes._probe_triton()
    if len(installed) == 1:
        assert present and probes.triton_flavour_clash() is None
    else:
        assert not present
        assert "both triton 3.6.0 and triton-ascend 3.2.0 are installed" in reason and "pip uninstall" in reason


def test_tools_readme_lists_every_script() -> None:
    """tools/README.md is where a reader finds a measurement: each script under tools/ has its row there."""
    tools = REPO / "tools"
    listed = (tools / "README.md").read_text()
    scripts = [p for p in tools.rglob("*") if p.suffix in (".py", ".sh") and p.name != "__init__.py"]
    assert scripts
    missing = [str(p.relative_to(tools)) for p in scripts if f"`{p.name}`" not in listed]
    assert not missing, f"tools/README.md has no row for {missing}"


def test_the_license_is_an_spdx_expression_that_the_build_requirement_can_read() -> None:
    """`license = {text = ...}` is deprecated by setuptools (an error from 2027-02-18); the SPDX string
    form needs setuptools >= 77, which [build-system] must then require. Applying the configuration
    with the installed setuptools (what a wheel build does first, offline) warns about nothing."""
    import warnings

    setuptools = pytest.importorskip("setuptools")
    from setuptools.config.pyprojecttoml import apply_configuration
    from setuptools.dist import Distribution

    toml = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert toml["project"]["license"] == "Apache-2.0"
    (build_requirement,) = [requirements.Requirement(r) for r in toml["build-system"]["requires"]
                            if requirements.Requirement(r).name == "setuptools"]
    assert not build_requirement.specifier.contains("76.9"), f"{build_requirement} admits a setuptools before 77"
    assert build_requirement.specifier.contains(setuptools.__version__), (
        f"the installed setuptools {setuptools.__version__} is outside {build_requirement}")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        distribution = apply_configuration(Distribution(), REPO / "pyproject.toml")
    assert not [str(w.message).splitlines()[0] for w in caught if "license" in str(w.message).lower()]
    assert distribution.metadata.license_expression == "Apache-2.0"
