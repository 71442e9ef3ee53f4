"""The guides stay true: every ```python block of a docs page runs, in order, in one namespace per page.

A block opts out only when it cannot run on CPU with 8 virtual devices (e.g. several processes): its first
line is ``# docs: not run (<why>)``. Blocks assert what they show (``assert``/``np.testing``), so a page
that runs is a page whose claims hold on this machine.
"""

import pathlib
import re

import pytest

DOCS = pathlib.Path(__file__).resolve().parents[1] / "docs"
OPT_OUT = "# docs: not run"
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)

# Names of this round's API (issue 16/17) that a page may use before they land on this branch: a page that
# needs one that the package does not export yet is skipped from that block on, naming it. Any other missing
# name is an error. Empty this set once the API has landed.
PENDING = {"value_and_grad", "experimental", "noise_scale_monitor", "elementwise"}


def python_blocks(text: str) -> list[str]:
    """The page's ```python blocks, in order (other fences, e.g. ```text or ```bash, are not code to run)."""
    return BLOCK.findall(text)


def _pages() -> list[pathlib.Path]:
    return sorted(p for p in DOCS.glob("*.md") if python_blocks(p.read_text()))


def _pending_name(code: str) -> str | None:
    import optax_adascale

    for name in re.findall(r"optax_adascale\.(\w+)", code):
        if name in PENDING and not hasattr(optax_adascale, name):
            return name
    return None


def test_extraction_finds_blocks_and_the_opt_out():
    text = "x\n```python\na = 1\n```\n```bash\nls\n```\n```python\n# docs: not run (why)\nb\n```\n"
    assert python_blocks(text) == ["a = 1\n", "# docs: not run (why)\nb\n"]


def test_every_opt_out_says_why():
    for page in _pages():
        for code in python_blocks(page.read_text()):
            if code.startswith(OPT_OUT):
                assert re.match(r"# docs: not run \(.+\)", code), f"{page.name}: an opt-out must say why"


@pytest.mark.parametrize("page", _pages(), ids=lambda p: p.name)
def test_page_code_runs(page):
    namespace: dict = {"__name__": f"docs_{page.stem}"}
    ran, pending = 0, []
    for i, code in enumerate(python_blocks(page.read_text())):
        if code.startswith(OPT_OUT):
            continue
        name = _pending_name(code)
        if name:
            pending.append(f"block {i + 1} needs optax_adascale.{name}")
            continue
        try:
            exec(compile(code, f"{page}:block{i + 1}", "exec"), namespace)  # noqa: S102 - our own documentation
        except NameError:
            if not pending:
                raise
            pending.append(f"block {i + 1} uses a name from a skipped block")
            continue
        ran += 1
    if pending:
        pytest.skip(f"{page.name}: ran {ran} blocks; not on this branch yet (issue 16/17): {'; '.join(pending)}")
    assert ran > 0
