"""Just enough of bash to read a training launch script without running it.

Launch scripts set variables (``TP=8``, ``GPT_ARGS="--tensor-model-parallel-size ${TP} \\ ..."``,
``MODEL_ARGS=( --num-layers 80 ... )``), continue lines with ``\\``, compute sizes with
``$((GPUS_PER_NODE*NNODES))`` and finally call ``torchrun ... pretrain_gpt.py ${GPT_ARGS[@]}``.
``run_script`` executes the assignments in order and returns every other simple command as
expanded words; each word remembers the line it was written on (for a word that came out of
a variable, the line inside the variable's definition), so errors point at the right line.

Not supported, on purpose: running commands (``$(...)`` and backticks expand to nothing, with a
note), conditionals (both branches' assignments apply), functions, globbing.
"""

from __future__ import annotations

import ast
import operator
import re
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Chunk:
    """Part of an expanded word: text from one line; ``split`` if unquoted expansion output
    (subject to word splitting); ``note`` if it came from something the script cannot resolve."""

    text: str
    line: int
    split: bool = False
    note: str | None = None


@dataclass(frozen=True)
class Word:
    """A word after expansion: its text, the line it starts on, and why it may be unreliable."""

    text: str
    line: int
    note: str | None = None


Value = list[Chunk]


@dataclass
class _Part:
    """A piece of a word before expansion."""

    kind: str  # "lit", "var", "arith", "cmd"
    text: str
    line: int
    quoted: bool
    op: str = ""  # for "var": "", ":-", "-", ":=", "=", ":+", "+", "[@]", "[*]", "#", "?"
    arg: list[_Part] = field(default_factory=list)


@dataclass
class _RawWord:
    parts: list[_Part]
    line: int
    array: list[_RawWord] | None = None  # NAME=( ... ): the elements


class ShellSyntaxError(Exception):
    def __init__(self, line: int, message: str):
        super().__init__(message)
        self.line = line
        self.message = message


#: The most one word, variable or command may expand to (characters plus pieces): a launch
#: script's hold a few kB; ``A=$A$A$A$A$A$A$A$A`` repeated would grow eightfold a line, for
#: minutes and gigabytes. Checked while expanding, so nothing much larger is ever built.
MAX_EXPANSION = 100_000

_KEYWORDS = {"if", "then", "else", "elif", "fi", "do", "done", "while", "until", "for", "case", "esac",
             "function", "{", "}", "!", "in"}
_DECLARE = {"export", "local", "declare", "readonly", "typeset"}
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_ASSIGN = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)(\+?)=")


class _Lexer:
    """Splits the script into simple commands of raw (unexpanded) words."""

    def __init__(self, text: str):
        self.text = text
        self.pos = 0
        self.line = 1
        self.heredocs: list[tuple[str, bool]] = []

    def peek(self, offset: int = 0) -> str:
        i = self.pos + offset
        return self.text[i] if i < len(self.text) else ""

    def advance(self, n: int = 1) -> str:
        out = self.text[self.pos:self.pos + n]
        self.line += out.count("\n")
        self.pos += n
        return out

    def commands(self) -> list[list[_RawWord]]:
        out: list[list[_RawWord]] = []
        current: list[_RawWord] = []

        def finish() -> None:
            nonlocal current
            if current:
                out.append(current)
            current = []

        while self.pos < len(self.text):
            c = self.peek()
            if c in " \t\r":
                self.advance()
            elif c == "\\" and self.peek(1) == "\n":
                self.advance(2)
            elif c == "\n":
                self.advance()
                finish()
                self._skip_heredocs()
            elif c == "#":
                while self.pos < len(self.text) and self.peek() != "\n":
                    self.advance()
            elif c == "(" and current and self.peek(1) != ")":  # "name()" defines a function
                # bash refuses it too; unquoted, a value like ([0]*3+[1]*58) would be lost silently
                raise ShellSyntaxError(self.line, "unexpected '(' after a word: quote the value")
            elif c in ";|&()":
                self.advance(2 if self.peek(1) in "&|;" and c != "(" and c != ")" else 1)
                finish()
            elif c in "<>" or (c.isdigit() and self._redirect_ahead()):
                self._redirection()
            else:
                current.append(self._word())
        finish()
        return out

    def _redirect_ahead(self) -> bool:
        # "2>&1", "1>log": digits directly followed by a redirection operator.
        i = self.pos
        while i < len(self.text) and self.text[i].isdigit():
            i += 1
        return i < len(self.text) and self.text[i] in "<>"

    def _redirection(self) -> None:
        while self.peek().isdigit():
            self.advance()
        if self.peek() == "<" and self.peek(1) == "<" and self.peek(2) != "<":
            self.advance(2)
            strip = self.peek() == "-"
            if strip:
                self.advance()
            while self.peek() in " \t":
                self.advance()
            delimiter = "".join(p.text for p in self._word().parts)
            self.heredocs.append((delimiter, strip))
            return
        while self.peek() in "<>&|":
            self.advance()
        if self.peek() == "-" or self.peek().isdigit():
            while self.peek().isdigit() or self.peek() == "-":
                self.advance()
            return
        while self.peek() in " \t":
            self.advance()
        if self.peek() and self.peek() not in "\n;|&":
            self._word()  # the target file

    def _skip_heredocs(self) -> None:
        for delimiter, strip in self.heredocs:
            while self.pos < len(self.text):
                end = self.text.find("\n", self.pos)
                end = len(self.text) if end < 0 else end
                body = self.text[self.pos:end]
                self.advance(end - self.pos + (1 if end < len(self.text) else 0))
                if (body.strip() if strip else body) == delimiter:
                    break
        self.heredocs = []

    def _word(self) -> _RawWord:
        start = self.line
        parts: list[_Part] = []
        lit: list[str] = []
        lit_line = self.line

        def flush(quoted: bool = False) -> None:
            nonlocal lit, lit_line
            if lit:
                parts.append(_Part("lit", "".join(lit), lit_line, quoted))
            lit = []
            lit_line = self.line

        while self.pos < len(self.text):
            c = self.peek()
            if c in " \t\r\n;|&<>()":
                if c == "(" and not parts and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*\+?=", "".join(lit)):
                    flush()
                    return _RawWord(parts, start, array=self._array())
                break
            if c == "\\":
                if self.peek(1) == "\n":
                    self.advance(2)
                    continue
                flush()
                self.advance()
                lit_line = self.line
                lit.append(self.advance())
                flush(quoted=True)
            elif c == "'":
                flush()
                self.advance()
                end = self.text.find("'", self.pos)
                if end < 0:
                    raise ShellSyntaxError(self.line, "unterminated single quote")
                self._quoted_literal(parts, self.text[self.pos:end])
                self.advance(1)
                lit_line = self.line
            elif c == '"':
                flush()
                self.advance()
                self._double_quoted(parts)
                lit_line = self.line
            elif c == "$" or c == "`":
                flush()
                parts.append(self._expansion(quoted=False))
                lit_line = self.line
            else:
                lit.append(self.advance())
        flush()
        return _RawWord(parts, start)

    def _quoted_literal(self, parts: list[_Part], text: str) -> None:
        # One part per physical line, so words split out of it later keep their own line.
        line = self.line
        buffer: list[str] = []
        added = False
        for ch in text:
            buffer.append(ch)
            if ch == "\n":
                parts.append(_Part("lit", "".join(buffer), line, True))
                buffer, line, added = [], line + 1, True
        if buffer or not added:
            parts.append(_Part("lit", "".join(buffer), line, True))
        self.advance(len(text))

    def _double_quoted(self, parts: list[_Part]) -> None:
        lit: list[str] = []
        lit_line = self.line

        def flush() -> None:
            nonlocal lit, lit_line
            if lit:
                parts.append(_Part("lit", "".join(lit), lit_line, True))
            lit = []
            lit_line = self.line

        opened = self.line
        while True:
            if self.pos >= len(self.text):
                raise ShellSyntaxError(opened, "unterminated double quote")
            c = self.peek()
            if c == '"':
                self.advance()
                flush()
                if not parts or parts[-1].kind != "lit" or not parts[-1].quoted:
                    parts.append(_Part("lit", "", opened, True))  # "" is a word of its own
                return
            if c == "\\" and self.peek(1) in '$`"\\\n':
                self.advance()
                if self.peek() == "\n":
                    self.advance()
                    flush()
                    continue
                lit.append(self.advance())
            elif c == "$" or c == "`":
                flush()
                parts.append(self._expansion(quoted=True))
                lit_line = self.line
            elif c == "\n":
                lit.append(self.advance())
                flush()
            else:
                lit.append(self.advance())

    def _expansion(self, quoted: bool) -> _Part:
        line = self.line
        if self.peek() == "`":
            self.advance()
            end = self.text.find("`", self.pos)
            if end < 0:
                raise ShellSyntaxError(line, "unterminated backquote")
            body = self.advance(end - self.pos)
            self.advance()
            return _Part("cmd", body, line, quoted)
        self.advance()  # $
        c = self.peek()
        if c == "(" and self.peek(1) == "(":
            self.advance(2)
            body = self._balanced("(", ")", line)
            if self.peek() != ")":
                raise ShellSyntaxError(line, "unterminated $(( ))")
            self.advance()
            return _Part("arith", body, line, quoted)
        if c == "(":
            self.advance()
            return _Part("cmd", self._balanced("(", ")", line), line, quoted)
        if c == "{":
            self.advance()
            return self._braced(self._balanced("{", "}", line), line, quoted)
        match = _NAME.match(self.text, self.pos)
        if match:
            self.advance(len(match.group(0)))
            return _Part("var", match.group(0), line, quoted)
        if c and (c.isdigit() or c in "@*#?$!-"):
            self.advance()
            return _Part("var", c, line, quoted, op="?")
        return _Part("lit", "$", line, quoted)

    def _balanced(self, opening: str, closing: str, line: int) -> str:
        depth = 1
        start = self.pos
        while self.pos < len(self.text):
            c = self.peek()
            if c == "\\":
                self.advance(2)
                continue
            if c == opening:
                depth += 1
            elif c == closing:
                depth -= 1
                if depth == 0:
                    body = self.text[start:self.pos]
                    self.advance()
                    return body
            self.advance()
        raise ShellSyntaxError(line, f"unterminated {opening}")

    def _braced(self, body: str, line: int, quoted: bool) -> _Part:
        if body.startswith("#"):
            return _Part("var", body[1:], line, quoted, op="#")
        # ${1:-default}: positional parameters are never set when a script is read, not run.
        match = _NAME.match(body) or re.match(r"\d+", body)
        if not match:
            return _Part("var", body, line, quoted, op="?")
        name, rest = match.group(0), body[match.end():]
        if rest in ("[@]", "[*]"):
            return _Part("var", name, line, quoted, op=rest)
        if not rest:
            return _Part("var", name, line, quoted)
        for op in (":-", ":=", ":+", "-", "=", "+"):
            if rest.startswith(op):
                sub = _Lexer(rest[len(op):])
                sub.line = line
                arg = sub._word().parts if rest[len(op):] else []
                return _Part("var", name, line, quoted, op=op, arg=arg)
        return _Part("var", name, line, quoted, op="?")

    def _array(self) -> list[_RawWord]:
        self.advance()  # (
        elements: list[_RawWord] = []
        while True:
            if self.pos >= len(self.text):
                raise ShellSyntaxError(self.line, "unterminated array ( )")
            c = self.peek()
            if c in " \t\r\n":
                self.advance()
            elif c == "\\" and self.peek(1) == "\n":
                self.advance(2)
            elif c == "#":
                while self.pos < len(self.text) and self.peek() != "\n":
                    self.advance()
            elif c == ")":
                self.advance()
                return elements
            elif c in "(;|&<>":
                # bash refuses these unquoted inside an array too (a word never starts with one)
                raise ShellSyntaxError(self.line, f"unexpected '{c}' inside an array ( ): quote the element")
            else:
                start = self.pos
                elements.append(self._word())
                if self.pos == start:  # no word read: stop rather than loop
                    raise ShellSyntaxError(self.line, f"unexpected '{c}' inside an array ( )")


# ---------------------------------------------------------------- expansion
def _power(base: int, exponent: int) -> int:
    """``base ** exponent`` where bash's 64-bit arithmetic holds it; else ValueError. |base| is at
    least 2^(bits - 1), so (bits - 1)·exponent >= 64 is past 64 bits without computing it
    (``9**9**9**9`` would compute forever); below that the power has under 128 bits, computed and
    checked exactly (2**62 holds, 2**63 does not)."""
    if exponent < 0 or abs(base) > 1 and exponent * (abs(base).bit_length() - 1) >= 64:
        raise ValueError(f"{base}**{exponent}")
    result = int(base**exponent)
    if not -(2**63) <= result < 2**63:
        raise ValueError(f"{base}**{exponent}")
    return result


_ARITH_OPS: dict[type, Callable[[int, int], int]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
    ast.FloorDiv: lambda a, b: int(a / b), ast.Mod: lambda a, b: a - int(a / b) * b, ast.Pow: _power,
}


def _arith(expression: str) -> int:
    tree = ast.parse(expression.strip().replace("/", "//"), mode="eval")

    def value(node: ast.AST) -> int:
        if isinstance(node, ast.Expression):
            return value(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, int) and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _ARITH_OPS:
            return _ARITH_OPS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            return -value(node.operand) if isinstance(node.op, ast.USub) else value(node.operand)
        raise ValueError(expression)

    return value(tree)


class Shell:
    """Runs the assignments of a script and collects its other commands."""

    def __init__(self, env: dict[str, str] | None = None):
        self.strings: dict[str, Value] = {k: [Chunk(v, 0)] for k, v in (env or {}).items()}
        self.arrays: dict[str, list[Value]] = {}

    def run(self, text: str) -> list[list[Word]]:
        commands: list[list[Word]] = []
        for raw in _Lexer(text).commands():
            words = self._strip_keywords(raw)
            if not words:
                continue
            first = self._literal(words[0])
            declared = first in _DECLARE
            if declared:
                words = [w for w in words[1:] if not (self._literal(w) or "").startswith("-")]
            assigned = 0
            for word in words:
                if word.array is None and not _ASSIGN.match(self._literal_prefix(word)):
                    break
                self._assign(word)
                assigned += 1
            if declared or assigned == len(words):
                continue
            expanded: list[Word] = []
            size = 0
            for word in words[assigned:]:
                fields = self._fields(word.parts)
                size += _size(fields)
                _check_size(size, word.line)
                expanded.extend(fields)
            if expanded:
                commands.append(expanded)
        return commands

    def _strip_keywords(self, raw: list[_RawWord]) -> list[_RawWord]:
        while raw and raw[0].array is None and self._literal(raw[0]) in _KEYWORDS:
            raw = raw[1:]
        return raw

    @staticmethod
    def _literal(word: _RawWord) -> str | None:
        if word.array is not None or any(p.kind != "lit" for p in word.parts):
            return None
        return "".join(p.text for p in word.parts)

    @staticmethod
    def _literal_prefix(word: _RawWord) -> str:
        out = []
        for part in word.parts:
            if part.kind != "lit" or part.quoted:
                break
            out.append(part.text)
        return "".join(out)

    def _assign(self, word: _RawWord) -> None:
        if word.array is not None:
            name = "".join(p.text for p in word.parts).rstrip("=").rstrip("+")
            append = "".join(p.text for p in word.parts).endswith("+=")
            elements = [self._fields(w.parts) for w in word.array]
            values = [[Chunk(f.text, f.line, note=f.note)] for fields in elements for f in fields]
            self.arrays[name] = (self.arrays.get(name, []) if append else []) + values
            _check_size(sum(_size(element) for element in self.arrays[name]), word.line)
            self.strings.pop(name, None)
            return
        prefix = self._literal_prefix(word)
        match = _ASSIGN.match(prefix)
        assert match is not None
        name, append = match.group(1), bool(match.group(2))
        rest = list(word.parts)
        consumed = len(match.group(0))
        first = rest[0]
        rest[0] = _Part("lit", first.text[consumed:], first.line, first.quoted)
        value = [Chunk(c.text, c.line, False, c.note) for c in self._chunks(rest)]
        self.strings[name] = (self.strings.get(name, []) if append else []) + value
        _check_size(_size(self.strings[name]), word.line)
        self.arrays.pop(name, None)

    # -- expansion of one word into chunks, then into fields
    def _chunks(self, parts: list[_Part]) -> list[Chunk]:
        out: list[Chunk] = []
        size = 0
        for part in parts:
            if part.kind == "lit":
                out.append(Chunk(part.text, part.line))
            elif part.kind == "cmd":
                out.append(Chunk("", part.line, note=f"command substitution `{part.text.strip()}` is not run"))
            elif part.kind == "arith":
                out.append(self._arith_chunk(part))
            else:
                value = self._var(part)
                size += _size(value)
                _check_size(size, part.line)
                out.extend(value)
        return out

    def _arith_chunk(self, part: _Part) -> Chunk:
        def lookup(match: re.Match[str]) -> str:
            name = match.group(1) or match.group(2) or match.group(3)
            text = "".join(c.text for c in self._string(name)).strip()
            return text or "0"

        expression = re.sub(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}|\$([A-Za-z_][A-Za-z0-9_]*)|\b([A-Za-z_][A-Za-z0-9_]*)\b",
                            lookup, part.text)
        try:
            return Chunk(str(_arith(expression)), part.line, split=not part.quoted)
        except (ValueError, SyntaxError, ZeroDivisionError, TypeError):
            return Chunk("", part.line, note=f"cannot evaluate $(({part.text.strip()}))")

    def _string(self, name: str) -> Value:
        if name in self.strings:
            return self.strings[name]
        if name in self.arrays and self.arrays[name]:
            return self.arrays[name][0]
        return []

    def _is_set(self, name: str) -> bool:
        return name in self.strings or name in self.arrays

    def _var(self, part: _Part) -> list[Chunk]:
        split = not part.quoted
        name, op = part.text, part.op
        if op == "?":
            return [Chunk("", part.line, note=f"${{{name}}} is not expanded by ndplan")]
        if op == "#":
            return [Chunk(str(len("".join(c.text for c in self._string(name)))), part.line, split)]
        if op in ("[@]", "[*]"):
            if name not in self.arrays:
                value = self._string(name)
                return [Chunk(c.text, c.line, split, c.note) for c in value] or self._unset(part)
            out: list[Chunk] = []
            for i, element in enumerate(self.arrays[name]):
                if i:
                    # "${A[@]}" keeps elements apart; a NUL-free marker splits them later.
                    out.append(Chunk("\x00" if (op == "[@]" and part.quoted) else " ", part.line, split or op == "[@]"))
                out.extend(Chunk(c.text, c.line, split, c.note) for c in element)
            return out
        value = self._string(name)
        empty = not "".join(c.text for c in value)
        if op in (":-", ":=", ":+", "-", "=", "+"):
            use_default = (empty if op.startswith(":") else not self._is_set(name))
            if op.endswith("+"):
                if use_default:
                    return []
                return [Chunk(c.text, c.line, split, c.note) for c in self._chunks(part.arg)]
            if use_default:
                default = [Chunk(c.text, c.line, False, c.note) for c in self._chunks(part.arg)]
                if op.endswith("="):
                    self.strings[name] = default
                return [Chunk(c.text, c.line, split, c.note) for c in default]
        if not self._is_set(name):
            return self._unset(part)
        return [Chunk(c.text, c.line, split, c.note) for c in value]

    @staticmethod
    def _unset(part: _Part) -> list[Chunk]:
        return [Chunk("", part.line, not part.quoted, note=f"${part.text} is not set in the script")]

    def _fields(self, parts: list[_Part]) -> list[Word]:
        """Word splitting: unquoted expansion output splits on blanks; the rest glues together."""
        fields: list[Word] = []
        text: list[str] = []
        line: int | None = None
        note: str | None = None
        started = False

        def close() -> None:
            nonlocal text, line, note, started
            if started:
                fields.append(Word("".join(text), line if line is not None else 0, note))
            text, line, note, started = [], None, None, False

        for chunk in self._chunks(parts):
            if chunk.note and not chunk.text:
                # Something unresolved: keep a (possibly empty) word so errors can say why.
                if line is None:
                    line = chunk.line
                note = note or chunk.note
                started = True
                continue
            if not chunk.split:
                if line is None:
                    line = chunk.line
                text.append(chunk.text)
                note = note or chunk.note
                started = True
                continue
            pieces = re.split(r"([ \t\n\x00]+)", chunk.text)
            for piece in pieces:
                if not piece:
                    continue
                if re.fullmatch(r"[ \t\n\x00]+", piece):
                    close()
                else:
                    if line is None:
                        line = chunk.line
                    text.append(piece)
                    note = note or chunk.note
                    started = True
        close()
        # An unset variable alone still leaves an empty word behind (with its note) so a flag
        # that expected a value can say where the value went; drop empty words without a note.
        return [f for f in fields if f.text or f.note or _had_quotes(parts)]


def _size(value: list[Chunk] | list[Word]) -> int:
    """Characters plus pieces: empty pieces (unset variables) count too."""
    return len(value) + sum(len(c.text) for c in value)


def _check_size(size: int, line: int) -> None:
    if size > MAX_EXPANSION:
        raise ShellSyntaxError(line, f"expands to over {MAX_EXPANSION:,} characters (a launch script's "
                                     "variables hold a few thousand): a variable built from itself?")


def _had_quotes(parts: list[_Part]) -> bool:
    return any(p.quoted for p in parts)


def run_script(text: str, env: dict[str, str] | None = None) -> list[list[Word]]:
    """Every non-assignment command of the script, expanded (see the module docstring)."""
    return Shell(env).run(text)
