"""Output styles of the answer-writing agents (solution writers and verifiers).

``paper``: the TMAS paper's layout (a complete, fully justified solution under ``## Solution``; a step-by-step
analysis before the score). ``concise``: a short justification with the answer (or score) on the last line, for small
models that otherwise spend their token budget before reaching the answer. The instructions stay the same.
"""

from __future__ import annotations

from typing import Literal

Style = Literal["paper", "concise"]
