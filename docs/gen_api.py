"""Render docs/api.md from fully_shard's public names and their docstrings.

    python3 docs/gen_api.py          # rewrite docs/api.md
    python3 docs/gen_api.py --check  # exit 1 if docs/api.md is out of date

Docstrings are written Google-style (a summary line, prose, ``Args:``, ``Returns:``,
``Example::``); this turns them into Markdown without interpreting anything else.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import inspect
import os
import re
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "docs", "api.md")
sys.path.insert(0, ROOT)

import fully_shard  # noqa: E402

SECTION = re.compile(r"^(Args|Arguments|Returns|Raises|Example|Examples):{1,2}\s*$")


def _markdown(doc: str) -> str:
    """Google-style docstring -> Markdown."""
    out: list[str] = []
    lines = doc.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        m = SECTION.match(line)
        if not m:
            out.append(re.sub(r":(?:class|func|meth|attr):`~?([^`]+)`", r"`\1`", line).replace("``", "`"))
            i += 1
            continue
        name = m.group(1)
        body: list[str] = []
        i += 1
        while i < len(lines) and (not lines[i].strip() or lines[i].startswith(" ")):
            body.append(lines[i])
            i += 1
        while body and not body[-1].strip():
            body.pop()
        text = textwrap.dedent("\n".join(body))
        if name.startswith("Example"):
            code = "\n".join(_code_line(b, ">>> " in text) for b in text.splitlines())
            out += ["**Example:**", "", "```python", code, "```", ""]
        elif name in ("Args", "Arguments"):
            out += ["**Arguments:**", ""]
            for entry in re.split(r"\n(?=\S)", text):
                arg, _, desc = entry.partition(":")
                desc = " ".join(desc.split()).replace("``", "`")
                desc = re.sub(r":(?:class|func|meth|attr):`~?([^`]+)`", r"`\1`", desc)
                out.append(f"- `{arg.strip()}`: {desc}")
            out.append("")
        else:
            desc = " ".join(text.split()).replace("``", "`")
            desc = re.sub(r":(?:class|func|meth|attr):`~?([^`]+)`", r"`\1`", desc)
            out += [f"**{name}:** {desc}", ""]
    return "\n".join(out).strip() + "\n"


def _code_line(line: str, doctest: bool) -> str:
    """A line of an ``Example::`` as Python: without the doctest prompts and directives (``# doctest: +SKIP``), and
    the output a doctest shows as a comment."""
    if doctest and line.strip() and not re.match(r"(>>>|\.\.\.)( |$)", line):
        return "# " + line
    return re.sub(r"^(>>> |\.\.\. ?)|\s*# doctest: .*$", "", line)


class _Default:
    """Shows a default by a stable text: a dataclass instance equal to its class's default as ``Name()``, a function by
    its name (not its address)."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text


def _shown(value: object) -> object:
    cls = type(value)
    if dataclasses.is_dataclass(cls) and value == cls():
        return _Default(f"{cls.__name__}()")
    return _Default(value.__name__) if inspect.isfunction(value) else value


def _format_signature(name: str, sig: inspect.Signature, drop_self: bool = False) -> str:
    """``name(a: T = d, ...) -> R`` with string annotations unquoted; one parameter per
    line when it does not fit in 88 columns."""
    params = [p.replace(default=_shown(p.default)) for p in sig.parameters.values()]
    if drop_self and params and params[0].name == "self":
        params = params[1:]
    sig = sig.replace(parameters=params)
    text = re.sub(r"(: |-> )'([^']*)'", r"\1\2", f"{name}{sig}")
    if len(text) <= 88:
        return text
    head, _, ret = text.rpartition(") -> ")
    pieces = [re.sub(r"(: |-> )'([^']*)'", r"\1\2", str(p)) for p in sig.parameters.values()]
    for i, p in enumerate(sig.parameters.values()):
        if p.kind is inspect.Parameter.KEYWORD_ONLY and (i == 0 or list(sig.parameters.values())[i - 1].kind
                                                       is not inspect.Parameter.KEYWORD_ONLY):
            pieces.insert(i, "*")
            break
    body = "".join(f"    {piece},\n" for piece in pieces)
    return f"{name}(\n{body}) -> {ret}" if ret else f"{name}(\n{body})"


def _signature(name: str, obj: object) -> str:
    if inspect.isclass(obj) and dataclasses.is_dataclass(obj):
        fields = [
            f"{f.name}: {f.type} = {f.default!r}" if f.default is not dataclasses.MISSING else f"{f.name}: {f.type}"
            for f in dataclasses.fields(obj)
        ]
        bases = [b.__name__ for b in obj.__bases__ if b is not object]
        head = f"@dataclass(frozen=True)\nclass {name}"
        one_line = f"{head}({', '.join(fields)})"
        if len(one_line.splitlines()[-1]) <= 88:
            text = one_line
        else:
            text = head + "(\n" + "".join(f"    {f},\n" for f in fields) + ")"
        return text + (f"  # subclass of {', '.join(bases)}" if bases else "")
    if inspect.isclass(obj):
        bases = ", ".join(b.__name__ for b in obj.__bases__ if b is not object)
        return f"class {name}({bases})" if bases else f"class {name}"
    return _format_signature(name, inspect.signature(obj))  # type: ignore[arg-type]


def _methods(cls: type) -> list[tuple[str, object]]:
    return [
        (n, f)
        for n, f in cls.__dict__.items()
        if not n.startswith("_") and callable(f) and getattr(f, "__doc__", None)
    ]


def _in_torch(name: str, method: str | None = None) -> bool:
    """Whether torch's FSDP2 has this public name (and method)."""
    import torch.distributed.fsdp as torch_fsdp

    obj = getattr(torch_fsdp, name, None)
    if obj is None:
        return False
    return method is None or callable(getattr(obj, method, None))


# Public subpackages documented after fully_shard.optim (all fully_shard additions).
SUBPACKAGES = (
    ("fully_shard.tools", "planner, comm trace, wrap helpers, debug mode"),
    ("fully_shard.ckpt", "crash-safe checkpoints, CheckpointManager, conversion to one file"),
    ("fully_shard.quant", "quantized all-gather / reduce-scatter as torch Comm objects, quantize_comms"),
    ("fully_shard.tools.ft", "fault-tolerant HSDP on torchft: the replicate reduction and live recovery"),
)


def _entry(name: str, obj: object, torch_names: bool, level: str = "##") -> list[str]:
    """One public name (and a class's documented methods) as Markdown."""
    addition = ["*fully_shard addition: not in torch's FSDP2.*", ""]
    note = [] if (not torch_names or _in_torch(name)) else addition
    parts = [f"{level} {name}", "", "```python", _signature(name, obj), "```", "", *note,
             _markdown(inspect.getdoc(obj) or "")]
    if inspect.isclass(obj):
        for mname, meth in _methods(obj):
            note = [] if (not torch_names or _in_torch(name, mname)) else addition
            parts += [
                f"{level}# {name}.{mname}",
                "",
                "```python",
                _format_signature(f"{name}.{mname}", inspect.signature(meth), drop_self=True),  # type: ignore[arg-type]
                "```",
                "",
                *note,
                _markdown(inspect.getdoc(meth) or ""),
            ]
    return parts


def render() -> str:
    parts = [
        "# API reference",
        "",
        "<!-- Generated by docs/gen_api.py from the docstrings in fully_shard/; do not edit by hand. -->",
        "",
        "Everything below is importable from `fully_shard`. Names that torch's FSDP2",
        "(`torch.distributed.fsdp`) also has keep its signature and meaning; the others are",
        "marked *fully_shard addition*. Start with `fully_shard`.",
        "",
    ]
    import fully_shard.optim as optim

    parts += [f"- [`{n}`](#{n.lower()})" + ("" if _in_torch(n) else " (addition)") for n in fully_shard.__all__]
    parts.append(f"- [`fully_shard.optim`](#fully_shardoptim) (addition): {', '.join(f'`{n}`' for n in optim.__all__)}")
    for module, blurb in SUBPACKAGES:
        parts.append(f"- [`{module}`](#{module.replace('.', '')}) (addition): {blurb}")
    parts.append("")
    for name in fully_shard.__all__:
        parts += _entry(name, getattr(fully_shard, name), torch_names=True)
    parts += [
        "## fully_shard.optim",
        "",
        "*fully_shard addition: not in torch's FSDP2.* Optimizers for sharded parameters;",
        "see [optimizers.md](optimizers.md).",
        "",
    ]
    for name in optim.__all__:
        obj = getattr(optim, name)
        if isinstance(obj, tuple):  # a constant tuple of classes (ELEMENTWISE_OPTIMIZERS): its entries
            entries = ", ".join(f"`{getattr(o, '__module__', '').split('.')[0]}.optim.{o.__name__}`" for o in obj)
            parts += [f"### {name}", "", f"`tuple` with {len(obj)} entries: {entries}.", ""]
            continue
        parts += _entry(name, obj, torch_names=False, level="###")
    for module, _ in SUBPACKAGES:
        mod = importlib.import_module(module)
        parts += [f"## {module}", "", "*fully_shard addition: not in torch's FSDP2.*", "",
                  _markdown(inspect.getdoc(mod) or "")]
        for name in mod.__all__:
            obj = getattr(mod, name)
            if not callable(obj):  # a constant (e.g. a table of presets): its type and size
                parts += [f"### {name}", "", f"`{type(obj).__name__}` with {len(obj)} entries.", ""]
                continue
            parts += _entry(name, obj, torch_names=False, level="###")
    return "\n".join(parts).rstrip() + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if docs/api.md is out of date")
    args = parser.parse_args()
    text = render()
    if args.check:
        with open(OUT) as f:
            if f.read() != text:
                print("docs/api.md is out of date: run python3 docs/gen_api.py", file=sys.stderr)
                return 1
        return 0
    with open(OUT, "w") as f:
        f.write(text)
    print(f"wrote {os.path.relpath(OUT, ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
