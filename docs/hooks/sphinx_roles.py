"""A griffe extension for the API reference: bigbatch's docstrings cross-reference in Sphinx's
roles (``:class:`InfoNCE```, ``:meth:`~bigbatch.GradCache.step```, ``:mod:`.swift```) and
mark literal blocks with ``::``, which Markdown would print as they are written. Once the
package is loaded, every role is resolved in the scope of the docstring that holds it (the
object's members, its module's imports, then its parents) and becomes a link to the rendered
object, or plain code where that object is not rendered (a private helper). A role that names
nothing in bigbatch is a warning, which
``mkdocs build --strict`` turns into a failed build: a docstring's reference must resolve.
"""

from __future__ import annotations

import builtins
import html
import logging
import re
from typing import Any

import griffe

log = logging.getLogger("mkdocs.plugins.bigbatch.sphinx_roles")

ROLE = re.compile(r":(?:py:)?(class|meth|func|mod|attr|data|exc|obj):`(~?)([^`<>]+)`")
# reStructuredText's "text::" before an indented literal block reads "text:" (as Sphinx
# prints it); a label alone on its line ("Example::") is set in italics, so that griffe does
# not take it for a Google-style section
LABEL = re.compile(r"^(\s*)(\w[\w ]*)::[ \t]*$", re.M)
LITERAL = re.compile(r"(\S)::[ \t]*$", re.M)


def literal_markers(text: str) -> str:
    """rST literal-block markers (``::``) as they read once rendered."""
    return LITERAL.sub(r"\1:", LABEL.sub(r"\1*\2*:", text))


def _lookup(root: griffe.Object, path: str) -> griffe.Object | griffe.Alias | None:
    """The object at a dotted ``path`` under the package ``root`` (its own name first)."""
    parts = path.split(".")
    if parts[0] != root.name:
        return None
    obj: Any = root
    for part in parts[1:]:
        try:
            obj = obj.all_members[part] if obj.is_class else obj.members[part]
        except (KeyError, griffe.AliasResolutionError, griffe.CyclicAliasError):
            return None
    return obj


def _find(obj: griffe.Object, target: str, root: griffe.Object) -> str | None:
    """The path ``target`` names from ``obj``'s docstring (maybe an alias's), or None."""
    if target.startswith("."):  # a module relative to the docstring's package
        package = obj if obj.is_module and obj.filepath.name == "__init__.py" else obj.module.parent
        level = len(target) - len(target.lstrip("."))
        for _ in range(level - 1):
            package = package.parent
        path = f"{package.path}.{target.lstrip('.')}"
        return path if _lookup(root, path) is not None else None
    if _lookup(root, target) is not None:
        return target
    head, _, rest = target.partition(".")
    scope: Any = obj
    while scope is not None:
        members = scope.all_members if scope.is_class else scope.members
        if head in members:
            base = f"{scope.path}.{head}"
        elif scope.is_module and head in scope.imports:
            base = scope.imports[head]
        else:
            scope = scope.parent
            continue
        path = f"{base}.{rest}" if rest else base
        return path if _lookup(root, path) is not None else None
    # not in scope (a name the module does not import): the one object of the package whose
    # path ends with it, if exactly one does
    found = [p for p in _all_paths(root) if p.endswith("." + head)]
    if len(found) != 1:
        return None
    path = f"{found[0]}.{rest}" if rest else found[0]
    return path if _lookup(root, path) is not None else None


def _resolve(obj: griffe.Object, target: str, root: griffe.Object) -> str | None:
    """The canonical path (where the object is defined) ``target`` names from ``obj``'s
    docstring, or None when it names nothing in the package."""
    path = _find(obj, target, root)
    found = _lookup(root, path) if path else None
    if getattr(found, "is_alias", False):
        try:
            return found.final_target.path
        except (griffe.AliasResolutionError, griffe.CyclicAliasError):
            return path
    return path


_PATHS: dict[str, list[str]] = {}


def _all_paths(root: griffe.Object) -> list[str]:
    """Every non-alias object's path under ``root``, computed once per package."""
    if root.path not in _PATHS:
        paths: list[str] = []

        def walk(obj: Any) -> None:
            paths.append(obj.path)
            for member in obj.members.values():
                if not member.is_alias:
                    walk(member)

        walk(root)
        _PATHS[root.path] = paths
    return _PATHS[root.path]


class SphinxRoles(griffe.Extension):
    """Rewrite Sphinx roles in every docstring of the package into Markdown links."""

    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        _PATHS.pop(pkg.path, None)
        self._walk(pkg, pkg, set())

    def _walk(self, obj: Any, root: griffe.Module, seen: set[str]) -> None:
        if obj.is_alias or obj.path in seen:
            return
        seen.add(obj.path)
        if obj.docstring is not None:
            text = ROLE.sub(lambda m: self._link(obj, m, root), obj.docstring.value)
            obj.docstring.value = literal_markers(text)
            _check_parameters(obj)
        for member in obj.members.values():
            if not member.is_alias:
                self._walk(member, root, seen)

    @staticmethod
    def _link(obj: griffe.Object, m: re.Match, root: griffe.Module) -> str:
        _, short, target = m.groups()
        shown = target.lstrip(".").split(".")[-1] if short else target
        path = _resolve(obj, target, root)
        if path is None:
            if target.split(".")[0] in ("torch", "transformers", "peft", "argparse", "pathlib") \
                    or hasattr(builtins, target):
                return f"`{shown}`"  # another library's object: shown as code
            log.warning("%s: the docstring's reference %s names nothing in bigbatch",
                        obj.path, m.group(0))
            return f"`{shown}`"
        return (f'<autoref identifier="{html.escape(path)}" optional>'
                f"<code>{html.escape(shown)}</code></autoref>")


def _check_parameters(obj: Any) -> None:
    """Warn about a documented parameter the signature does not have. bigbatch documents
    related parameters together (``lora_r, lora_alpha: ...``), which griffe's own check
    (turned off in mkdocs.yml) would count as one unknown name."""
    func = obj.members.get("__init__") if obj.is_class else obj if obj.is_function else None
    if func is None or func.is_alias:
        return
    known = {p.name for p in func.parameters}
    if any(p.kind and p.kind.name == "var_keyword" for p in func.parameters):
        return  # **kwargs: any name may be documented
    for section in obj.docstring.parse("google", warn_unknown_params=False, warn_missing_types=False):
        if section.kind.value != "parameters":
            continue
        for param in section.value:
            for name in (n.strip().lstrip("*") for n in param.name.split(",")):
                if name and name not in known:
                    log.warning("%s: the docstring documents a parameter %r that the signature "
                                "does not have", obj.path, name)
