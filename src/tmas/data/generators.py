"""Verifiable problem families: questions whose answers are computed by code, so runs can be graded offline.

Each family turns ``(rng, level)`` into a question, its exact answer and the parameters that determine it (kept in
the metadata so a test can recompute the answer by brute force). Answers here use the fast method (a DP, a closed
form, fast exponentiation); the test suite checks them against naive enumeration.

Levels run from 1 (a small model can do it by hand) to 5 (needs a real method; brute force by hand is hopeless).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cache
from typing import Any

from tmas.errors import InputError

LEVELS = (1, 2, 3, 4, 5)


@dataclass(frozen=True)
class Generated:
    question: str
    answer: int
    params: dict[str, Any]


Family = Callable[[random.Random, int], Generated]
FAMILIES: dict[str, Family] = {}


def family(name: str) -> Callable[[Family], Family]:
    def register(fn: Family) -> Family:
        FAMILIES[name] = fn
        return fn

    return register


# ------------------------------------------------------------------------------------------ tilings
TILE_SETS: dict[str, tuple[int, ...]] = {
    # Widths of the full-height blocks besides 2x1 tiles; 2x1 tiles may lie either way (appendix C's pitfall).
    "dominoes": (),
    "dominoes+squares": (2,),
    "dominoes+squares+2x4": (2, 4),
}
_TILE_NAMES = {2: "$2\\times 2$ squares", 4: "$2\\times 4$ rectangles"}


def tilings_2xn(n: int, blocks: tuple[int, ...]) -> int:
    """Tilings of a 2 x n board by 2x1 tiles (either orientation) and 2 x w blocks for w in ``blocks``.

    Cutting at the first column boundary no tile crosses: a vertical domino (width 1), two stacked horizontal
    dominoes (width 2) or a 2 x w block: T(n) = T(n-1) + T(n-2) + sum_w T(n-w), e.g. T(n) = T(n-1)+2T(n-2)+T(n-4).
    """
    widths = [1, 2, *blocks]
    t = [1] + [0] * n
    for i in range(1, n + 1):
        t[i] = sum(t[i - w] for w in widths if w <= i)
    return t[n]


@family("tiling")
def _tiling(rng: random.Random, level: int) -> Generated:
    tiles = rng.choice(list(TILE_SETS)[: 1 + min(level, 2)])
    n = rng.randint(2 + 2 * level, 4 + 4 * level)
    extra = [_TILE_NAMES[w] for w in TILE_SETS[tiles]]
    names = ["$2\\times 1$ dominoes (which may be placed horizontally or vertically)", *extra]
    pieces = names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]
    question = (
        f"In how many ways can a $2\\times {n}$ board be tiled completely, without overlaps, using {pieces}? "
        "Tiles of the same kind are indistinguishable and may be used any number of times."
    )
    return Generated(question, tilings_2xn(n, TILE_SETS[tiles]), {"n": n, "tiles": tiles})


# ------------------------------------------------------------------------------------------ linear recurrences
def _mat_mult(a: list[list[int]], b: list[list[int]], mod: int | None) -> list[list[int]]:
    out = [[sum(a[i][k] * b[k][j] for k in range(len(b))) for j in range(len(b[0]))] for i in range(len(a))]
    return [[x % mod for x in row] for row in out] if mod else out


def recurrence_term(p: int, q: int, a0: int, a1: int, n: int, mod: int | None) -> int:
    """a_n for a_k = p a_{k-1} + q a_{k-2}, by fast matrix powers (so level 5 with n in the thousands is cheap)."""
    result = [[1, 0], [0, 1]]
    base = [[p, q], [1, 0]]
    k = n
    while k:
        if k & 1:
            result = _mat_mult(result, base, mod)
        base = _mat_mult(base, base, mod)
        k >>= 1
    value = result[1][0] * a1 + result[1][1] * a0
    return value % mod if mod else value


def _coef(c: int) -> str:
    return "" if c == 1 else str(c)


@family("recurrence")
def _recurrence(rng: random.Random, level: int) -> Generated:
    p, q = rng.randint(1, 2 + level), rng.randint(1, 1 + level)
    a0, a1 = rng.randint(0, 3), rng.randint(1, 4)
    n = rng.randint(4 + 2 * level, 6 + 4 * level) if level <= 2 else rng.randint(20 * level, 200 * level)
    mod = None if level <= 2 else rng.choice([97, 101, 1000, 1009, 10007])
    ask = f"$a_{{{n}}}$" if mod is None else f"the remainder when $a_{{{n}}}$ is divided by ${mod}$"
    question = (
        f"A sequence is defined by $a_0 = {a0}$, $a_1 = {a1}$ and $a_k = {_coef(p)}a_{{k-1}} + {_coef(q)}a_{{k-2}}$ "
        "for $k \\ge 2$. "
        f"Find {ask}."
    )
    params = {"p": p, "q": q, "a0": a0, "a1": a1, "n": n, "mod": mod}
    return Generated(question, recurrence_term(p, q, a0, a1, n, mod), params)


# ------------------------------------------------------------------------------------------ modular arithmetic
@family("modular")
def _modular(rng: random.Random, level: int) -> Generated:
    base = rng.randint(2, 5 + 10 * level)
    exponent = rng.randint(5 * level, 10**level + 10)
    modulus = rng.randint(7, 10 + 10**level)
    question = f"What is the remainder when ${base}^{{{exponent}}}$ is divided by ${modulus}$?"
    return Generated(question, pow(base, exponent, modulus), {"base": base, "exponent": exponent, "modulus": modulus})


# ------------------------------------------------------------------------------------------ combinatorial counts
@family("combinatorics")
def _combinatorics(rng: random.Random, level: int) -> Generated:
    n = rng.randint(4 + 2 * level, 6 + 3 * level)
    k = rng.randint(2, max(2, (n + 1) // 2))
    question = f"How many {k}-element subsets of $\\{{1, 2, \\ldots, {n}\\}}$ contain no two consecutive integers?"
    # Gaps argument: choose k of the n - k + 1 slots between the unchosen numbers.
    return Generated(question, math.comb(n - k + 1, k), {"n": n, "k": k})


# ------------------------------------------------------------------------------------------ digit problems
def count_digit_sum(limit: int, target: int) -> int:
    """How many integers in [1, limit] have digit sum ``target`` (a digit DP over the decimal digits of limit)."""
    digits = [int(d) for d in str(limit)]

    @cache
    def go(pos: int, remaining: int, tight: bool) -> int:
        if remaining < 0:
            return 0
        if pos == len(digits):
            return int(remaining == 0)
        top = digits[pos] if tight else 9
        return sum(go(pos + 1, remaining - d, tight and d == top) for d in range(top + 1))

    return go(0, target, True) - int(target == 0)  # 0 itself is not in [1, limit]


@family("digits")
def _digits(rng: random.Random, level: int) -> Generated:
    limit = rng.randint(10 ** (level + 1), 10 ** (level + 2))
    target = rng.randint(2, 4 + 4 * level)
    question = f"How many integers from $1$ to ${limit}$ inclusive have digits that sum to ${target}$?"
    return Generated(question, count_digit_sum(limit, target), {"limit": limit, "target": target})


# ------------------------------------------------------------------------------------------ Diophantine counts
def count_linear_solutions(coefficients: tuple[int, ...], total: int) -> int:
    """Non-negative integer solutions of sum c_i x_i = total: the coin-change DP."""
    ways = [1] + [0] * total
    for c in coefficients:
        for value in range(c, total + 1):
            ways[value] += ways[value - c]
    return ways[total]


@family("diophantine")
def _diophantine(rng: random.Random, level: int) -> Generated:
    count = 2 if level == 1 else 3
    coefficients = tuple(sorted(rng.sample(range(1, 4 + 2 * level), count)))
    total = rng.randint(10 * level, 25 * level)
    names = "xyz"[:count]
    lhs = " + ".join(f"{c}{v}" if c != 1 else v for c, v in zip(coefficients, names, strict=True))
    question = "How many ordered triples" if count == 3 else "How many ordered pairs"
    question += f" $({', '.join(names)})$ of non-negative integers satisfy ${lhs} = {total}$?"
    return Generated(
        question, count_linear_solutions(coefficients, total), {"coefficients": coefficients, "total": total}
    )


# ------------------------------------------------------------------------------------------ number theory
def coprime_count(limit: int, modulus: int) -> int:
    """Integers in [1, limit] coprime to ``modulus``, by inclusion-exclusion over its prime factors."""
    primes, m, d = [], modulus, 2
    while d * d <= m:
        if m % d == 0:
            primes.append(d)
            while m % d == 0:
                m //= d
        d += 1
    if m > 1:
        primes.append(m)
    total = 0
    for mask in range(1 << len(primes)):
        product, bits = 1, 0
        for i, prime in enumerate(primes):
            if mask >> i & 1:
                product, bits = product * prime, bits + 1
        total += (-1) ** bits * (limit // product)
    return total


@family("coprime")
def _coprime(rng: random.Random, level: int) -> Generated:
    limit = rng.randint(10 ** (level + 1), 5 * 10 ** (level + 1))
    modulus = rng.choice([6, 10, 12, 14, 15, 21, 30, 42, 60, 70, 105, 210, 330, 2310][: 4 + 2 * level])
    question = f"How many integers $k$ with $1 \\le k \\le {limit}$ satisfy $\\gcd(k, {modulus}) = 1$?"
    return Generated(question, coprime_count(limit, modulus), {"limit": limit, "modulus": modulus})


# ------------------------------------------------------------------------------------------ emitting problems
def generate(name: str, n: int, *, seed: int = 0, level: int = 1) -> Iterator[dict[str, Any]]:
    """``n`` problems of family ``name`` (or ``"all"``: ``n`` of each) as official JSONL records."""
    if level not in LEVELS:
        raise InputError(f"--level {level}: levels are {LEVELS[0]} to {LEVELS[-1]}")
    if n < 1:
        raise InputError(f"--n {n}: must be at least 1")
    names = list(FAMILIES) if name == "all" else [name]
    for fam in names:
        if fam not in FAMILIES:
            raise InputError(f"unknown family {fam!r}; known: {', '.join(FAMILIES)}, all")
    # Checked above, before the first record: a bad argument must not leave a half-written file.
    return _records(names, n, seed, level)


def _records(names: list[str], n: int, seed: int, level: int) -> Iterator[dict[str, Any]]:
    for fam in names:
        for i in range(n):
            # One generator per problem: adding problems never changes the earlier ones.
            rng = random.Random(f"{fam}:{level}:{seed}:{i}")
            made = FAMILIES[fam](rng, level)
            yield {
                "problem_id": f"{fam}-L{level}-s{seed}-{i}",
                "question": made.question,
                "answer": str(made.answer),
                "family": fam,
                "level": level,
                "seed": seed,
                "params": made.params,
            }
