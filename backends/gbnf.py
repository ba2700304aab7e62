"""llama.cpp's GBNF parser, in Python: what the local engine reads, and what it cannot survive.

llama-cpp-python 0.3.36 hands a grammar to llama.cpp when sampling starts. A grammar llama.cpp
does not parse (an unknown escape, a rule with nothing before the next rule's ``::=``, an
undefined rule, left recursion, a repetition past its threshold) gives no sampler, and the
process then samples through a null pointer (SIGSEGV). A grammar that parses but leaves some
state where no token can go on (a literal NUL: no token's text holds one) makes llama.cpp
throw from inside the sampler (SIGABRT). A parse nested too deep overflows its stack, and a
rule with thousands of alternatives is sampled thousands of times a token.

:func:`read` parses a grammar the way ``llama_grammar_parser::parse`` and
``llama_grammar_init_impl`` do (``vendor/llama.cpp/src/llama-grammar.cpp``, ported step for
step: the same elements, the same rewrite of repetitions, the same left-recursion walk) and
raises :class:`GrammarRefused` for each of the above. Pure; nothing runs on an engine.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

END, ALT, RULE_REF, CHAR, CHAR_NOT, CHAR_RNG_UPPER, CHAR_ALT, CHAR_ANY = range(8)
MAX_REPETITION_THRESHOLD = 2000  # llama-grammar.cpp
_ESCAPES = {"t": "\t", "r": "\r", "n": "\n", "\\": "\\", '"': '"', "[": "[", "]": "]", "-": "-"}
_HEX = {"x": 2, "u": 4, "U": 8}
_WORD = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-")
_DIGITS = frozenset("0123456789")
_NAME = re.compile(r"[a-zA-Z0-9-]+")
_BLANK = re.compile(r"[ \t]*")
_BLANK_NL = re.compile(r"[ \t\r\n]*")
_PLAIN = re.compile(r'[^"\\]+')
Element = tuple[int, int]


class GrammarRefused(ValueError):
    """A grammar the local engine cannot take; the message says why."""


class TooDeep(GrammarRefused):
    """Groups nested past the depth asked for (llama.cpp's parser recurses once a group)."""


@dataclass
class Grammar:
    rules: list[list[Element]]  # by rule id, each ending with END
    symbols: dict[str, int]
    depth: int = 0  # deepest nesting of groups (the parser's recursion)
    widest: int = 0  # most alternatives in one rule or group
    stacks: int = 0  # most grammar stacks entering one rule makes (each walked for every token)


@dataclass
class _Frame:
    """A rule or group being read: its elements so far, and where the sequence under way stands."""

    rule_id: int
    nested: bool
    before: int = 0  # symbols made before its id (what a repetition of the group counts)
    rule: list[Element] = field(default_factory=list)
    alternatives: int = 1
    last: int = 0  # where the last item starts (what a repetition repeats)
    n_prev: int = 1  # rules that item made


@dataclass
class _Parser:
    src: str
    max_depth: int
    symbols: dict[str, int] = field(default_factory=dict)
    rules: dict[int, list[Element]] = field(default_factory=dict)
    depth: int = 0
    deepest: int = 0
    widest: int = 0

    def at(self, i: int) -> str:
        return self.src[i] if i < len(self.src) else ""  # "" is the C string's terminating NUL

    def fail(self, what: str, i: int) -> GrammarRefused:
        return GrammarRefused(f"{what} at {self.src[max(0, i - 30) : i + 10]!r}")

    def symbol(self, name: str) -> int:
        return self.symbols.setdefault(name, len(self.symbols))

    def generate(self, base: str) -> int:
        n = len(self.symbols)
        self.symbols[f"{base}_{n}"] = n
        return n

    def space(self, i: int, newline_ok: bool) -> int:
        blank = _BLANK_NL if newline_ok else _BLANK
        while True:
            m = blank.match(self.src, i)  # a * pattern: always a match
            i = m.end() if m else i
            if self.at(i) != "#":
                return i
            while self.at(i) not in ("", "\r", "\n"):
                i += 1

    def name(self, i: int) -> int:
        m = _NAME.match(self.src, i)
        if m is None:
            raise self.fail("expecting a name", i)
        return m.end()

    def char(self, i: int) -> tuple[int, int]:
        c = self.at(i)
        if c == "\\":
            e = self.at(i + 1)
            if e in _HEX and e:
                n = _HEX[e]
                digits = self.src[i + 2 : i + 2 + n]
                if len(digits) != n or any(d not in "0123456789abcdefABCDEF" for d in digits):
                    raise self.fail(f"expecting {n} hex chars", i)
                return int(digits, 16), i + 2 + n
            if e in _ESCAPES and e:
                return ord(_ESCAPES[e]), i + 2
            raise self.fail("unknown escape", i)
        if c:
            return ord(c), i + 1
        raise self.fail("unexpected end of input", i)

    def alternates(self, i: int, rule_name: str, rule_id: int, nested: bool) -> int:
        """``parse_alternates``, with its recursion into groups on a stack of frames (a grammar
        nested 512 deep must not overflow the check's own stack)."""
        frames = [_Frame(rule_id, nested)]
        while True:
            f = frames[-1]
            i, opened = self.sequence(i, rule_name, f)
            if opened:  # a group: read it, then this sequence goes on
                before = len(self.symbols)
                frames.append(_Frame(self.generate(rule_name), True, before=before))
                self.depth += 1
                self.deepest = max(self.deepest, self.depth)
                if self.depth > self.max_depth:
                    raise TooDeep(f"groups nested more than {self.max_depth} deep")
                i = self.space(i + 1, True)
                continue
            if self.at(i) == "|":
                f.rule.append((ALT, 0))
                f.alternatives += 1
                f.last, f.n_prev = len(f.rule), 1
                i = self.space(i + 1, True)
                continue
            f.rule.append((END, 0))
            self.rules[f.rule_id] = f.rule
            self.widest = max(self.widest, f.alternatives)
            frames.pop()
            if not frames:
                return i
            self.depth -= 1
            outer = frames[-1]
            outer.n_prev = max(1, len(self.symbols) - f.before)
            outer.last = len(outer.rule)
            outer.rule.append((RULE_REF, f.rule_id))
            if self.at(i) != ")":
                raise self.fail("expecting ')'", i)
            i = self.space(i + 1, outer.nested)

    def repeat(self, f: _Frame, rule_name: str, lo: int, hi: int | None, i: int) -> None:
        """llama.cpp's rewrite of the last item as S{lo,hi}."""
        rule, last = f.rule, f.last
        if last == len(rule):
            raise self.fail("expecting an item before */+/?/{", i)
        prev = rule[last:]
        total = hi if hi is not None and hi > 0 else (lo if lo > 0 else 1)
        if f.n_prev * total > MAX_REPETITION_THRESHOLD:
            raise self.fail("a repetition past llama.cpp's threshold", i)
        if lo == 0:
            del rule[last:]
        else:
            rule.extend(prev * (lo - 1))
        last_rec = 0
        n_opt = 1 if hi is None else hi - lo
        for k in range(max(n_opt, 0)):
            rec_id = self.generate(rule_name)
            rec = list(prev)
            if k > 0 or hi is None:
                rec.append((RULE_REF, rec_id if hi is None else last_rec))
            rec += [(ALT, 0), (END, 0)]
            self.rules[rec_id] = rec
            last_rec = rec_id
        if n_opt > 0:
            rule.append((RULE_REF, last_rec))
        f.n_prev *= total

    def sequence(self, i: int, rule_name: str, f: _Frame) -> tuple[int, bool]:
        """``parse_sequence`` up to its end, or up to a ``(`` (True: the caller reads the group)."""
        rule, nested = f.rule, f.nested
        while c := self.at(i):
            if c == '"':
                i += 1
                f.last, f.n_prev = len(rule), 1
                while self.at(i) != '"':
                    if plain := _PLAIN.match(self.src, i):  # a run without escapes, at once
                        rule += [(CHAR, ord(ch)) for ch in plain.group()]
                        i = plain.end()
                        continue
                    value, i = self.char(i)
                    rule.append((CHAR, value))
                i = self.space(i + 1, nested)
            elif c == "[":
                i += 1
                kind = CHAR
                if self.at(i) == "^":
                    i += 1
                    kind = CHAR_NOT
                f.last, f.n_prev = len(rule), 1
                while self.at(i) != "]":
                    value, i = self.char(i)
                    rule.append((CHAR_ALT if f.last < len(rule) else kind, value))
                    if self.at(i) == "-" and self.at(i + 1) != "]":
                        if not self.at(i + 1):
                            raise self.fail("unexpected end of input", i)
                        upper, i = self.char(i + 1)
                        rule.append((CHAR_RNG_UPPER, upper))
                i = self.space(i + 1, nested)
            elif c in ("<", "!"):
                raise self.fail("a token reference, which the local backend does not take", i)
            elif c in _WORD:
                end = self.name(i)
                ref = self.symbol(self.src[i:end])
                i = self.space(end, nested)
                f.last, f.n_prev = len(rule), 1
                rule.append((RULE_REF, ref))
            elif c == "(":
                return i, True
            elif c == ".":
                f.last, f.n_prev = len(rule), 1
                rule.append((CHAR_ANY, 0))
                i = self.space(i + 1, nested)
            elif c in ("*", "+", "?"):
                i = self.space(i + 1, nested)
                self.repeat(f, rule_name, 1 if c == "+" else 0, 1 if c == "?" else None, i)
            elif c == "{":
                i = self.counts(i, rule_name, f)
            else:
                break
        return i, False

    def counts(self, i: int, rule_name: str, f: _Frame) -> int:
        nested = f.nested
        i = self.space(i + 1, nested)
        lo, i = self.integer(i)
        hi: int | None = lo
        i = self.space(i, nested)
        if self.at(i) == ",":
            i = self.space(i + 1, nested)
            hi = None
            if self.at(i) in _DIGITS and self.at(i):
                hi, i = self.integer(i)
                i = self.space(i, nested)
            if self.at(i) != "}":
                raise self.fail("expecting '}'", i)
        elif self.at(i) != "}":
            raise self.fail("expecting ','", i)
        i = self.space(i + 1, nested)
        if lo > MAX_REPETITION_THRESHOLD or (hi is not None and hi < lo):
            raise self.fail("a repetition past llama.cpp's threshold, or with its maximum under its minimum", i)
        self.repeat(f, rule_name, lo, None if hi is not None and hi > MAX_REPETITION_THRESHOLD else hi, i)
        return i

    def integer(self, i: int) -> tuple[int, int]:
        j = i
        while self.at(j) in _DIGITS and self.at(j):
            j += 1
        if j == i:
            raise self.fail("expecting an int", i)
        return int(self.src[i:j]), j

    def rule(self, i: int) -> int:
        end = self.name(i)
        name = self.src[i:end]
        rule_id = self.symbol(name)
        i = self.space(end, False)
        if self.src[i : i + 3] != "::=":
            raise self.fail("expecting ::=", i)
        i = self.space(i + 3, True)
        i = self.alternates(i, name, rule_id, False)
        if self.at(i) == "\r":
            i += 2 if self.at(i + 1) == "\n" else 1
        elif self.at(i) == "\n":
            i += 1
        elif self.at(i):
            raise self.fail("expecting a newline or the end", i)
        return self.space(i, True)


def read(grammar: str, max_depth: int, root: str = "root") -> Grammar:
    """The grammar as llama.cpp holds it, or GrammarRefused for what it does not take (TooDeep
    past ``max_depth`` nested groups)."""
    if "\x00" in grammar:  # the C string ends there
        raise GrammarRefused("the grammar holds a NUL character")
    p = _Parser(grammar, max_depth)
    i = p.space(0, True)
    while p.at(i):
        i = p.rule(i)
    names = {v: k for k, v in p.symbols.items()}
    rules = [p.rules.get(k, []) for k in range(len(p.symbols))]
    for k, rule in enumerate(rules):
        if not rule:
            raise GrammarRefused(f"the grammar uses the undefined rule {names[k]!r}")
    if not rules or root not in p.symbols:
        raise GrammarRefused(f"the grammar has no {root!r} rule")
    _no_left_recursion(rules, names)
    _no_dead_characters(rules)
    return Grammar(rules, p.symbols, p.deepest, p.widest, max(_stacks(rules)))


def _no_left_recursion(rules: list[list[Element]], names: dict[int, str]) -> None:
    """``llama_grammar_detect_left_recursion``, with a stack of its own (the check must not be the
    one to overflow): a rule reached again through leftmost references before it is done."""
    visited = [False] * len(rules)
    in_progress = [False] * len(rules)
    may_be_empty = [False] * len(rules)
    for start in range(len(rules)):
        if visited[start]:
            continue
        in_progress[start], may_be_empty[start] = True, _empty_alternative(rules[start])
        frames: list[list[int]] = [[start, 0, 1, -1]]  # rule, next element, recursing, child to read
        while frames:
            frame = frames[-1]
            k, pos, go, child = frame
            if child >= 0:
                go = int(may_be_empty[child])
            rule, descended = rules[k], False
            while pos < len(rule):
                kind, value = rule[pos]
                pos += 1
                if kind == RULE_REF and go:
                    if in_progress[value]:
                        raise GrammarRefused(f"the grammar is left-recursive at rule {names[value]!r}")
                    if not visited[value]:  # done before: no cycle through it (it would have been found)
                        frame[:] = [k, pos, go, value]
                        in_progress[value], may_be_empty[value] = True, _empty_alternative(rules[value])
                        frames.append([value, 0, 1, -1])
                        descended = True
                        break
                    go = int(may_be_empty[value])
                else:
                    go = int(kind in (END, ALT))
            if not descended:
                frames.pop()
                in_progress[k], visited[k] = False, True


def _stacks(rules: list[list[Element]]) -> list[int]:
    """Per rule, how many stacks ``llama_grammar_advance_stack`` makes entering it: one per
    alternative that starts with a character, the count of the rule an alternative starts with
    otherwise (no cycle: left recursion is refused first). With an ``enum`` of N values the
    sampler walks N stacks for every token until the values part."""
    counts: list[int | None] = [None] * len(rules)
    for start in range(len(rules)):
        todo = [start]
        while todo:
            k = todo[-1]
            if counts[k] is not None:
                todo.pop()
                continue
            firsts = [rules[k][0]] + [rules[k][i + 1] for i, (kind, _) in enumerate(rules[k][:-1]) if kind == ALT]
            waiting = [v for kind, v in firsts if kind == RULE_REF and counts[v] is None]
            if waiting:
                todo += waiting
                continue
            counts[k] = sum(
                (counts[v] or 0) if kind == RULE_REF else 0 if kind in (END, ALT) else 1 for kind, v in firsts
            )
            todo.pop()
    return [c or 0 for c in counts]


def _empty_alternative(rule: list[Element]) -> bool:
    at_start = True
    for kind, _ in rule:
        if kind in (END, ALT):
            if at_start:
                return True
            at_start = True
        else:
            at_start = False
    return False


def _no_dead_characters(rules: list[list[Element]]) -> None:
    """A literal character no token's text can hold: NUL (a token's text is a C string) and the
    UTF-16 surrogates and what lies past U+10FFFF (no UTF-8 text holds them). Where one must be
    produced, llama.cpp's sampler finds no token and throws (SIGABRT)."""
    for rule in rules:
        for i, (kind, value) in enumerate(rule):
            alone = kind == CHAR and (i + 1 >= len(rule) or rule[i + 1][0] not in (CHAR_ALT, CHAR_RNG_UPPER))
            if alone and (value == 0 or 0xD800 <= value <= 0xDFFF or value > 0x10FFFF):
                raise GrammarRefused(f"the grammar must produce the character U+{value:04X}, which no token holds")
