"""Text -> IR: the lark grammar, syntax diagnostics, and the builder of typed nodes.

The parser is built once (LALR, contextual lexer) and turns text straight into small
syntax records with an inline transformer (no parse tree is materialised, which matters
for files with tens of thousands of slices). The builder then checks every ``key = value``
against the schema of its block and makes the typed dataclasses, collecting every error.
"""

from __future__ import annotations

import bisect
import re
import sys
import threading
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any

import lark
from lark import Token, Transformer, v_args

from .attributes import V, build_attrs
from .cluster import CLUSTER_ATTRS, Cluster
from .diagnostics import Diagnostic, DiagnosticError, DiagnosticSink, Loc, did_you_mean, plural
from .emu import SHARD_ATTRS, STATE_GROUPS, STATES, Emu, Shard, SliceEntry, split_tensor_name
from .gc_pause import gc_paused
from .model import MODEL_ATTRS, Model
from .module import Module
from .plan import LAYOUT_ATTRS, PLAN_ATTRS, Layout, Plan
from .transition import OP_ATTRS, OP_KINDS, TRANSITION_ATTRS, HostRef, Op, ShardRef, Transition
from .units import split_quantity, suggest_unit
from .workload import STAGE_ATTRS, WORKLOAD_ATTRS, Stage, Workload


def grammar_path() -> Path:
    """The grammar, ``nereus/ir/nereus.lark``: package data, beside this module in a source tree and in a wheel."""
    packaged = resources.files("nereus.ir") / "nereus.lark"
    if packaged.is_file():
        return Path(str(packaged))
    raise FileNotFoundError("nereus.lark not found: the package is installed without its grammar")


_tls = threading.local()


def _on_comment(tok: Token) -> Token:
    _tls.comments.append((tok.line, tok.value))
    return tok


@lru_cache(maxsize=1)
def lark_parser() -> lark.Lark:
    return lark.Lark(
        grammar_path().read_text(),
        parser="lalr",
        lexer="contextual",
        transformer=_ToSyntax(),
        lexer_callbacks={"COMMENT": _on_comment},
        maybe_placeholders=True,
    )


# ---------------------------------------------------------------- syntax records


@dataclass
class Decl:
    kind: str  # cluster | model | workload | plan | emu | transition
    name: str
    loc: Loc
    attrs: list  # [(key, V, Loc)]
    children: list  # stages, layouts, shards, ops (as syntax records)
    extra: tuple = ()


def _loc(tok: Token) -> Loc:
    return Loc(tok.line, tok.column, _tls.filename)  # type: ignore[arg-type]  # lexed tokens have line and column


@v_args(inline=True)
class _ToSyntax(Transformer):
    """Inline LALR callbacks: tokens -> ``V`` values and ``Decl`` records."""

    def quantity(self, t):
        return V("quantity", str(t), _loc(t))

    def int(self, t):
        return V("int", int(t), _loc(t))

    def float(self, t):
        return V("float", float(t), _loc(t), str(t))

    def symbol(self, t):
        return V("symbol", str(t), _loc(t))

    def name(self, t):
        return V("name", str(t), _loc(t))

    def dotted(self, t):
        return V("dotted", str(t), _loc(t))

    def opid(self, t):
        return V("opid", str(t), _loc(t))

    def range(self, lo, _dd, hi):
        return V("range", (int(lo), int(hi)), _loc(lo))

    def list(self, lsqb, *items):
        return V("list", [i for i in items[:-1] if i is not None and not isinstance(i, Token)], _loc(lsqb))

    def call(self, name, _lp, *rest):
        kwargs = [r for r in rest if isinstance(r, tuple)]
        return V("call", (str(name), kwargs), _loc(name))

    def kwarg(self, key, _eq, value):
        return (str(key), value, _loc(key))

    def attr(self, key, _eq, value, _comma=None):
        return ("attr", sys.intern(str(key)), value, _loc(key))  # one string per key name, not per line

    def int_list(self, *items):
        out = []
        for it in items:
            if isinstance(it, V):
                out.extend(range(it.value[0], it.value[1] + 1))
            elif it.type == "INT":
                out.append(int(it))
        return out

    def span(self, lo, _c, hi):
        return (int(lo), int(hi), lo)

    def box(self, lsqb, *spans):
        return [s for s in spans if isinstance(s, tuple)], _loc(lsqb)

    def state(self, tok):
        return str(tok)

    op_state = state

    def entry(self, state, tensor, box):
        return ("entry", state or "weight", tensor, box)

    def shard(self, kw, _l, pp, _c, tp, _r, _g, _l2, gpus, _r2, _lb, *rest):
        entries = [e for e in rest[:-1] if e[0] == "entry"]
        attrs = [(e[1], e[2], e[3]) for e in rest[:-1] if e[0] == "attr"]
        return ("shard", int(pp), int(tp), gpus, entries, _loc(kw), attrs)

    def _block(self, kind, kw, name, lbrace, *rest):
        attrs = [(r[1], r[2], r[3]) for r in rest if isinstance(r, tuple) and r[0] == "attr"]
        children = [r for r in rest if not (isinstance(r, tuple) and r[0] == "attr") and not isinstance(r, Token)]
        label = str(name)[1:] if str(name).startswith("@") else str(name)
        return Decl(kind, label, _loc(kw), attrs, children, (_loc(name),))

    def cluster(self, *a):
        return _emit(self._block("cluster", *a))

    def model(self, *a):
        return _emit(self._block("model", *a))

    def workload(self, *a):
        return _emit(self._block("workload", *a))

    def stage(self, *a):
        return self._block("stage", *a)

    def plan(self, *a):
        return _emit(self._block("plan", *a))

    def layout(self, *a):
        return self._block("layout", *a)

    def transition(self, *a):
        return _emit(self._block("transition", *a))

    def emu(self, kw, plan, model_stage, _l, replicas, _r, _lb, *rest):
        shards = [r for r in rest if isinstance(r, tuple)]
        return _emit(
            Decl(
                "emu", str(plan)[1:], _loc(kw), [], shards, (_loc(plan), str(model_stage), replicas, _loc(model_stage))
            )
        )

    def shard_ref(self, ms, _l, dp, _c1, pp, _c2, tp, _r):
        return ShardRef(str(ms), int(dp), int(pp), int(tp)), _loc(ms)

    def host_ref(self, kw, _l, gpu, _r):
        return HostRef(int(gpu)), _loc(kw)

    def endpoints(self, _l, *items):
        return [i for i in items if isinstance(i, tuple)]

    def op(self, opid, _eq, kind, state, tensor, box, *rest):
        src, dst, attrs = [], [], []
        i = 0
        while i < len(rest):
            r = rest[i]
            if isinstance(r, Token) and r.type == "FROM":
                src = rest[i + 1]
                i += 2
                continue
            if isinstance(r, Token) and r.type == "TO":
                dst = rest[i + 1]
                i += 2
                continue
            if isinstance(r, tuple) and r and r[0] == "attr":
                attrs.append((r[1], r[2], r[3]))
            i += 1
        return ("op", str(opid), kind, state or "weight", tensor, box, src, dst, attrs, _loc(opid))

    def start(self, *decls):
        return [d for d in decls if d is not None]


def _emit(decl: Decl) -> Decl | None:
    """A top-level declaration, as the parser reduces it: inside ``parse``, built into the module
    at once (its syntax record is garbage right after, so a large file's peak memory is the
    module's, not the module's and every record's); outside (``lark_parser().parse``), returned."""
    builder = getattr(_tls, "builder", None)
    if builder is None:
        return decl
    try:
        builder.add(decl)
    except Exception as e:  # a bug, not bad input: raised as itself, not as lark's VisitError
        builder.failed = e
        raise
    return None


# ---------------------------------------------------------------- syntax errors


def _syntax_diagnostic(err: lark.exceptions.UnexpectedInput, text: str, filename: str | None) -> Diagnostic:
    line, col = getattr(err, "line", 0) or 0, getattr(err, "column", 0) or 0
    hint = None
    if isinstance(err, lark.exceptions.UnexpectedCharacters):
        assert err.pos_in_stream is not None  # UnexpectedCharacters sets it to the lexer's position
        ch = text[err.pos_in_stream] if err.pos_in_stream < len(text) else ""
        message = f"unexpected character {ch!r}"
        allowed = sorted(err.allowed) if err.allowed else []
        if allowed:
            message += ", expected one of: " + ", ".join(allowed)
        if ch == "#":
            hint = "comments start with //"
        elif ch in "\"'":
            hint = "there are no strings in the language; write names bare: dtype = bf16"
        elif ch in "+-" and _BARE_EXPONENT.search(text, max(0, err.pos_in_stream - 64), err.pos_in_stream):
            hint = _EXPONENT_HINT
        elif ch == "-":
            hint = (
                "only decimal numbers and a few times (admit's saving) may be negative; counts and sizes are not, "
                "and ranges are written 0..7"
            )
        elif ch == "@":
            hint = "a reference is @ followed by a letter or underscore"
    elif isinstance(err, lark.exceptions.UnexpectedToken):
        tok = err.token
        expected = sorted(err.expected)
        if tok.type == "$END":
            line, col = _end_position(text)
            message = "unexpected end of file, expected one of: " + ", ".join(expected)
            open_line = _unclosed_brace(text)
            if open_line:
                hint = f"the block opened at line {open_line} is not closed with '}}'"
        else:
            spaced = _SPACED_UNIT.search(text, 0, tok.start_pos)
            if "EQUAL" in expected and spaced and suggest_unit(spaced.group(2)):
                # `gpu_memory = 80 GiB`: the unit was read as the next attribute's name
                number, unit = spaced.group(1), suggest_unit(spaced.group(2))
                line = text.count("\n", 0, spaced.start(1)) + 1
                col = spaced.start(1) - text.rfind("\n", 0, spaced.start(1))
                return Diagnostic(
                    Loc(line, col, filename),
                    f"'{spaced.group(0).strip()}' has a space between number and unit",
                    f"write {number}{unit}",
                )
            keyword = _KEYWORD_BEFORE.search(text, 0, tok.start_pos)
            if expected == ["EQUAL"] and keyword and keyword.group(1) in STATE_GROUPS:
                # `optimizer layers.0..3.x [..]` as an EMU entry: a group of states is an operation's
                word, pos = keyword.group(1), keyword.start(1)
                line = text.count("\n", 0, pos) + 1
                col = pos - text.rfind("\n", 0, pos)
                return Diagnostic(
                    Loc(line, col, filename),
                    f"'{word}' names several states ({', '.join(STATE_GROUPS[word])}): "
                    "only a transition operation may move them at once",
                    "an EMU entry holds one state: write one entry per state",
                )
            if expected == ["EQUAL"] and keyword and keyword.group(1) in _KEYWORDS:
                # A block keyword where only an attribute may stand: the lexer read it as an
                # attribute name (`emu` inside a plan); point at the keyword, not past it.
                word = keyword.group(1)
                pos = keyword.start(1)
                line = text.count("\n", 0, pos) + 1
                col = pos - text.rfind("\n", 0, pos)
                hint = _HOME.get(
                    word.upper(), f"'{word}' declarations are top-level: close the enclosing block with '}}' first"
                )
                return Diagnostic(
                    Loc(line, col, filename), f"unexpected {word.upper()} '{word}': a {word} cannot appear here", hint
                )
            if expected == ["EQUAL"]:
                stray = _stray_word(err, text, tok, filename)
                if stray is not None:
                    return stray
            shown = tok.value if len(tok.value) <= 40 else tok.value[:37] + "..."
            message = f"unexpected {tok.type} '{shown}', expected one of: " + ", ".join(expected)
            hint = _token_hint(err, text, expected)
    else:  # UnexpectedEOF and anything else lark may add
        line, col = _end_position(text)
        message = "unexpected end of file"
    return Diagnostic(Loc(line, col, filename), message, hint)


def _stray_word(err, text: str, tok: Token, filename: str | None) -> Diagnostic | None:
    """The parser read a word as an attribute's key and found no ``=`` after it. When that word
    stands after a value on its line (``response_len_max = 1024 prompts``, ``4__096``) or alone
    on its line (a key without ``= value``), the mistake is the word, not the token after it (the
    next line's key): point at the word. None: not such a case (``nodes 1`` is reported at ``1``)."""
    stack = err.interactive_parser.parser_state.value_stack if err.interactive_parser else []
    word = stack[-1] if stack else None
    if not isinstance(word, Token) or word.type != "NAME" or word.line is None:
        return None
    prev = _last_attr(stack[:-1])
    loc = Loc(word.line, word.column, filename)  # type: ignore[arg-type]  # lexed tokens have line and column
    if prev is not None and prev[2].loc.line == word.line:
        key, value = prev[1], prev[2]
        assert word.start_pos is not None  # lexed tokens have a position
        if word.value.startswith("_") and word.start_pos > 0 and text[word.start_pos - 1].isdigit():
            start = text.rfind("\n", 0, word.start_pos) + 1 + value.loc.col - 1
            number = text[start : word.end_pos]
            return Diagnostic(
                Loc(value.loc.line, value.loc.col, filename),
                f"malformed number '{number}'",
                "digits may be grouped with one '_' between two digits: 4_096, 1_000_000",
            )
        kinds = _key_kinds(key)
        if value.kind in ("int", "float") and kinds and kinds <= {"int", "posint", "natural", "float", "probability"}:
            hint = f"'{word.value}' is no part of the value: '{key}' takes a bare number ({key} = {_shown(value)})"
        elif value.kind in ("int", "float") and len(kinds) == 1 and next(iter(kinds)) in _DIM_EXAMPLES:
            what, example = _DIM_EXAMPLES[next(iter(kinds))]
            hint = f"'{word.value}' is not a unit of {what}: write the unit right after the number, e.g. {example}"
        else:
            hint = (
                "an attribute's value is one item (a number with its unit, a name, a @reference, a list); "
                "write one attribute per line or separate them with ','"
            )
        return Diagnostic(loc, f"unexpected NAME '{word.value}' after the value of '{key}'", hint)
    if word.line != tok.line:
        return Diagnostic(
            loc, f"attribute '{word.value}' has no value", f"attributes are written key = value: {word.value} = ..."
        )
    return None


def _last_attr(stack: list) -> tuple | None:
    """The last ``("attr", key, V, Loc)`` record on the parser's value stack (inside the trees of
    a block's repeated items, which lark keeps as ``Tree`` until the block is reduced)."""
    for item in reversed(stack):
        if isinstance(item, tuple) and item and item[0] == "attr":
            return item
        if isinstance(item, lark.Tree):
            for child in reversed(item.children):
                if isinstance(child, tuple) and child and child[0] == "attr":
                    return child
            return None
        if isinstance(item, Token) and item.type == "LBRACE":
            return None
    return None


_DIM_EXAMPLES = {
    "size": ("a size", "80GiB"),
    "bandwidth": ("a bandwidth", "450GB/s"),
    "time": ("a time", "2us"),
    "flops": ("a FLOP rate", "989TFLOPs"),
}


@lru_cache(maxsize=None)
def _key_kinds(key: str) -> frozenset[str]:
    """The kinds an attribute ``key`` has in any block's schema (and in records such as link())."""
    kinds: set[str] = set()
    for specs in (
        CLUSTER_ATTRS,
        MODEL_ATTRS,
        WORKLOAD_ATTRS,
        STAGE_ATTRS,
        PLAN_ATTRS,
        LAYOUT_ATTRS,
        SHARD_ATTRS,
        OP_ATTRS,
        TRANSITION_ATTRS,
    ):
        for spec in specs:
            fields = spec.record.fields if spec.record is not None else ()
            kinds.update(f.kind for f in (spec, *fields) if f.key == key)
    return frozenset(kinds)


def _shown(v: V) -> str:
    return str(v.text or v.value) if v.kind in ("int", "float") else "..."


def _end_position(text: str) -> tuple[int, int]:
    """Just past the last character of the last non-blank line (a real line to show)."""
    lines = text.rstrip().split("\n")
    return len(lines), len(lines[-1]) + 1


def _unclosed_brace(text: str) -> int | None:
    stack: list[int] = []
    for lineno, line in enumerate(text.split("\n"), 1):
        code = line.split("//", 1)[0]
        for ch in code:
            if ch == "{":
                stack.append(lineno)
            elif ch == "}" and stack:
                stack.pop()
    return stack[-1] if stack else None


_SPACED_UNIT = re.compile(r"(\d+(?:\.\d+)?)[ \t]+([A-Za-z]+(?:/s)?)\s*\Z")

_KEYWORDS = ("cluster", "model", "workload", "plan", "emu", "transition", "stage", "layout", "shard")
_KEYWORD_BEFORE = re.compile(r"\b([a-z]+)\s+\Z")

_HOME = {
    "LAYOUT": "a layout goes inside a plan: plan @p { ... layout actor.train { ... } }",
    "STAGE": "a stage goes inside a workload: workload @w { ... stage train { ... } }",
    "SHARD": "a shard goes inside an emu block: emu @plan actor.train[0] { shard [0, 0] gpus [0] { ... } }",
    "OPID": "operations go inside a transition: transition @t { %0 = send ... }",
}


# a number with an exponent but no unit, just before the error: `1e3`, `6e-1`
_BARE_EXPONENT = re.compile(r"(?<![A-Za-z0-9_.])[0-9]+(\.[0-9]+)?[eE]\Z")
_EXPONENT_HINT = "an exponent is e and digits, after the number and before any unit: 1e-3, 989e12, 3.35e3GB/s"


def _inside_list(text: str, pos: int, limit: int = 100_000) -> bool:
    """Whether ``pos`` is inside an open ``[`` (the LALR tables also expect COMMA and RSQB after
    an attribute's value, where no list is open)."""
    depth = 0
    for i in range(pos - 1, max(-1, pos - 1 - limit), -1):
        ch = text[i]
        if ch in "])":
            depth += 1
        elif ch in "[(":
            if depth == 0:
                return ch == "["
            depth -= 1
        elif ch in "{}=" and depth == 0:
            return False
    return False


def _token_hint(err, text: str, expected: list[str]) -> str | None:
    tok = err.token
    if tok.type in _HOME:
        return _HOME[tok.type]
    if tok.type in ("CLUSTER", "MODEL", "WORKLOAD", "PLAN", "EMU", "TRANSITION") and "RBRACE" in expected:
        return f"'{tok.value}' declarations are top-level: close the enclosing block with '}}' first"
    prev = text[: tok.start_pos].rstrip()
    if tok.type == "NAME" and prev and prev[-1].isdigit() and suggest_unit(tok.value):
        return f"write the unit right after the number, without a space: {prev.split()[-1]}{suggest_unit(tok.value)}"
    if "EQUAL" in expected and tok.type in ("INT", "QUANTITY", "NAME", "SYMBOL"):
        return "attributes are written key = value"
    if tok.type == "RBRACE" and "EQUAL" not in expected and prev.endswith("="):
        return "an attribute needs a value after '='"
    if tok.type == "INT" and _BARE_EXPONENT.search(text, max(0, tok.start_pos - 64), tok.start_pos):
        return _EXPONENT_HINT  # `nodes = 1e3`: read as the quantity 1e (unit e), then 3
    if (
        tok.type in ("INT", "NAME", "QUANTITY", "SYMBOL", "DOTTED", "OPID")
        and "COMMA" in expected
        and "RSQB" in expected
        and _inside_list(text, tok.start_pos)
    ):
        return "separate list items with ','"
    if tok.type == "FLOAT" and "COLON" in expected:
        return "slices are written start:stop, e.g. [0:1024, 0:4096]"
    return None


# ---------------------------------------------------------------- builder


class _Builder:
    """Typed nodes from syntax records, one top-level declaration at a time, in file order."""

    def __init__(self, sink: DiagnosticSink, filename: str | None):
        self.m = Module(filename=filename)
        self.sink = sink
        self.first_seen: dict[str, Loc] = {}
        self.failed: Exception | None = None

    def add(self, d: Decl) -> None:
        m, sink = self.m, self.sink
        if d.kind == "emu":
            _build_emus(d, m, sink)
            return
        if d.name in self.first_seen:
            sink.error(
                d.extra[0], f"duplicate name @{d.name}", f"first declared at line {self.first_seen[d.name].line}"
            )
            return
        self.first_seen[d.name] = d.extra[0]
        builder = {
            "cluster": _build_cluster,
            "model": _build_model,
            "workload": _build_workload,
            "plan": _build_plan,
            "transition": _build_transition,
        }[d.kind]
        node = builder(d, sink)
        if node is not None:
            getattr(m, d.kind + "s")[d.name] = node


def _build(decls: list[Decl], sink: DiagnosticSink, filename: str | None) -> Module:
    b = _Builder(sink, filename)
    for d in decls:
        b.add(d)
    return b.m


def _typed(cls, kind, specs, d: Decl, sink: DiagnosticSink, **extra):
    before = len(sink.diagnostics)
    values, locs = build_attrs(kind, specs, d.attrs, d.loc, sink)
    if len(sink.diagnostics) > before:
        return None
    return cls(**values, **extra, loc=d.loc, locs=locs)


def _build_cluster(d, sink):
    return _typed(Cluster, f"cluster @{d.name}", CLUSTER_ATTRS, d, sink, name=d.name)


def _build_model(d, sink):
    return _typed(Model, f"model @{d.name}", MODEL_ATTRS, d, sink, name=d.name)


def _build_workload(d, sink):
    stages, seen = [], {}
    for c in d.children:
        if c.name in seen:
            sink.error(
                c.extra[0],
                f"duplicate stage '{c.name}' in workload @{d.name}",
                f"first declared at line {seen[c.name]}",
            )
            continue
        seen[c.name] = c.loc.line
        st = _typed(Stage, f"stage {c.name}", STAGE_ATTRS, c, sink, name=c.name)
        if st is not None:
            stages.append(st)
    return _typed(Workload, f"workload @{d.name}", WORKLOAD_ATTRS, d, sink, name=d.name, stages=stages)


def _build_plan(d, sink):
    layouts, ok = {}, True
    for c in d.children:
        if c.name in layouts:
            sink.error(
                c.extra[0],
                f"duplicate layout for {c.name} in plan @{d.name}",
                f"first given at line {layouts[c.name].loc.line}",
            )
            continue
        lay = _typed(Layout, f"layout {c.name}", LAYOUT_ATTRS, c, sink, model_stage=c.name)
        if lay is None:
            ok = False
        else:
            layouts[c.name] = lay
    plan = _typed(Plan, f"plan @{d.name}", PLAN_ATTRS, d, sink, name=d.name, layouts=layouts)
    return plan if ok else None


def _build_entry(state: str, tensor: Token, box, sink) -> SliceEntry | None:
    split = split_tensor_name(str(tensor))
    loc = _loc(tensor)
    if split is None:
        sink.error(
            loc, f"malformed tensor name '{tensor}'", "per-layer tensors are written layers.N.name or layers.A..B.name"
        )
        return None
    family, layers = split
    spans, box_loc = box
    for lo, hi, tok in spans:
        if hi <= lo:
            sink.error(
                _loc(tok), f"empty slice {lo}:{hi} of {tensor}", "slices are half-open start:stop with start < stop"
            )
            return None
    if layers is not None and layers[1] < layers[0]:
        sink.error(loc, f"empty layer range in {tensor}", "layer ranges are inclusive and ascending: layers.0..15")
        return None
    return SliceEntry(family=family, layers=layers, box=tuple((lo, hi) for lo, hi, _ in spans), state=state, loc=loc)


def _build_emus(d: Decl, m: Module, sink: DiagnosticSink) -> None:
    plan_loc, model_stage, replicas, ms_loc = d.extra
    if len(set(replicas)) != len(replicas):
        sink.error(ms_loc, f"replica listed twice in emu {model_stage}{replicas}")
        return
    built: list[Shard | None] = []
    for _, pp, tp, gpus, entries, loc, attrs in d.children:
        if len(gpus) != len(replicas):
            sink.error(
                loc,
                f"shard [{pp}, {tp}] lists {plural(len(gpus), 'GPU')} for {plural(len(replicas), 'replica')}",
                "a shard lists one GPU per replica of the block, in replica order",
            )
            built.append(None)
            continue
        typed = [_build_entry(state, tensor, box, sink) for _, state, tensor, box in entries]
        values, _ = build_attrs(f"shard [{pp}, {tp}]", SHARD_ATTRS, attrs, loc, sink)
        # a list: Shard.__post_init__ makes it a tuple
        built.append(
            Shard(
                pp=pp,
                tp=tp,
                gpu=-1,
                entries=[e for e in typed if e is not None],  # type: ignore[arg-type]
                loc=loc,
                kv_cache=values.get("kv_cache"),
            )
        )
    for i, r in enumerate(replicas):
        key = (d.name, model_stage, r)
        if key in m.emus:
            sink.error(
                ms_loc,
                f"duplicate emu {model_stage}[{r}] of plan @{d.name}",
                f"first declared at line {m.emus[key].loc.line}",
            )
            continue
        shards = []
        for (_, pp, tp, gpus, _e, loc, _a), s in zip(d.children, built):
            if s is not None:
                shards.append(Shard(pp=s.pp, tp=s.tp, gpu=gpus[i], entries=s.entries, loc=s.loc, kv_cache=s.kv_cache))
        # a list: Emu.__post_init__ makes it a tuple
        emu = Emu(
            plan=d.name,
            model_stage=model_stage,
            replica=r,
            shards=shards,  # type: ignore[arg-type]
            loc=ms_loc,
            plan_loc=plan_loc,
        )
        m.emus[key] = emu


def _build_transition(d, sink):
    ops, seen = [], {}
    for _, opid, kind, state, tensor, box, src, dst, attrs, loc in d.children:
        if opid in seen:
            sink.error(
                loc, f"duplicate operation {opid} in transition @{d.name}", f"first defined at line {seen[opid]}"
            )
            continue
        seen[opid] = loc.line
        if str(kind) not in OP_KINDS:
            sink.error(
                _loc(kind),
                f"unknown operation '{kind}'",
                did_you_mean(str(kind), OP_KINDS) or "operations: " + ", ".join(OP_KINDS),
            )
            continue
        entry = _build_entry(state, tensor, box, sink)
        before = len(sink.diagnostics)
        values, locs = build_attrs(f"operation {opid}", OP_ATTRS, attrs, loc, sink)
        if entry is None or len(sink.diagnostics) > before:
            continue
        ops.append(
            Op(
                id=opid,
                kind=str(kind),
                state=entry.state,
                family=entry.family,
                layers=entry.layers,
                box=entry.box,
                src=[e for e, _ in src],
                dst=[e for e, _ in dst],
                **values,
                loc=loc,
                locs={**locs, "tensor": entry.loc},
                endpoint_locs=[l for _, l in src + dst],
            )
        )
    return _typed(Transition, f"transition @{d.name}", TRANSITION_ATTRS, d, sink, name=d.name, ops=ops)


# ---------------------------------------------------------------- comments


def _attach_comments(m: Module, comments: list[tuple[int, str]]) -> None:
    """Give each ``//`` comment to the first declaration, attribute or item at or after its line."""
    if not comments:
        return
    anchors = []  # (line, column, node, key)

    def add(node, key=None, loc=None):
        loc = loc or node.loc
        anchors.append((loc.line, loc.col, node, key))

    for group in (m.clusters, m.models, m.workloads, m.plans, m.transitions):
        for node in group.values():
            add(node)
            for key, loc in getattr(node, "locs", {}).items():
                add(node, key, loc)
            for child in (
                getattr(node, "stages", []) + list(getattr(node, "layouts", {}).values()) + getattr(node, "ops", [])
            ):
                add(child)
                for key, loc in child.locs.items():
                    if key != "tensor":
                        add(child, key, loc)
    seen = set()  # replicas parsed from one block share locations: anchor the first only
    item: Any  # an Emu or one of its shards
    for emu in sorted(m.emus.values(), key=lambda e: e.key):
        for item in [emu, *emu.shards]:
            if (item.loc.line, item.loc.col) not in seen:
                seen.add((item.loc.line, item.loc.col))
                add(item)
    anchors.sort(key=lambda a: (a[0], a[1]))
    lines = [a[0] for a in anchors]
    for line, text in comments:
        # A comment after code on the same line trails the last item of that line
        # (`nodes = 2  // why`); a comment on its own line leads the next item.
        i = bisect.bisect_right(lines, line) - 1
        trailing = i >= 0 and lines[i] == line
        if not trailing:
            i = bisect.bisect_left(lines, line)
            if i == len(anchors):
                m.trailing_comments.append(text)
                continue
        _, _, node, key = anchors[i]
        node.comments.setdefault(key, []).append((text, trailing))


# ---------------------------------------------------------------- entry point


def parse(text: str, filename: str | None = None) -> Module:
    """Parse ``.nir`` text into a Module. Raises DiagnosticError with every error found.

    Only syntax and schema (attribute names, types, units, duplicate names) are checked
    here; cross-references and semantic rules are ``verify``'s.
    """
    with gc_paused():  # millions of small objects, no cycles (gc_pause.py)
        return _parse(text, filename)


def _parse(text: str, filename: str | None) -> Module:
    _tls.filename = filename
    _tls.comments = []
    sink = DiagnosticSink(filename)
    _tls.builder = builder = _Builder(sink, filename)  # declarations are built as they are parsed
    try:
        lark_parser().parse(text)
    except lark.exceptions.UnexpectedInput as e:
        raise DiagnosticError([_syntax_diagnostic(e, text, filename)], text) from None
    except lark.exceptions.VisitError as e:  # an error inside a callback: a malformed token
        if builder.failed is not None:
            raise builder.failed from None
        raise DiagnosticError([Diagnostic(Loc(0, 0, filename), f"cannot parse: {e.orig_exc}")], text) from None
    finally:
        _tls.builder = None
    m = builder.m
    sink.raise_if_any(text)
    _attach_comments(m, _tls.comments)
    m.source = text
    return m


def parse_file(path: str | Path) -> Module:
    path = Path(path)
    try:
        text = path.read_text()
    except UnicodeDecodeError as e:
        raise DiagnosticError(
            [Diagnostic(Loc(0, 0, str(path)), f"not a UTF-8 text file ({e.reason} at byte {e.start})")]
        ) from None
    return parse(text, str(path))


__all__ = ["parse", "parse_file", "grammar_path", "STATES", "split_quantity"]
