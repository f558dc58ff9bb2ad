"""Record Megatron-LM's command-line flags at a tag, as its own parser builds them.

    python tools/megatron_args.py GIT_DIR [--tag core_v0.16.1] [--out dtlib/frameworks/data/megatron_args.json]

``GIT_DIR`` is a clone (or bare mirror) of NVIDIA/Megatron-LM. The script exports ``megatron/`` at
the tag into a temporary folder, then, in a subprocess with that folder first on ``sys.path``, runs
Megatron-LM's own ``megatron.training.arguments.add_megatron_arguments`` on an empty
``argparse.ArgumentParser`` (many flags are generated there from Megatron-Core's ``TransformerConfig``
fields by ``ArgumentGroupFactory``) and writes, for every option string of every action: its ``dest``,
whether it is a switch (takes no value), ``nargs``, the ``type``'s name, ``choices`` and ``default``
(values that are not JSON written as their ``repr``). The record carries the tag and its commit, so
:mod:`dtlib.frameworks.megatron_args` checks emitted flags against facts with a source; no Megatron
code is copied.

Two shims let the parser import on a CPU machine without Megatron-LM's training dependencies:
``megatron.training`` is made a bare package (its ``__init__`` imports the trainer, which needs
triton), with the ``get_*`` accessors of ``global_vars`` that ``training/utils.py`` imports from it;
and ``regex`` (used only by the GPT-2 tokenizer) is Python's ``re``. Neither touches the parser.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

DEFAULT_OUT = Path(__file__).resolve().parents[1] / "dtlib" / "frameworks" / "data" / "megatron_args.json"


def _jsonable(value: object) -> object:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)) and all(v is None or isinstance(v, (bool, int, float, str)) for v in value):
        return list(value)
    return repr(value)


def _dump(tree: str) -> dict[str, dict[str, object]]:
    """Run in the subprocess: every option string of Megatron-LM's parser -> its record."""
    import re
    import types
    import warnings

    warnings.simplefilter("ignore")
    sys.path.insert(0, tree)
    sys.modules.setdefault("regex", re)
    import megatron  # noqa: F401  (the exported tree's package, first on sys.path)

    package = types.ModuleType("megatron.training")
    package.__path__ = [str(Path(tree) / "megatron" / "training")]
    sys.modules["megatron.training"] = package
    import megatron.training.global_vars as global_vars

    for name in dir(global_vars):
        if name.startswith("get_"):
            setattr(package, name, getattr(global_vars, name))
    from megatron.training.arguments import add_megatron_arguments

    parser = argparse.ArgumentParser(allow_abbrev=False)
    add_megatron_arguments(parser)
    flags: dict[str, dict[str, object]] = {}
    for action in parser._actions:
        if not action.option_strings or isinstance(action, argparse._HelpAction):
            continue
        switch = action.nargs == 0
        record = {"dest": action.dest, "switch": switch, "default": _jsonable(action.default)}
        if switch:
            record["const"] = _jsonable(action.const)
        else:
            record["nargs"] = action.nargs
            record["type"] = getattr(action.type, "__name__", None) if action.type else "str"
            record["choices"] = None if action.choices is None else [_jsonable(c) for c in action.choices]
        for option in action.option_strings:
            flags[option] = record
    return dict(sorted(flags.items()))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("git_dir", help="a clone or mirror of NVIDIA/Megatron-LM")
    parser.add_argument("--tag", default="core_v0.16.1")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--dump", help=argparse.SUPPRESS)  # internal: the subprocess's exported tree
    args = parser.parse_args(argv)
    if args.dump:
        json.dump(_dump(args.dump), sys.stdout)
        return 0
    commit = subprocess.run(["git", "-C", args.git_dir, "rev-parse", f"{args.tag}^{{commit}}"],
                            check=True, capture_output=True, text=True).stdout.strip()
    with tempfile.TemporaryDirectory() as tree:
        archive = subprocess.run(["git", "-C", args.git_dir, "archive", args.tag, "megatron"],
                                 check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", tree], input=archive, check=True)
        out = subprocess.run([sys.executable, __file__, args.git_dir, "--dump", tree],
                             check=True, capture_output=True, text=True).stdout
    record = {"source": "NVIDIA/Megatron-LM megatron/training/arguments.py add_megatron_arguments",
              "tag": args.tag, "commit": commit, "generator": "tools/megatron_args.py",
              "flags": json.loads(out)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1, sort_keys=False) + "\n")
    print(f"{len(record['flags'])} flags of {args.tag} ({commit[:8]}) -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
