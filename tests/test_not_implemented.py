"""Every `NotImplementedError` a user can reach is listed in docs/not-implemented.md (the README links it), by key.

A user-reachable `raise NotImplementedError(message)` in the core or a plugin starts its message with a
key: literal text up to the first ":" or "(" (e.g. "context parallelism with speculative decoding:
context_parallel_size=2 ..."). The page's "Not implemented yet" table lists every key in its first
column, in backticks, and nothing else: a new refusal fails here until the README names it, and a
refusal that is gone fails here until its row goes. A raise no user can reach (a guard behind an
earlier check, a family's own bug) says why on its line or the line above, after `# internal:`.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = [ROOT / "deepinfer_core", *sorted((ROOT / "plugins").glob("*/src"))]
INTERNAL = "# internal:"
TABLE_HEADING = "# Not implemented yet"
PAGE = ROOT / "docs" / "not-implemented.md"


def first_literal(node: ast.expr) -> str | None:
    """The literal text a message expression starts with (None when it starts with a computed value)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr) and node.values:
        return first_literal(node.values[0])
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return first_literal(node.left)
    return None


def message_key(call: ast.Call) -> str | None:
    """The key of `NotImplementedError(message)`: its literal start up to the first ":" or "(", or None."""
    literal = first_literal(call.args[0]) if call.args else None
    match = re.match(r"([^:(]+)[:(]", literal or "")
    return match.group(1).strip() if match else None


def raises_in(source: str) -> list[tuple[int, str | None]]:
    """`(line, key)` of every user-reachable `raise NotImplementedError...` in a module's `source`."""
    lines = source.splitlines()
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Raise) or node.exc is None:
            continue
        call = node.exc if isinstance(node.exc, ast.Call) else None
        name = call.func if call is not None else node.exc
        if not (isinstance(name, ast.Name) and name.id == "NotImplementedError"):
            continue
        if any(INTERNAL in line for line in lines[max(node.lineno - 2, 0) : node.end_lineno]):
            continue
        found.append((node.lineno, message_key(call) if call is not None else None))
    return sorted(found)


def code_keys() -> dict[str, list[str]]:
    """Key -> the `path:line`s raising it, over the core and the plugins (None: a raise without a key)."""
    keys: dict[str, list[str]] = {}
    for root in SOURCES:
        for path in sorted(root.rglob("*.py")):
            for line, key in raises_in(path.read_text(encoding="utf-8")):
                keys.setdefault(key, []).append(f"{path.relative_to(ROOT)}:{line}")
    return keys


def readme_keys(text: str) -> list[str]:
    """The first-column keys of the page's "Not implemented yet" table."""
    section = text.split(TABLE_HEADING, 1)[1].split("\n#", 1)[0] if TABLE_HEADING in text else ""
    return re.findall(r"^\| `([^`]+)` \|", section, flags=re.MULTILINE)


def test_every_user_reachable_refusal_has_a_key():
    keys = code_keys()
    assert None not in keys, f"NotImplementedError without a 'key:' message start at {keys.get(None)}"
    assert len(keys) >= 10  # the scan sees the core's refusals


def test_the_readme_lists_exactly_the_keys_the_code_raises():
    listed = readme_keys(PAGE.read_text(encoding="utf-8"))
    assert len(listed) == len(set(listed)), "a key is listed twice"
    raised = {key: where for key, where in code_keys().items() if key is not None}
    missing = {key: where for key, where in raised.items() if key not in listed}
    assert not missing, f"raised but not in {PAGE.name}'s table: {missing}"
    stale = set(listed) - set(raised)
    assert not stale, f"in {PAGE.name}'s table but raised nowhere: {sorted(stale)}"


def test_the_scan_finds_keys_and_skips_internal_guards():
    source = '''
def f(x):
    if x == 1:
        raise NotImplementedError(f"tensor and expert parallelism together: size={x}")
    if x == 2:
        raise NotImplementedError(f"size={x} only")
    if x == 3:
        raise NotImplementedError  # internal: an abstract method
    if x == 4:
        # internal: refused earlier
        raise NotImplementedError("DeepSeek-V4.1 with " + str(x))
    raise NotImplementedError("pooling (vLLM's LLM.encode)")
'''
    assert raises_in(source) == [(4, "tensor and expert parallelism together"), (6, None), (12, "pooling")]
    assert readme_keys("# Not implemented yet\n| `a b` | c |\n|---|---|\n| `d` | e |\n## next\n| `f` | g |") == [
        "a b", "d"]
