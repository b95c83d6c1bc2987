"""torch's and transformers' private names live in one module, ``fxpar/compat.py`` (DESIGN,
"Avoid": keep any private import in one compat module), each with a note there saying why.

Best-effort AST scan of every other module under ``fxpar/`` for

- imports of private modules or names: ``import torch._x``, ``from torch._x import y``,
  ``from torch.distributed.x import _y`` (likewise for ``transformers``);
- attribute access of a private name on the modules themselves: ``torch._x``,
  ``torch.distributed._x``, ``transformers._x`` (also through ``import torch.distributed as
  dist`` style aliases);
- attribute access, on any object, of a private name that torch or transformers define
  (:data:`KNOWN_PRIVATE`, e.g. ``op._overloadpacket``, ``model._keys_to_ignore_on_save``): the
  scan cannot know an object's type, so these are listed by name.

Dunder names (``torch.__version__``) are public.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "fxpar"
LIBRARIES = ("torch", "transformers")
ALLOWED_FILES = {"compat.py"}
#: uses waiting for their module's owner to switch to the fxpar.compat function named here
#: (``(file under fxpar/, private name)``); delete an entry once its file is switched
PENDING: dict[tuple[str, str], str] = {}

#: private attributes of torch / transformers objects that fxpar has needed (or might reach
#: for); the scan flags them on any object outside compat.py
KNOWN_PRIVATE = frozenset({
    "_overloadpacket", "_schema", "_op",                     # torch OpOverload / OpOverloadPacket
    "_keys_to_ignore_on_save", "_keys_to_ignore_on_load_missing", "_no_split_modules",
    "_tied_weights_keys", "_attn_implementation", "_attn_implementation_internal",
    "_is_expert_parallel", "_apply_gate", "_get_train_sampler",  # transformers models / Trainer
    "_validate_and_set_stage_mapping",                       # torch pipelining schedules
    "_execution_engine", "_C",                               # torch autograd engine / C bindings
})


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _library(dotted: str) -> bool:
    return dotted.split(".")[0] in LIBRARIES


def _dotted(node: ast.AST) -> str | None:
    """``a.b.c`` for a chain of attribute accesses on a name, else None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return ".".join([node.id, *reversed(parts)])
    return None


def private_uses(path: Path, root: Path = PACKAGE.parent) -> list[str]:
    """``"file:line: what"`` for each private torch / transformers name used in ``path``."""
    tree = ast.parse(path.read_text())
    where = path.relative_to(root)
    aliases: dict[str, str] = {}  # local name -> torch / transformers module it stands for
    found: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if _library(a.name):  # `import torch.x` binds torch; `import torch.x as y` binds y
                    if a.asname:
                        aliases[a.asname] = a.name
                    else:
                        aliases[a.name.split(".")[0]] = a.name.split(".")[0]
                    if any(_private(p) for p in a.name.split(".")):
                        found.append(f"{where}:{node.lineno}: import {a.name}")
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level and _library(node.module):
            if any(_private(p) for p in node.module.split(".")):
                found.append(f"{where}:{node.lineno}: from {node.module} import ...")
            for a in node.names:
                if _private(a.name):
                    found.append(f"{where}:{node.lineno}: from {node.module} import {a.name}")
                else:  # `from torch import distributed as dist`: dist stands for a module
                    aliases[a.asname or a.name] = f"{node.module}.{a.name}"
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            base = _dotted(node.value)
            head = base.split(".")[0] if base else None
            if head in aliases and not any(_private(p) for p in base.split(".")[1:]):
                found.append(f"{where}:{node.lineno}: {aliases[head]}{base[len(head):]}.{node.attr}")
            elif node.attr in KNOWN_PRIVATE:
                found.append(f"{where}:{node.lineno}: .{node.attr} (a private torch / transformers name)")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                and node.func.id in ("getattr", "setattr", "hasattr", "delattr") and len(node.args) >= 2 \
                and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str):
            name = node.args[1].value
            base = _dotted(node.args[0])
            head = base.split(".")[0] if base else None
            if _private(name) and (name in KNOWN_PRIVATE or head in aliases):
                found.append(f"{where}:{node.lineno}: {node.func.id}(..., {name!r})")
    return found


def test_private_torch_and_transformers_names_only_in_compat() -> None:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel in ALLOWED_FILES:
            continue
        pending = {name for (file, name) in PENDING if file == rel}
        found += [hit for hit in private_uses(path)
                  if not any(f".{name} " in hit or f"'{name}'" in hit for name in pending)]
    assert not found, ("private torch / transformers names outside fxpar/compat.py (move each behind a "
                       "function there, with a note why):\n" + "\n".join(found))


def test_the_scan_finds_what_it_should(tmp_path: Path) -> None:
    path = tmp_path / "sample.py"
    path.write_text("import torch\nimport torch.distributed as dist\nfrom torch._ops import OpOverload\n"
                    "from torch.distributed.pipelining.schedules import _Action\nimport transformers._x\n"
                    "x = torch._C\ny = dist._functional\nz = op._overloadpacket\n"
                    "w = getattr(op, '_overloadpacket', None)\nv = torch.__version__\nu = self._mine\n")
    hits = private_uses(path, tmp_path)
    text = "\n".join(hits)
    for expected in ("from torch._ops", "import _Action", "import transformers._x", "torch._C",
                     "torch.distributed._functional", "._overloadpacket (", "getattr(..., '_overloadpacket')"):
        assert expected in text, (expected, hits)
    assert "__version__" not in text and "_mine" not in text
    assert len(hits) == 7, hits


def test_pending_entries_are_still_needed() -> None:
    """An entry of PENDING whose file no longer uses the name must go (the list only shrinks)."""
    stale = []
    for (file, name), replacement in PENDING.items():
        hits = private_uses(PACKAGE / file) if (PACKAGE / file).exists() else []
        if not any(f".{name} " in h or f"'{name}'" in h for h in hits):
            stale.append(f"{file}: {name} (now {replacement}?)")
    assert not stale, "PENDING entries no longer needed, delete them:\n" + "\n".join(stale)
