"""tmas: multi-agent test-time scaling of LLM reasoning on any OpenAI-compatible endpoint."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tmas.version import __version__

if TYPE_CHECKING:
    from tmas.api import asolve, solve
    from tmas.config import Settings, load_settings

__all__ = ["Settings", "__version__", "asolve", "load_settings", "solve"]


def __getattr__(name: str) -> Any:
    # Lazy, so that `import tmas` (and the CLI's --version) stays cheap.
    if name == "api":
        import tmas.api

        return tmas.api
    if name in ("solve", "asolve"):
        from tmas import api

        return getattr(api, name)
    if name in ("Settings", "load_settings"):
        from tmas import config

        return getattr(config, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
