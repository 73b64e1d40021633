"""Does a grammar have a finite sentence? Checked on xgrammar's normalized EBNF text.

xgrammar normalizes every kind (JSON schema, regex, EBNF, choice) to one EBNF form, printed as
``name ::= body`` lines: quoted literals, ``[...]`` classes, rule names, ``( )`` groups, ``|``,
the repetitions ``* + ? {m, n}`` and an optional trailing lookahead ``(=...)``. A rule that can
never finish (``root ::= "a" root``) makes xgrammar's compiler allocate without bound
(std::bad_alloc after gigabytes), so the backend refuses such a grammar before compiling it.

Invariant: as in spec_check, only a grammar with certainly no finite sentence is refused (a
character class is taken as never empty; lookaheads are ignored).
"""

from __future__ import annotations

import re
from collections import deque

from servelm.constrained.grammar import GrammarError

_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|\[(?:[^\]\\]|\\.)*\]|[A-Za-z_][A-Za-z0-9_]*|\{\s*\d+\s*,\s*-?\d+\s*\}'
                    r'|\{\s*\d+\s*\}|\(=|::=|[()|*+?]|\s+|.', re.DOTALL)


class _Gates:
    """AND/OR gates; a gate is productive when all (AND) or any (OR) of its inputs are."""

    def __init__(self) -> None:
        self.is_all: list[bool] = []
        self.inputs: list[list[int]] = []

    def add(self, is_all: bool, inputs: list[int] | None = None) -> int:
        self.is_all.append(is_all)
        self.inputs.append(inputs or [])
        return len(self.is_all) - 1

    def productive(self) -> list[bool]:
        users: list[list[int]] = [[] for _ in self.is_all]
        missing = [len(inputs) if is_all else 1 for is_all, inputs in zip(self.is_all, self.inputs)]
        done = [False] * len(self.is_all)
        ready = deque(i for i, n in enumerate(missing) if n == 0 and self.is_all[i])
        for index, inputs in enumerate(self.inputs):
            for source in inputs:
                users[source].append(index)
        for index in ready:
            done[index] = True
        while ready:
            source = ready.popleft()
            for index in users[source]:
                if not done[index]:
                    missing[index] -= 1
                    if missing[index] == 0:
                        done[index] = True
                        ready.append(index)
        return done


class _Parser:
    """Recursive descent over one rule body's tokens (nesting is bounded by the spec check)."""

    def __init__(self, gates: _Gates, rules: dict[str, int], tokens: list[str]) -> None:
        self.gates, self.rules, self.tokens, self.position = gates, rules, tokens, 0

    def peek(self) -> str | None:
        return self.tokens[self.position] if self.position < len(self.tokens) else None

    def alternatives(self) -> int:
        branches = [self.sequence()]
        while self.peek() == "|":
            self.position += 1
            branches.append(self.sequence())
        return self.gates.add(False, branches)

    def sequence(self) -> int:
        items = []
        while self.peek() not in (None, "|", ")"):
            item = self.item()
            if item is not None:
                items.append(item)
        return self.gates.add(True, items)

    def item(self) -> int | None:
        token = self.tokens[self.position]
        self.position += 1
        if token == "(=":  # lookahead: constrains, never produces
            self.alternatives()
            self.position += 1
            return None
        if token == "(":
            atom = self.alternatives()
            self.position += 1
        elif token[0] in '"[':
            atom = self.gates.add(True)
        else:
            if token not in self.rules:
                return None  # xgrammar has already refused unknown names
            atom = self.gates.add(True, [self.rules[token]])
        repeat = self.peek()
        if repeat in ("*", "?") or (repeat is not None and repeat.startswith("{")
                                    and int(repeat[1:].split(",")[0].rstrip("} ")) == 0):
            self.position += 1
            return self.gates.add(True)  # zero repetitions always finish
        if repeat == "+" or (repeat is not None and repeat.startswith("{")):
            self.position += 1
        return atom


def check_ebnf_finite(spec: str) -> None:
    """GrammarError when a GBNF grammar (the ``ebnf`` kind) has no finite sentence, read through
    xgrammar's parser; a grammar xgrammar cannot parse is left to the backend (llguidance's
    dialect differs in places)."""
    try:
        import xgrammar as xgr

        grammar = xgr.Grammar.from_ebnf(spec)
    except Exception:  # not installed, or not xgrammar's dialect: the backend decides
        return
    check_finite(str(grammar))


def check_finite(grammar_text: str, root: str = "root") -> None:
    """GrammarError when ``root`` of the normalized grammar, or any of its rules, can never
    finish a sentence."""
    bodies: dict[str, list[str]] = {}
    for line in grammar_text.splitlines():
        tokens = [t for t in _TOKEN.findall(line) if not t.isspace()]
        if len(tokens) >= 2 and tokens[1] == "::=":
            bodies[tokens[0]] = tokens[2:]
    if root not in bodies:
        return
    gates = _Gates()
    rules = {name: gates.add(False) for name in bodies}
    for name, tokens in bodies.items():
        gates.inputs[rules[name]].append(_Parser(gates, rules, tokens).alternatives())
    productive = gates.productive()
    stuck = sorted(name for name, gate in rules.items() if not productive[gate])
    if not productive[rules[root]]:
        raise GrammarError(f"the grammar has no finite output: rule {root} can never finish (rules "
                           f"with no way out: {', '.join(stuck[:5])})")
    if stuck:  # a branch into one of these could never end: xgrammar blows up on it all the same
        raise GrammarError(f"the grammar has rules that can never finish: {', '.join(stuck[:5])} "
                           "(a recursion with no way out)")
