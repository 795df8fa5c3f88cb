"""MATTRL's domains, each declared whole in a module of its own (:class:`Domain`): the method, the graders, the pool
and the router read a domain's declaration and never compare its name (``tests/test_mattrl_domain_names.py``).
A new domain is a module here and an entry in :data:`DOMAINS` (``docs/domains.md``)."""

from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator

from tmas.errors import ConfigError
from tmas.methods.mattrl_domains.domain import Domain
from tmas.methods.mattrl_domains.education import Education
from tmas.methods.mattrl_domains.mathematics import Mathematics
from tmas.methods.mattrl_domains.medicine import Medicine

DOMAINS: dict[str, Domain] = {d.name: d for d in (Mathematics(), Medicine(), Education())}
# The domain of a transcript, router or pool entry that names none (written before domains were recorded).
DEFAULT_DOMAIN = Mathematics.name


def domain_names() -> str:
    """The declared domains' names, for help texts and errors."""
    return ", ".join(DOMAINS)


def domain_named(name: str) -> Domain:
    """The declaration of domain ``name``; an unknown name is a one-line ConfigError naming the known ones."""
    found = DOMAINS.get(name)
    if found is None:
        raise ConfigError(f"unknown MATTRL domain {name!r} (known: {domain_names()})")
    return found


def _known(name: str) -> str:
    if name not in DOMAINS:
        raise ValueError(f"unknown MATTRL domain {name!r} (known: {domain_names()})")
    return name


# A domain's name in a pydantic model (MATTRL's ``domain`` parameter), checked against the declarations.
DomainName = Annotated[str, AfterValidator(_known)]

__all__ = ["DEFAULT_DOMAIN", "DOMAINS", "Domain", "DomainName", "domain_named", "domain_names"]
