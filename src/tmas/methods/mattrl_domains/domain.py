"""What a MATTRL domain declares (paper 003, sections 3-5 and appendices A-C): everything that differs between
math, medicine and education, in one object per domain, so nothing else compares a domain's name.

A domain is a :class:`Domain` subclass in a module of its own (``mathematics``, ``medicine``, ``education``), listed
in :data:`tmas.methods.mattrl_domains.DOMAINS`; ``docs/domains.md`` walks through adding one. The method, the
graders, the pool (credit, scoring, distilling, retrieval) and the router read these members:

- Stage I, the team: ``catalog`` (the specialties the coordinator may recruit; empty: any), the ``line_up`` used
  when no usable team comes back, the team's rule (:meth:`Domain.parse_team`: one leader, or C.4.2's teaching
  roles), and the specialists' ``system_name``;
- Stage II: the prompts of an opinion, how an opinion states its answer, and the ``review`` step (a
  :class:`tmas.methods.mattrl_deliberation.PeerReview`); a ``teaching`` domain runs C.1's teaching dialogue instead
  of deliberating (:mod:`tmas.methods.mattrl_teaching`);
- Stage III: the decision's prompts and how it is read, and what stands in when it cannot be read;
- grading: the ``grader`` of its own metrics (by name, in ``tmas.grading.registry``; None: graded by its answer)
  and the ``metrics`` it reports, each with its column in the report's table, and the report's ``metrics_note``;
- the pool: the terminal outcome G of Eq. 12 (``outcome``), Eq. 10's direction under ``decay = "auto"``
  (``credit_decay``), where a build's top quantile of turns is taken (``quantile_within``), how entries are keyed
  for retrieval (:meth:`Domain.retrieval_tier`) and what the adaptive router reads of a case
  (:meth:`Domain.case_features`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, ClassVar, Literal

from pydantic import BaseModel

from tmas.agents.mattrl_decision import Decision, decision_prompt, rewrite_prompt
from tmas.agents.mattrl_opinion import opinion_prompt
from tmas.agents.mattrl_team import led_team, line_up_team, read_recruits, recruit_prompt, team_reply_model
from tmas.llm.types import Message
from tmas.memory.pool_entry import PoolEntry
from tmas.memory.transcript import TeamMember
from tmas.methods.mattrl_deliberation import PeerReview

# A pool entry's retrieval tier for one specialist's search (lower first, None: never retrieved).
Tier = Callable[[PoolEntry], int | None]


class Domain:
    """One of MATTRL's domains. Subclasses set the class members and override what their domain does otherwise."""

    name: ClassVar[str]
    # ---- Stage I: the team
    catalog: ClassVar[tuple[str, ...]] = ()
    # The roles a member may have (empty: any, as recruited).
    team_roles: ClassVar[tuple[str, ...]] = ()
    # (specialty, role, description) of the default team, the first leading unless the domain says otherwise.
    line_up: ClassVar[tuple[tuple[str, str, str], ...]]
    # The system text of the specialists (and of the coordinator's calls about the case), so they share one prefix.
    system_name: ClassVar[str | None] = None
    # ---- Stage II
    # The peer review between opinions (None for a teaching domain).
    review: ClassVar[type[PeerReview] | None] = None
    # The solution step's mode for an opinion (methods/steps.py: ``numeric`` extracts a boxed answer).
    answer_mode: ClassVar[str] = "numeric"
    # C.1: a pre-test, a teaching dialogue by the team, a post-test, instead of a deliberation.
    teaching: ClassVar[bool] = False
    # ---- grading: the grader of the domain's own metrics (None: graded by its answer), metric key -> its column,
    # and what the report says of them (one paragraph).
    grader: ClassVar[str | None] = None
    metrics: ClassVar[Mapping[str, str]] = {}
    metrics_note: ClassVar[str] = ""
    # ---- the pool: G of Eq. 12 (the graded answer, or the reciprocal rank of the gold answer in the decision's
    # ranked list), and Eq. 10's direction when a build says "auto".
    outcome: ClassVar[Literal["graded", "reciprocal_rank"]] = "graded"
    credit_decay: ClassVar[Literal["later", "earlier"]] = "later"
    # Where a build's top quantile is taken: over every turn of every case (section 4.1: "for all utterance from
    # agents"), or within each case (C.1: "from each scored teaching interaction").
    quantile_within: ClassVar[Literal["all", "case"]] = "all"

    # ---- Stage I --------------------------------------------------------------------------------------------
    def recruit_prompt(self, question: str, n: int) -> list[Message]:
        return recruit_prompt(question, self.name, n, catalog=self.catalog, system_name=self.system_name)

    def team_reply(self, n: int) -> type[BaseModel]:
        """The recruiting reply's JSON schema: at most ``n`` members, of the catalog's specialties and the domain's
        roles where it names them."""
        return team_reply_model(n, self.catalog, self.team_roles)

    def parse_team(self, content: str, n: int) -> tuple[list[TeamMember], list[str]]:
        """The team of a recruiting reply (ids S1, S2, ... in reply order) and notes on every repair; raises
        :class:`tmas.agents.output.AgentOutputError` when no member is usable."""
        recruits, notes = read_recruits(content, self.catalog, self.name)
        return led_team(recruits, n, notes), notes

    def default_team(self, n: int, metadata: Mapping[str, Any]) -> list[TeamMember]:
        """The team used when the coordinator's replies give none: the first ``n`` of the line-up."""
        return line_up_team(self.line_up, n, led=True)

    def member_role(self, role: str) -> str:
        """The role a member's turns are credited and keyed under (as recruited, unless the domain names roles)."""
        return role

    # ---- Stage II -------------------------------------------------------------------------------------------
    def opinion_prompt(self, question: str, member: TeamMember, **context: Any) -> list[Message]:
        return opinion_prompt(question, member, self.name, system_name=self.system_name, **context)

    def opinion_answer(self, content: str) -> str | None:
        """The answer an opinion states."""
        raise NotImplementedError(f"domain {self.name!r} states no answers in opinions")

    def retrieval_tier(self, member: TeamMember, metadata: Mapping[str, Any]) -> Tier | None:
        """How the pool ranks entries for ``member`` on a case with ``metadata`` before cosine similarity (None:
        by similarity alone). By default only the domain's own entries, by similarity: a pool built from runs of
        several domains never gives one domain's lessons to another's specialists."""
        name = self.name
        return lambda entry: 0 if entry.domain == name else None

    # ---- Stage III ------------------------------------------------------------------------------------------
    def decision_prompt(self, question: str, summary: str) -> list[Message]:
        return decision_prompt(question, self.name, summary, system_name=self.system_name)

    def rewrite_prompt(self, reply: str) -> list[Message]:
        return rewrite_prompt(reply, self.name)

    def parse_decision(self, content: str) -> Decision | None:
        """The decision in its tags; None when they are missing (the method then asks for a rewrite)."""
        raise NotImplementedError(f"domain {self.name!r} makes no decision")

    def decision_fallback(self, content: str) -> str | None:
        """An answer read from a decision reply whose tags are missing even after the rewrite (None: none)."""
        return None

    # ---- the router -----------------------------------------------------------------------------------------
    def case_features(self, question: str, metadata: Mapping[str, Any]) -> dict[str, float]:
        """What the adaptive router (paper 003, 5.2) reads of a case, from its text and metadata alone."""
        raise NotImplementedError(f"domain {self.name!r} declares no router features")
