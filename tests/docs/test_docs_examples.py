"""Every code block of the README and of the docs site runs, page by page (tests/mdblocks.py).

A page's blocks run in order, in a directory that looks like a checkout with the example
data, so a guide's ``shardio pack imagenet/ out/`` makes the ``out/`` its next block reads.
Pages marked ``<!-- test-page: needs=slurm -->`` run in tests/slurm/test_docs_slurm.py on the
real cluster instead.
"""

from __future__ import annotations

import pathlib
import re

import mdblocks
import pytest

LOCAL = [name for name in mdblocks.pages() if "slurm" not in mdblocks.needs(name)]


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return mdblocks.make_data(tmp_path_factory.mktemp("docs-data"))


def test_every_page_parses_and_has_a_home() -> None:
    """Each page's blocks are in known languages; the site's pages and the README are all
    run, here or on the SLURM cluster."""
    names = mdblocks.pages()
    assert "README.md" in names
    assert any(name.startswith("docs/guides/") for name in names), names
    for name in names:
        mdblocks.parse(name)


@pytest.mark.parametrize("page", LOCAL)
def test_page_runs(page: str, data: pathlib.Path, tmp_path: pathlib.Path) -> None:
    mdblocks.run_page(mdblocks.parse(page), tmp_path, data)


@pytest.mark.parametrize("page", ["README.md", "CHANGELOG.md", "examples/README.md"])
def test_relative_links_resolve(page: str) -> None:
    """The site's own links are checked by ``mkdocs build --strict``; these pages are read on
    the forge and in the checkout, where a moved guide would leave a dead link."""
    path = mdblocks.REPO / page
    text = path.read_text(encoding="utf-8")
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
        if "://" in target:
            continue
        assert (path.parent / target).exists(), f"{page}: dead link to {target}"
