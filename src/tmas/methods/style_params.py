"""The ``style`` parameter shared by the methods whose agents write answers or scores (see :mod:`tmas.agents.style`).

``style = "concise"`` sets every such role of the method; ``style = {"verifier": "concise"}`` sets one role and
leaves the others at ``"paper"``. A role the method does not have is an error, not a silently ignored setting.
"""

from __future__ import annotations

from typing import ClassVar

from pydantic import model_validator

from tmas.agents.style import Style
from tmas.methods.base import MethodParams


class StyledParams(MethodParams):
    # The method's roles whose prompts have an output style.
    style_roles: ClassVar[tuple[str, ...]] = ("solution",)

    style: Style | dict[str, Style] = "paper"

    @model_validator(mode="after")
    def _known_style_roles(self) -> StyledParams:
        if isinstance(self.style, dict):
            unknown = sorted(set(self.style) - set(self.style_roles))
            if unknown:
                raise ValueError(
                    f"style for unknown roles {unknown} (roles with a style: {', '.join(self.style_roles)})"
                )
        return self

    def style_of(self, role: str) -> Style:
        return self.style if isinstance(self.style, str) else self.style.get(role, "paper")
