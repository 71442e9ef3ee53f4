"""API pages generated from ``__all__``, and a check that every public name has an entry.

A page lists the names it documents in an ``api-entries`` directive (``#`` starts a comment)::

    ```{api-entries} optax_adascale
    adascale
    adascale_sgd
    ```

Each listed name that the module exports (``__all__``) becomes an ``autofunction``, ``autoclass`` or,
for a public submodule, an ``automodule`` with its members; a listed name the module does not export is
left out with an info line (so a page may name an API one release ahead, or one being retired).

The check (modelled on optax's ``docs/ext/coverage_check.py``) runs when the environment is complete and
fails the build when a name in ``optax_adascale.__all__``, or in the ``__all__`` of one of its public
submodules, has no entry in the built documentation. A new public name therefore cannot ship without
documentation: add it to the right ``api-entries`` list.
"""

import importlib
import inspect
import types
from typing import Any

from docutils import nodes
from docutils.statemachine import StringList
from sphinx.application import Sphinx
from sphinx.errors import SphinxError
from sphinx.util import logging
from sphinx.util.docutils import SphinxDirective

logger = logging.getLogger(__name__)

PACKAGE = "optax_adascale"


def _exported(module: types.ModuleType) -> tuple[str, ...]:
    return tuple(getattr(module, "__all__", ()))


def public_modules() -> dict[str, types.ModuleType]:
    """The package and every submodule its ``__all__`` exports, by dotted name."""
    package = importlib.import_module(PACKAGE)
    found = {PACKAGE: package}
    for name in _exported(package):
        value = getattr(package, name)
        if isinstance(value, types.ModuleType):
            found[f"{PACKAGE}.{name}"] = value  # its public path (goodput lives in the tools wing)
    if hasattr(package, "flax") or importlib.util.find_spec("flax") is not None:
        # optax_adascale.flax imports flax, so the package does not import it: public all the same.
        found[f"{PACKAGE}.flax"] = importlib.import_module(f"{PACKAGE}.flax")
    return found


def public_names() -> set[str]:
    """Every name a user may import: ``module.name`` for each public module's ``__all__``."""
    names = set()
    for module_name, module in public_modules().items():
        for name in _exported(module):
            names.add(f"{module_name}.{name}")
    return names


def _directive_for(qualified: str, value: Any) -> list[str]:
    """reStructuredText: autodoc's output is reST, so the pages wrap it in MyST's ``eval-rst``."""
    if isinstance(value, types.ModuleType):
        # no :undoc-members: a dataclass's fields are documented once, by its docstring's Attributes
        return [f".. automodule:: {qualified}", "   :members:", ""]
    if inspect.isclass(value):
        fields = getattr(value, "_fields", ())  # a NamedTuple's fields: documented by its Attributes, not "Alias for"
        exclude = [f"   :exclude-members: {', '.join(fields)}"] if fields else []
        return [f".. autoclass:: {qualified}", "   :members:", *exclude, ""]
    if callable(value):
        return [f".. autofunction:: {qualified}", ""]
    return [f".. autodata:: {qualified}", "   :no-value:", ""]


class ApiEntries(SphinxDirective):
    """``api-entries`` MODULE, one exported name per content line."""

    required_arguments = 1
    has_content = True

    def run(self) -> list[nodes.Node]:
        module_name = self.arguments[0]
        module = importlib.import_module(module_name)
        exported = set(_exported(module))
        lines: list[str] = []
        for name in (line.split("#")[0].strip() for line in self.content):
            if not name:
                continue
            if name not in exported:
                logger.info(f"api-entries: {module_name}.{name} is not in __all__ (yet, or any more): left out")
                continue
            lines += _directive_for(f"{module_name}.{name}", getattr(module, name))
        if lines and self.env.doc2path(self.env.docname).suffix == ".md":
            lines = ["```{eval-rst}", *lines, "```"]
        container = nodes.container()
        self.state.nested_parse(StringList(lines, source=self.get_source_info()[0]), self.content_offset, container)
        return container.children


def check_coverage(app: Sphinx, env: Any) -> None:
    documented = set(env.domaindata["py"]["objects"]) | set(env.domaindata["py"].get("modules", {}))
    missing = sorted(public_names() - documented)
    if missing:
        raise SphinxError(
            "every public name must have an entry in the API reference (docs/api*.md, an `api-entries` "
            f"list); undocumented: {missing}"
        )


def setup(app: Sphinx) -> dict[str, Any]:
    app.add_directive("api-entries", ApiEntries)
    app.connect("env-check-consistency", check_coverage)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
