"""ckpt_lab.torch_private: the list of private torch API the package uses holds on this torch, and
is complete (NOTE [ Private torch API ]).

The second test reads the package's source (ast, no import) and finds every private name it uses
by its path from ``torch``, wherever it sits: code moving between functions or files changes
nothing here, a new private name fails until it is listed.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import torch

from ckpt_lab import torch_private
from ckpt_lab.torch_private import PRIVATE_API, resolve

PACKAGE = Path(torch_private.__file__).parent
LISTED = {use.path for use in PRIVATE_API}


def _private(part: str) -> bool:
    return part.startswith("_") and not (part.startswith("__") and part.endswith("__"))


def _dotted(node: ast.expr) -> tuple[ast.expr, list[str]]:
    """``a.b.c`` -> (the node of ``a``, ["b", "c"])."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return node, parts[::-1]


def _strip_dunders(parts: list[str]) -> list[str]:
    # ``X.__torch_dispatch__.__code__`` uses X; the dunders after it are Python's.
    while parts and parts[-1].startswith("__"):
        parts = parts[:-1]
    return parts


class _Scan:
    """The private torch names in one package: torch-rooted paths, instance attributes, protocols."""

    def __init__(self, files: list[Path]) -> None:
        self.trees = {f: ast.parse(f.read_text(), str(f)) for f in files}
        self.found: dict[str, set[str]] = {}
        self.ours = self._our_names()
        for file, tree in self.trees.items():
            where = file.relative_to(PACKAGE.parent) if file.is_relative_to(PACKAGE.parent) else file
            self._scan(where.as_posix(), tree)

    def _add(self, path: str, where: str) -> None:
        self.found.setdefault(path, set()).add(where)

    def _our_names(self) -> set[str]:
        """Names the package itself defines (functions, classes, variables, attributes it assigns and
        reads, arguments): a private attribute among them is ours, not torch's."""
        ours, stored, read = set(), set(), set()
        for tree in self.trees.values():
            for n in ast.walk(tree):
                if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    ours.add(n.name)
                elif isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
                    ours.add(n.id)
                elif isinstance(n, ast.arg):
                    ours.add(n.arg)
                elif isinstance(n, ast.alias):
                    ours.add(n.asname or n.name.split(".")[0])
                elif isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value.isidentifier():
                    ours.add(n.value)  # __slots__, getattr(self, "_x"), ...
                elif isinstance(n, ast.Attribute):
                    (stored if isinstance(n.ctx, ast.Store) else read).add(n.attr)
        # An attribute set on an object and read back somewhere is ours; one only set is a protocol
        # torch reads (``_boxed_call``), and is not ours.
        self.protocols = {a for a in stored - read - ours if _private(a)}
        return ours | (stored - self.protocols)

    def _scan(self, where: str, tree: ast.Module) -> None:
        torch_alias: dict[str, str] = {}  # local name -> dotted torch path
        # names bound to other modules (sys, os: their privates are not torch's)
        other_modules: set[str] = set()
        for n in ast.walk(tree):
            if isinstance(n, ast.Import):
                for a in n.names:
                    if a.name.split(".")[0] == "torch":
                        torch_alias[a.asname or "torch"] = a.name if a.asname else "torch"
                        if any(map(_private, a.name.split("."))):
                            self._add(a.name, where)
                    else:
                        other_modules.add(a.asname or a.name.split(".")[0])
            elif isinstance(n, ast.ImportFrom) and n.module and n.level == 0:
                for a in n.names:
                    path = f"{n.module}.{a.name}"
                    if n.module.split(".")[0] == "torch":
                        torch_alias[a.asname or a.name] = path
                        if any(map(_private, path.split("."))):
                            self._add(path, where)
        parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
        covered: set[ast.AST] = set()
        strings: list[str] = []

        def torch_path(node: ast.expr) -> list[str] | None:
            root, parts = _dotted(node)
            if isinstance(root, ast.Name) and root.id in torch_alias:
                return torch_alias[root.id].split(".") + parts
            # import_module("torch._inductor.compile_fx").select_decomp_table
            if (
                isinstance(root, ast.Call)
                and getattr(root.func, "id", getattr(root.func, "attr", None)) == "import_module"
                and root.args
                and isinstance(root.args[0], ast.Constant)
                and str(root.args[0].value).startswith("torch.")
            ):
                return str(root.args[0].value).split(".") + parts
            return None

        # getattr(torch._C, "_set_grad_enabled", None), hasattr(...): the use is torch._C._set_grad_enabled
        # (3. below), not torch._C itself.
        looked_up_in = {
            id(n.args[0])
            for n in ast.walk(tree)
            if isinstance(n, ast.Call)
            and getattr(n.func, "id", None) in ("getattr", "hasattr")
            and len(n.args) >= 2
            and isinstance(n.args[1], ast.Constant)
            and isinstance(n.args[1].value, str)
        }
        for n in ast.walk(tree):
            # 1. attribute chains from torch: the longest one (torch._C._current_graph_task_id)
            if isinstance(n, ast.Attribute) and not (
                isinstance(parents.get(n), ast.Attribute) and parents[n].value is n
            ):
                parts = torch_path(n)
                if parts is not None:
                    node: ast.AST = n
                    while isinstance(node, ast.Attribute):
                        covered.add(node)
                        node = node.value
                    parts = _strip_dunders(parts)
                    if any(map(_private, parts[1:])) and id(n) not in looked_up_in:
                        self._add(".".join(parts), where)
            if isinstance(n, ast.Call):
                func_path = torch_path(n.func) if isinstance(n.func, ast.Attribute) else None
                # 2. torch._functorch.config.patch(activation_memory_budget=...): the option is a name too
                if func_path and func_path[-1] == "patch" and any(map(_private, func_path)):
                    for kw in n.keywords:
                        if kw.arg:
                            self._add(".".join([*func_path[:-1], kw.arg]), where)
                # 3. getattr(torch_module, "_name"), hasattr(torch_module, "_name")
                if (
                    getattr(n.func, "id", None) in ("getattr", "hasattr")
                    and len(n.args) >= 2
                    and isinstance(n.args[1], ast.Constant)
                    and isinstance(n.args[1].value, str)
                ):
                    base = torch_path(n.args[0]) if isinstance(n.args[0], (ast.Name, ast.Attribute)) else None
                    if base and any(map(_private, [*base[1:], n.args[1].value])):
                        self._add(".".join([*base, n.args[1].value]), where)
            if isinstance(n, ast.Constant) and isinstance(n.value, str):
                strings.append(n.value)
            # 4. a class of ours overriding a private method of a torch base class
            if isinstance(n, ast.ClassDef):
                for base in n.bases:
                    base_path = torch_path(base) if isinstance(base, (ast.Name, ast.Attribute)) else None
                    if base_path is None and isinstance(base, ast.Name) and base.id in torch_alias:
                        base_path = torch_alias[base.id].split(".")
                    if not base_path:
                        continue
                    try:
                        base_obj = resolve(".".join(base_path))
                    except (ImportError, AttributeError):
                        continue
                    for item in n.body:
                        names = (
                            [item.name]
                            if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef))
                            else [t.id for t in getattr(item, "targets", []) if isinstance(t, ast.Name)]
                        )
                        for name in names:
                            if _private(name) and hasattr(base_obj, name):
                                self._add(".".join([*base_path, name]), where)
        # 5. names in strings: a dotted private torch path ("torch._dynamo", a module to preload), or
        # a private name of a torch module this file uses (getattr(torch_checkpoint, name) with name
        # "_checkpoint_hook")
        found_here = {p for p, w in self.found.items() if where in w}
        modules = {p for p in torch_alias.values()}
        for s in strings:
            if re.fullmatch(r"torch(\.\w+)+", s) and any(map(_private, s.split("."))):
                if not any(p.startswith(s + ".") for p in found_here):
                    self._add(s, where)
            elif re.fullmatch(r"_[A-Za-z]\w*", s) and _private(s):
                for module in modules:
                    try:
                        owner = resolve(module)
                    except (ImportError, AttributeError):
                        continue
                    if type(owner).__name__ == "module" and hasattr(owner, s):
                        self._add(f"{module}.{s}", where)
        # 6. private attributes read off objects: tensor._base, op._schema (not ours, not a module's)
        for n in ast.walk(tree):
            if not isinstance(n, ast.Attribute) or n in covered or not _private(n.attr):
                continue
            root, _ = _dotted(n)
            while isinstance(root, (ast.Call, ast.Subscript, ast.Attribute)):
                root, _ = _dotted(root.func if isinstance(root, ast.Call) else root.value)
            if isinstance(root, ast.Name) and root.id in other_modules:
                continue  # sys._getframe, os._exit: Python's
            if n.attr in self.protocols:
                # One torch reads (another library's, like transformers' _gradient_checkpointing_func, is
                # not torch's API).
                try:
                    resolve(n.attr)
                except AttributeError:
                    continue
                self._add(n.attr, where)
            elif n.attr not in self.ours:
                self._add(f"*().{n.attr}", where)


@pytest.fixture(scope="module")
def scan() -> _Scan:
    files = sorted(f for f in PACKAGE.rglob("*.py") if f.name != "torch_private.py")
    return _Scan(files)


def _is_listed(path: str) -> bool:
    if path.startswith("*()."):
        # An attribute read off an object: listed as ``Class()._attr``.
        return any(p.endswith(path[1:]) for p in LISTED)
    return path in LISTED


# --------------------------------------------------------------------------------- the list holds
@pytest.mark.parametrize("use", PRIVATE_API, ids=lambda u: u.path)
def test_every_listed_private_name_exists_on_this_torch(use: torch_private.PrivateUse) -> None:
    version = torch.__version__.split("+")[0]
    try:
        resolve(use.path)
    except (ImportError, AttributeError) as error:
        if version in use.absent_on:
            pytest.skip(f"absent on torch {version}, as listed; {use.if_missing}")
        raise AssertionError(
            f"torch {torch.__version__} has no {use.path} ({error}). ckpt_lab uses it in {use.where} "
            f"for: {use.why}. Where it is missing: {use.if_missing}"
            + (f" (today: {use.today})" if use.today else "")
            + ". Add the release to its absent_on once that is what the package does."
        ) from None


def test_optional_and_missing_error_name_the_feature_and_the_torch() -> None:
    assert torch_private.optional("torch._C._current_graph_task_id") is torch._C._current_graph_task_id
    assert torch_private.optional("torch._C._no_such_private_name") is None
    assert torch_private.optional("torch._no_such_module.x") is None
    error = torch_private.missing_error("torch._C._no_such_private_name", "gradient_checkpoint_scope")
    assert isinstance(error, RuntimeError)
    assert str(error).startswith(
        f"gradient_checkpoint_scope needs torch's private torch._C._no_such_private_name, which torch "
        f"{torch.__version__} lacks. ckpt_lab was checked on torch 2.11.0, 2.13.0, 2.14.1, 2.15.0:"
    )


def test_every_entry_says_what_happens_without_it() -> None:
    for use in PRIVATE_API:
        assert use.if_missing.split(":")[0] in ("fallback", "error"), use.path
        assert use.where and use.why, use.path


def test_the_code_does_what_every_entry_promises() -> None:
    # ``today`` says where it does not (yet); tests/test_torch_private_fallbacks.py checks the promises.
    assert [use.path for use in PRIVATE_API if use.today] == []


def test_importing_ckpt_lab_names_what_it_cannot_be_imported_without(monkeypatch) -> None:
    import torch.utils._pytree as pytree

    from ckpt_lab import _torch_needed

    needed = [use.path for use in PRIVATE_API if use.if_missing.startswith(torch_private._AT_IMPORT)]
    assert tuple(needed) == _torch_needed.NEEDED_AT_IMPORT  # the same uses, in the list's order
    _torch_needed.check()  # this torch has them all
    monkeypatch.delattr(pytree, "tree_map_only")
    with pytest.raises(
        RuntimeError, match=r"^ckpt_lab needs torch's private torch\.utils\._pytree\.tree_map_only,"
    ):
        _torch_needed.check()
    monkeypatch.undo()
    assert _torch_needed._present("torch.Tensor()._version") and not _torch_needed._present(
        "torch.Tensor()._nope"
    )
    assert not _torch_needed._present("torch._no_such_module.x")


# ------------------------------------------------------------------------------- the list is whole
def test_every_private_name_the_package_uses_is_listed(scan: _Scan) -> None:
    unlisted = {path: sorted(where) for path, where in scan.found.items() if not _is_listed(path)}
    assert not unlisted, (
        "private torch API used but not listed in ckpt_lab/torch_private.py (NOTE [ Private torch "
        f"API ]): add an entry for each, with what happens on a torch without it: {unlisted}"
    )


def test_every_listed_name_is_still_used(scan: _Scan) -> None:
    used = set(scan.found)
    stale = [
        use.path
        for use in PRIVATE_API
        if use.path not in used and not ("()." in use.path and f"*().{use.path.split('().')[1]}" in used)
    ]
    assert not stale, f"listed in ckpt_lab/torch_private.py but no longer used: remove them: {stale}"


def test_the_scan_sees_each_kind_of_use(scan: _Scan) -> None:
    # Not vacuous: one of each way a private name enters the source is found.
    for path in (
        "torch._C._current_graph_task_id",  # an attribute chain from torch
        "torch._C._autograd._push_saved_tensors_default_hooks",  # from ... import
        "torch.utils.checkpoint._checkpoint_hook",  # by name, through getattr(module, name)
        "torch._functorch.config.activation_memory_budget",  # an option of config.patch
        "torch._inductor.compile_fx.select_decomp_table",  # import_module("...").attribute
        "torch._dynamo",  # a module named in a string
        "torch.utils._python_dispatch.TorchDispatchMode._should_skip_dynamo",  # an override
        "_boxed_call",  # an attribute torch reads off our function
        "*()._base",  # an attribute read off a tensor
    ):
        assert path in scan.found, path


def test_the_scan_flags_a_new_private_use(tmp_path: Path) -> None:
    source = tmp_path / "new.py"
    source.write_text(
        "import sys\nimport torch\nfrom torch._C import _get_tracing_state\n"
        "def f(t):\n    sys._getframe(0)\n    self_made = t._grad_fn_secret\n"
        "    getattr(torch._C, '_get_secret', None), hasattr(torch._C._x, 'public_name')\n"
        "    return torch._C._get_cudnn_enabled(), torch.autograd.graph.saved_tensors_hooks\n"
    )
    found = _Scan([source]).found
    assert {"torch._C._get_tracing_state", "torch._C._get_cudnn_enabled", "*()._grad_fn_secret"} <= set(found)
    # getattr / hasattr: the name looked up, not the module it is looked up in
    assert {"torch._C._get_secret", "torch._C._x.public_name"} <= set(found)
    assert "torch._C" not in found and "torch._C._x" not in found
    assert not any("getframe" in p or "saved_tensors_hooks" in p for p in found)
