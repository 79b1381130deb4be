"""The package versions this library supports, and the check ``AsyncCheckpointIO`` runs when it is made.

The ranges are the ones ``pyproject.toml`` declares and ``make test-compat`` tests at their corners (see
docs/compatibility.md). Below them saves are written that this library cannot load back
(torch 2.6 and older, Lightning 2.5), so the constructor refuses at once, before any save, naming the
package, the installed version, the range and the pip command that fixes it.

Versions are compared on their release numbers only, so pre-release and local builds of a supported
release (NVIDIA's containers ship e.g. ``torch 2.6.0a0+ecf3bae40a``) pass.
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_asyncckpt.errors import UnsupportedVersionError

__all__ = ["ENGINE_PACKAGES", "SUPPORTED", "Range", "check", "check_installed", "installed_version", "problem"]


@dataclass(frozen=True)
class Range:
    """``minimum <= version < below`` on release numbers; ``below=None`` has no upper bound."""

    minimum: str
    below: str | None = None
    reason: str = ""

    def spec(self) -> str:
        return f">={self.minimum}" + (f",<{self.below}" if self.below else "")


# keep in step with pyproject.toml (tests/test_versions.py checks that they agree)
SUPPORTED: dict[str, Range] = {
    # torch 2.6 and older: dcp.load has no no_dist, so a checkpoint directory cannot be read back on one rank
    # while a process group is up
    "torch": Range("2.7", reason="its DCP cannot read back the checkpoint directories this library writes"),
    # Lightning 2.5: TorchCheckpointIO.load_checkpoint has no weights_only, which loading.load passes on
    "lightning": Range("2.6", reason="its TorchCheckpointIO.load_checkpoint takes no weights_only"),
    "pytorch-lightning": Range("2.6", reason="its TorchCheckpointIO.load_checkpoint takes no weights_only"),
    "nvidia-resiliency-ext": Range("0.4.1", "0.8"),
    "megatron-core": Range("0.13"),
}

ENGINE_PACKAGES = {"nvrx": "nvidia-resiliency-ext", "mcore": "megatron-core"}


def _release(version: str) -> tuple[int, ...]:
    from packaging.version import Version

    release = Version(version).release
    return release + (0,) * (4 - len(release))


def problem(package: str, version: str) -> str | None:
    """The error message for ``package`` at ``version``, or ``None`` when it is supported. Pure."""
    allowed = SUPPORTED[package]
    have = _release(version)
    if have >= _release(allowed.minimum) and (allowed.below is None or have < _release(allowed.below)):
        return None
    spec = allowed.spec()
    why = f" ({allowed.reason})" if allowed.reason and have < _release(allowed.minimum) else ""
    return (
        f"lightning-asyncckpt supports {package}{spec}, but {package} {version} is installed{why}."
        f" Fix: pip install '{package}{spec}'"
    )


def check(package: str, version: str) -> None:
    """Raises :class:`~lightning_asyncckpt.errors.UnsupportedVersionError` unless ``version`` is supported."""
    message = problem(package, version)
    if message is not None:
        raise UnsupportedVersionError(message)


def installed_version(package: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    if package == "torch":  # also right for torch built from source without package metadata
        import torch

        return torch.__version__
    try:
        return version(package)
    except PackageNotFoundError:
        return None


def check_installed(*packages: str) -> None:
    """Checks the installed versions of ``packages`` (those not installed are skipped: other code says
    which are needed)."""
    for package in packages:
        version = installed_version(package)
        if version is not None:
            check(package, version)
