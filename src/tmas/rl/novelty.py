"""The guideline judge behind the exploration reward (eq. 9), on the project's LLM client.

Each exploration rollout is judged by one call of the ``judge`` role (its own endpoint under ``[roles.judge]``).
Calls of a batch run concurrently. With a ``store_dir`` every call is kept in a run store, so a restarted training
run replays the verdicts it already paid for. A failed call or an unusable reply is recorded as the outcome's note
and the rollout counts as known (n_i = 0), as does a verdict of -1.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Sequence
from pathlib import Path

from tmas.agents.guideline_judge import NoveltyReply, judge_prompt, parse_novelty
from tmas.agents.output import AgentOutputError
from tmas.config import Settings
from tmas.llm.factory import open_model
from tmas.llm.model import ChatModel
from tmas.llm.types import CallKey
from tmas.rl.scoring import JudgeOutcome, RolloutInput
from tmas.store.run_store import RunStore

ROLE = "judge"


class LLMNoveltyJudge:
    """The judge on the ``judge`` role of ``settings``' endpoint, or on ``model``, a
    :class:`tmas.llm.model.ChatModel` of the caller's own; with ``store_dir`` its calls are kept and replayed."""

    def __init__(self, settings: Settings, store_dir: Path | None = None, *, model: ChatModel | None = None) -> None:
        self.settings = settings
        self.store_dir = store_dir
        self.model = model

    def __call__(self, rollouts: Sequence[RolloutInput]) -> list[JudgeOutcome]:
        """Synchronous, as trainers call reward functions; from inside a running event loop it uses a thread."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return asyncio.run(self.judge(rollouts))
        with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
            return pool.submit(asyncio.run, self.judge(rollouts)).result()

    async def judge(self, rollouts: Sequence[RolloutInput]) -> list[JudgeOutcome]:
        store = RunStore(self.store_dir) if self.store_dir is not None else None
        try:
            async with open_model(self.settings, store, log_dir=self.store_dir, model=self.model) as llm:
                return list(await asyncio.gather(*(self._one(llm, r) for r in rollouts)))
        finally:
            if store is not None:
                store.close()

    async def _one(self, llm: ChatModel, rollout: RolloutInput) -> JudgeOutcome:
        messages = judge_prompt(rollout.question, rollout.strategies, rollout.completion)
        key = CallKey(role=ROLE, problem_id=rollout.group)
        reply = await llm.chat(ROLE, messages, key=key, reply_model=NoveltyReply)
        if not reply.ok:
            return JudgeOutcome(novelty=None, note=f"judge call failed: {reply.error}; counted as known")
        try:
            verdict = parse_novelty(reply.content, truncated=reply.truncated)
        except AgentOutputError as exc:
            return JudgeOutcome(novelty=None, note=f"judge reply unusable ({exc}): counted as known")
        return JudgeOutcome(novelty=verdict.novelty)
