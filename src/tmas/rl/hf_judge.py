"""The guideline judge of eq. 9 on a frozen model in-process with transformers, where no judge endpoint runs.

The judge must never be the policy being trained (its verdicts would move with the weights it rewards): ``tmas rl
train --judge-model`` loads a separate, frozen copy, typically the base model. It reads the same prompt and parses
the same reply as :class:`tmas.rl.novelty.LLMNoveltyJudge`, greedily, one batch per call; an unusable reply counts
as known (n_i = 0) with its note, as an endpoint's does.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tmas.agents.guideline_judge import judge_prompt, parse_novelty
from tmas.agents.output import AgentOutputError
from tmas.rl.hf_generate import GenerationSettings, generate
from tmas.rl.scoring import JudgeOutcome, RolloutInput

# The reply is a short JSON object (identified strategy, verdict, the entry it matches).
JUDGE_MAX_TOKENS = 256


class TransformersNoveltyJudge:
    def __init__(self, model: Any, tokenizer: Any, max_new_tokens: int = JUDGE_MAX_TOKENS) -> None:
        model.eval()
        for parameter in model.parameters():
            parameter.requires_grad_(False)
        self.model = model
        self.tokenizer = tokenizer
        self.settings = GenerationSettings(temperature=0.0, max_new_tokens=max_new_tokens, batch_size=32)

    def __call__(self, rollouts: Sequence[RolloutInput]) -> list[JudgeOutcome]:
        if not rollouts:
            return []
        conversations = [
            [{"role": m.role, "content": m.content} for m in judge_prompt(r.question, list(r.strategies), r.completion)]
            for r in rollouts
        ]
        replies = generate(self.model, self.tokenizer, conversations, self.settings)
        outcomes = []
        for reply in replies:
            try:
                verdict = parse_novelty(reply.text, truncated=reply.cut)
            except AgentOutputError as exc:
                outcomes.append(JudgeOutcome(novelty=None, note=f"judge reply unusable ({exc}): counted as known"))
                continue
            outcomes.append(JudgeOutcome(novelty=verdict.novelty))
        return outcomes


def load_judge(spec: str) -> TransformersNoveltyJudge:
    """A frozen judge from a model spec (Hugging Face checkpoint directory, GGUF file or embedded model name), on
    the GPU in bfloat16 when there is one."""
    import torch

    from tmas.rl.trl_train import load_policy

    model, tokenizer = load_policy(spec)
    if torch.cuda.is_available():
        model = model.to(device="cuda", dtype=torch.bfloat16)
    return TransformersNoveltyJudge(model, tokenizer)
