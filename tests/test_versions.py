"""The supported-version check: the pure logic on version strings, the installed stack, the constructor."""

import re
from pathlib import Path

import pytest

from lightning_asyncckpt import AsyncCheckpointIO
from lightning_asyncckpt.errors import UnsupportedVersionError
from lightning_asyncckpt.integration import versions


@pytest.mark.parametrize(("package", "version"), [
    ("torch", "2.7.0"), ("torch", "2.7.1+cu126"), ("torch", "2.7.0a0+7c8ec84dab"),  # NVIDIA container builds
    ("torch", "2.14.1"), ("torch", "2.13.0+cpu"), ("torch", "3.0.0"),
    ("lightning", "2.6.0"), ("lightning", "2.6.6"),
    ("nvidia-resiliency-ext", "0.4.1"), ("nvidia-resiliency-ext", "0.7.0"),
    ("megatron-core", "0.13.0"), ("megatron-core", "0.16.1"),
])
def test_supported_versions_pass(package, version):
    assert versions.problem(package, version) is None
    versions.check(package, version)


@pytest.mark.parametrize(("package", "version", "fix"), [
    ("torch", "2.6.0", "pip install 'torch>=2.7'"),
    ("torch", "2.6.0a0+ecf3bae40a", "pip install 'torch>=2.7'"),
    ("torch", "2.4.1+cu121", "pip install 'torch>=2.7'"),
    ("lightning", "2.5.0.post0", "pip install 'lightning>=2.6'"),
    ("nvidia-resiliency-ext", "0.4.0", "pip install 'nvidia-resiliency-ext>=0.4.1,<0.8'"),
    ("nvidia-resiliency-ext", "0.8.0", "pip install 'nvidia-resiliency-ext>=0.4.1,<0.8'"),
    ("megatron-core", "0.12.3", "pip install 'megatron-core>=0.13'"),
])
def test_unsupported_versions_name_package_version_range_and_fix(package, version, fix):
    with pytest.raises(UnsupportedVersionError) as info:
        versions.check(package, version)
    message = str(info.value)
    assert f"{package} {version} is installed" in message
    assert f"supports {package}{versions.SUPPORTED[package].spec()}" in message
    assert message.endswith(fix)
    assert isinstance(info.value, ImportError)


def test_the_installed_stack_is_supported():
    versions.check_installed(*versions.SUPPORTED)


@pytest.mark.parametrize(("package", "strategy"), [
    ("torch", "nvrx"), ("lightning", "nvrx"), ("nvidia-resiliency-ext", "nvrx"), ("megatron-core", "mcore"),
])
def test_constructor_refuses_an_unsupported_version_at_once(monkeypatch, package, strategy):
    real = versions.installed_version
    old = {"torch": "2.6.0", "lightning": "2.5.6", "nvidia-resiliency-ext": "0.4.0", "megatron-core": "0.12.3"}
    monkeypatch.setattr(versions, "installed_version", lambda p: old[p] if p == package else real(p))
    with pytest.raises(UnsupportedVersionError, match=re.escape(f"{package} {old[package]} is installed")):
        AsyncCheckpointIO(strategy)


def test_the_ranges_are_the_ones_pyproject_declares():
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    declared = project["dependencies"] + extras["mcore"] + extras["lightning"] + extras["pytorch-lightning"]
    for package, allowed in versions.SUPPORTED.items():
        assert f"{package}{allowed.spec()}" in declared, package


def test_an_unsupported_installed_stack_is_refused_at_construction():
    """For `make test-compat`'s `below` corner (a stack under the floors): the real constructor refuses it
    before anything starts. Skipped on a supported stack."""
    installed = {p: versions.installed_version(p) for p in ("torch", "lightning", "nvidia-resiliency-ext")}
    problems = [m for p, v in installed.items() if v and (m := versions.problem(p, v))]
    if not problems:
        pytest.skip("the installed stack is supported")
    with pytest.raises(UnsupportedVersionError, match=re.escape(problems[0])):
        AsyncCheckpointIO("nvrx")
