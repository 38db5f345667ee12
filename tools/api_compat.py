"""Drop-in compatibility audit between Opacus's public API and dptorch's.

Two modes, chosen by what is importable (or forced with ``--dump`` / ``--check``):

* **dump** (run with an interpreter where ``opacus`` is installed)::

      /work/opacus-venv/bin/python tools/api_compat.py --dump tools/opacus_api.json

  walks every importable module under ``opacus`` and writes, per module, every public name
  (no leading underscore; defined in that module, or listed in its ``__all__``), its kind and,
  for functions and classes, the parameters of ``inspect.signature`` (``__init__`` and the
  public methods of classes defined in the package).

* **check** (run with dptorch's interpreter)::

      .venv/bin/python tools/api_compat.py --check tools/opacus_api.json --report /tmp/api_report.txt

  maps each ``opacus.X`` to ``dptorch.X`` and reports missing modules, missing names and
  signature differences (missing parameters, differing defaults, kind mismatches, positional
  order, extra required parameters).

The comparison helpers (:func:`load_api`, :func:`compare_params`, :func:`signature_of`) are
also used by ``tests/compat/test_api_compat.py``, which runs without Opacus installed.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import inspect
import json
import logging
import pkgutil
import re
import sys
import warnings
from pathlib import Path
from typing import Any

SOURCE_PKG = "opacus"
TARGET_PKG = "dptorch"

# Sub-trees that are not part of the library API (or need heavy optional dependencies).
SKIP_PARTS = {"tests", "test", "examples", "research", "benchmarks", "__main__"}

_ADDR = re.compile(r" at 0x[0-9a-fA-F]+")

# ---------------------------------------------------------------------------------------------
# Signatures as plain data
# ---------------------------------------------------------------------------------------------

_KIND_NAMES = {
    inspect.Parameter.POSITIONAL_ONLY: "positional_only",
    inspect.Parameter.POSITIONAL_OR_KEYWORD: "positional_or_keyword",
    inspect.Parameter.VAR_POSITIONAL: "var_positional",
    inspect.Parameter.KEYWORD_ONLY: "keyword_only",
    inspect.Parameter.VAR_KEYWORD: "var_keyword",
}


def normalize_repr(value: Any) -> str:
    """A stable textual form of a default value, with package names and addresses neutralised."""
    if inspect.isclass(value) or inspect.isfunction(value):
        text = f"<{type(value).__name__} {value.__module__}.{value.__qualname__}>"
    else:
        try:
            text = repr(value)
        except Exception:  # pragma: no cover - exotic reprs
            text = f"<unrepresentable {type(value).__name__}>"
    text = _ADDR.sub("", text)
    return text.replace(SOURCE_PKG + ".", "<pkg>.").replace(TARGET_PKG + ".", "<pkg>.")


def signature_of(obj: Any) -> list[dict[str, Any]] | None:
    """``inspect.signature`` as a list of ``{name, kind[, default]}``; ``None`` if unavailable."""
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return None
    params = []
    for p in sig.parameters.values():
        entry: dict[str, Any] = {"name": p.name, "kind": _KIND_NAMES[p.kind]}
        if p.default is not inspect.Parameter.empty:
            entry["default"] = normalize_repr(p.default)
        params.append(entry)
    return params


def _kind_of(obj: Any) -> str:
    if inspect.isclass(obj):
        return "class"
    if inspect.ismodule(obj):
        return "module"
    if callable(obj) and (inspect.isroutine(obj) or hasattr(obj, "__wrapped__")):
        return "function"
    return "other"


def _class_members(cls: type, pkg: str) -> dict[str, dict[str, Any]]:
    """``__init__`` and public methods/properties defined by classes of ``pkg`` in the MRO."""
    members: dict[str, dict[str, Any]] = {}
    for klass in reversed(cls.__mro__):  # base first, so overrides win
        if not (getattr(klass, "__module__", "") or "").startswith(pkg):
            continue
        for name, raw in vars(klass).items():
            if name.startswith("_") and name != "__init__":
                continue
            if isinstance(raw, property):
                members[name] = {"kind": "property"}
            elif isinstance(raw, staticmethod):
                members[name] = {"kind": "staticmethod", "params": signature_of(raw.__func__)}
            elif isinstance(raw, classmethod):
                members[name] = {
                    "kind": "classmethod",
                    "params": signature_of(getattr(cls, name)),
                }
            elif inspect.isfunction(raw):
                members[name] = {"kind": "method", "params": signature_of(raw)}
    return members


def _top_level_assignments(module: Any) -> set[str]:
    """Names bound by top-level assignments in the module's source (constants, aliases)."""
    try:
        tree = ast.parse(inspect.getsource(module))
    except (OSError, TypeError, SyntaxError):
        return set()
    names: set[str] = set()
    for node in tree.body:
        targets: list[ast.AST] = []
        if isinstance(node, ast.Assign):
            targets = list(node.targets)
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
            targets = [node.target]
        for t in targets:
            for sub in ast.walk(t):
                if isinstance(sub, ast.Name):
                    names.add(sub.id)
    return names


def describe_module(module: Any) -> dict[str, Any]:
    """Public names of one module: kind, signature, class members."""
    modname = module.__name__
    exported = getattr(module, "__all__", None)
    assigned = _top_level_assignments(module)
    names: dict[str, Any] = {}
    for name, obj in sorted(vars(module).items()):
        if name.startswith("_") and not (exported and name in exported):
            continue
        listed = bool(exported) and name in exported
        defined_here = (
            getattr(obj, "__module__", None) == modname if not inspect.ismodule(obj) else False
        )
        if not (listed or defined_here or (name in assigned and not inspect.ismodule(obj))):
            continue
        if isinstance(obj, logging.Logger) and not listed:
            continue  # module loggers are not API
        kind = _kind_of(obj)
        entry: dict[str, Any] = {"kind": kind}
        origin = getattr(obj, "__module__", None)
        if kind in ("class", "function") and isinstance(origin, str) and origin != modname:
            entry["origin"] = origin  # a re-export: its signature is checked where it is defined
        if kind == "class":
            entry["members"] = _class_members(obj, SOURCE_PKG)
            entry["bases"] = [f"{b.__module__}.{b.__qualname__}" for b in obj.__bases__]
        elif kind == "function":
            entry["params"] = signature_of(obj)
        if listed:
            entry["in_all"] = True
        names[name] = entry
    return {"all": list(exported) if exported else None, "names": names}


def dump(out: Path) -> None:
    pkg = importlib.import_module(SOURCE_PKG)
    modules: dict[str, Any] = {}
    skipped: dict[str, str] = {}
    names = [SOURCE_PKG] + [
        m.name
        for m in pkgutil.walk_packages(
            pkg.__path__, prefix=SOURCE_PKG + ".", onerror=lambda n: None
        )
    ]
    for name in sorted(set(names)):
        if any(part in SKIP_PARTS for part in name.split(".")):
            continue
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                module = importlib.import_module(name)
        except Exception as e:  # optional dependency missing, etc.
            skipped[name] = f"{type(e).__name__}: {e}"
            continue
        modules[name] = describe_module(module)
    data = {
        "package": SOURCE_PKG,
        "version": getattr(pkg, "__version__", None),
        "python": sys.version.split()[0],
        "modules": modules,
        "skipped": skipped,
    }
    out.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    print(f"wrote {len(modules)} modules ({len(skipped)} skipped) to {out}")


# ---------------------------------------------------------------------------------------------
# Comparison
# ---------------------------------------------------------------------------------------------


def load_api(path: Path | str) -> dict[str, Any]:
    return json.loads(Path(path).read_text())


def target_name(source_module: str) -> str:
    return TARGET_PKG + source_module[len(SOURCE_PKG) :]


def compare_params(
    expected: list[dict[str, Any]] | None, actual: list[dict[str, Any]] | None
) -> list[str]:
    """Differences between two parameter lists (as produced by :func:`signature_of`).

    Allowed: extra parameters with defaults that are keyword-only or come after all of the
    expected positional parameters, and extra ``*args``/``**kwargs``. Everything else is a
    difference: missing parameter, different default, kind mismatch, positional order change,
    extra required parameter.
    """
    if expected is None or actual is None:
        return [] if expected is None else ["signature not introspectable"]
    problems: list[str] = []
    act = {p["name"]: p for p in actual}
    exp_names = {p["name"] for p in expected}
    var_kw = any(p["kind"] == "var_keyword" for p in actual)
    for p in expected:
        if p["kind"] in ("var_positional", "var_keyword"):
            if not any(q["kind"] == p["kind"] for q in actual):
                problems.append(
                    f"missing {'*' if p['kind'] == 'var_positional' else '**'}{p['name']}"
                )
            continue
        q = act.get(p["name"])
        if q is None:
            note = " (absorbed by **kwargs)" if var_kw else ""
            problems.append(f"missing parameter {p['name']!r}{note}")
            continue
        if p["kind"] != q["kind"]:
            # positional_or_keyword accepts every call a positional_only/keyword_only one does.
            if q["kind"] != "positional_or_keyword":
                problems.append(f"{p['name']!r}: kind {q['kind']} (expected {p['kind']})")
        if "default" in p and "default" not in q:
            problems.append(f"{p['name']!r}: no default (expected {p['default']})")
        elif "default" not in p and "default" in q:
            pass  # optional where Opacus requires: every call still works
        elif "default" in p and p["default"] != q["default"]:
            problems.append(f"{p['name']!r}: default {q['default']} (expected {p['default']})")
    exp_pos = [
        p["name"] for p in expected if p["kind"] in ("positional_only", "positional_or_keyword")
    ]
    act_pos = [
        p["name"] for p in actual if p["kind"] in ("positional_only", "positional_or_keyword")
    ]
    common = [n for n in act_pos if n in exp_pos]
    if common != [n for n in exp_pos if n in act_pos]:
        problems.append(f"positional order {act_pos} (expected {exp_pos})")
    else:
        # An extra positional parameter inserted before an expected one shifts positional calls.
        for i, n in enumerate(act_pos):
            if n not in exp_names and any(m in exp_pos for m in act_pos[i + 1 :]):
                problems.append(f"extra positional parameter {n!r} shifts later positions")
    for q in actual:
        if q["name"] in exp_names or q["kind"] in ("var_positional", "var_keyword"):
            continue
        if "default" not in q:
            problems.append(f"extra required parameter {q['name']!r}")
    return problems


def _resolve(target_mod: Any, name: str) -> tuple[bool, Any]:
    if hasattr(target_mod, name):
        return True, getattr(target_mod, name)
    return False, None


def check(api: dict[str, Any], only: list[str] | None = None) -> tuple[list[str], dict[str, int]]:
    """Compare the dumped API with the importable target package; returns report lines and counts."""
    lines: list[str] = []
    counts = {
        "modules": 0,
        "missing_modules": 0,
        "names": 0,
        "missing_names": 0,
        "signature_diffs": 0,
        "notes": 0,
    }
    for src_mod in sorted(api["modules"]):
        if only and not any(src_mod == o or src_mod.startswith(o + ".") for o in only):
            continue
        counts["modules"] += 1
        entry = api["modules"][src_mod]
        tgt = target_name(src_mod)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                mod = importlib.import_module(tgt)
        except Exception as e:
            counts["missing_modules"] += 1
            pub = ", ".join(sorted(entry["names"])) or "-"
            lines.append(f"MISSING MODULE {tgt}  ({type(e).__name__}: {e})\n    names: {pub}")
            continue
        mod_lines: list[str] = []
        for name, spec in sorted(entry["names"].items()):
            counts["names"] += 1
            if spec["kind"] == "module":
                continue  # submodules are checked as modules in their own right
            present, obj = _resolve(mod, name)
            if not present:
                counts["missing_names"] += 1
                sig = ""
                if spec.get("params") is not None:
                    sig = _fmt_sig(spec["params"])
                elif spec["kind"] == "class" and "__init__" in spec.get("members", {}):
                    sig = _fmt_sig(spec["members"]["__init__"].get("params"))
                mod_lines.append(f"  MISSING {spec['kind']} {name}{sig}")
                continue
            if spec.get("origin") in api["modules"]:
                continue  # re-export: compared in its defining module
            for msg in _compare_object(name, spec, obj):
                if msg.startswith("NOTE"):
                    counts["notes"] += 1
                else:
                    counts["signature_diffs"] += 1
                mod_lines.append(f"  {msg}")
        if mod_lines:
            lines.append(f"{src_mod} -> {tgt}")
            lines.extend(mod_lines)
    return lines, counts


def _fmt_sig(params: list[dict[str, Any]] | None) -> str:
    if params is None:
        return "(...)"
    out = []
    seen_kw = False
    for p in params:
        if p["kind"] == "keyword_only" and not seen_kw:
            out.append("*")
            seen_kw = True
        if p["kind"] == "var_positional":
            seen_kw = True
            out.append("*" + p["name"])
        elif p["kind"] == "var_keyword":
            out.append("**" + p["name"])
        else:
            out.append(p["name"] + (f"={p['default']}" if "default" in p else ""))
    return "(" + ", ".join(out) + ")"


def _is_opaque(params: list[dict[str, Any]] | None) -> bool:
    if not params:
        return False
    named = [
        p
        for p in params
        if p["kind"] not in ("var_positional", "var_keyword") and p["name"] != "self"
    ]
    return not named and {p["kind"] for p in params} >= {"var_positional", "var_keyword"}


def _compare_object(name: str, spec: dict[str, Any], obj: Any) -> list[str]:
    kind = _kind_of(obj)
    msgs: list[str] = []
    if spec["kind"] in ("class", "function") and kind != spec["kind"]:
        if not (spec["kind"] == "function" and callable(obj)):
            msgs.append(f"KIND {name}: {kind} (expected {spec['kind']})")
            return msgs
    if spec["kind"] == "function":
        for d in compare_params(spec.get("params"), signature_of(obj)):
            msgs.append(f"SIGNATURE {name}: {d}")
    elif spec["kind"] == "class" and inspect.isclass(obj):
        for mname, mspec in sorted(spec.get("members", {}).items()):
            raw = inspect.getattr_static(obj, mname, None)
            if raw is None and mspec["kind"] == "property":
                msgs.append(
                    f"NOTE {name}.{mname}: no class-level property (fine if an instance attribute)"
                )
                continue
            if raw is None:
                sig = _fmt_sig(mspec.get("params")) if "params" in mspec else ""
                msgs.append(f"MISSING {mspec['kind']} {name}.{mname}{sig}")
                continue
            if mspec["kind"] == "property":
                continue
            target = getattr(obj, mname)
            if mspec["kind"] in ("method",) and isinstance(raw, (staticmethod, classmethod)):
                msgs.append(f"KIND {name}.{mname}: {type(raw).__name__} (expected method)")
                continue
            actual = signature_of(raw.__func__ if isinstance(raw, staticmethod) else target)
            if mspec["kind"] == "method" and mname != "__init__" and not callable(target):
                msgs.append(f"KIND {name}.{mname}: not callable (expected method)")
                continue
            if _is_opaque(actual) and not _is_opaque(mspec.get("params")):
                msgs.append(
                    f"NOTE {name}.{mname}: opaque (*args, **kwargs) signature, forwards to its base"
                )
                continue
            for d in compare_params(mspec.get("params"), actual):
                msgs.append(f"SIGNATURE {name}.{mname}: {d}")
    return msgs


def main(argv: list[str] | None = None) -> int:
    here = Path(__file__).resolve().parent
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dump", metavar="JSON", nargs="?", const=str(here / "opacus_api.json"))
    ap.add_argument("--check", metavar="JSON", nargs="?", const=str(here / "opacus_api.json"))
    ap.add_argument("--report", metavar="TXT", default="/tmp/api_report.txt")
    ap.add_argument("--only", nargs="*", help="restrict the check to these opacus modules")
    args = ap.parse_args(argv)
    if args.dump is None and args.check is None:
        try:
            importlib.import_module(SOURCE_PKG)
            args.dump = str(here / "opacus_api.json")
        except ImportError:
            args.check = str(here / "opacus_api.json")
    if args.dump is not None:
        dump(Path(args.dump))
        return 0
    api = load_api(args.check)
    lines, counts = check(api, args.only)
    header = [
        f"{SOURCE_PKG} {api.get('version')} -> {TARGET_PKG} API compatibility report",
        "counts: " + ", ".join(f"{k}={v}" for k, v in counts.items()),
        "",
    ]
    text = "\n".join(header + lines) + "\n"
    Path(args.report).write_text(text)
    print(text if len(text) < 20000 else "\n".join(header) + f"(full report in {args.report})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
