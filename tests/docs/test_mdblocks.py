"""The docs runner itself: what it reads from a page and what makes a block fail."""

from __future__ import annotations

import pathlib

import mdblocks
import pytest

PAGE = """\
# A page

<!-- test: exit=3 -->

```sh
exit 3
```

<!-- test-setup:
echo made > made.txt
-->
```python
print(open("made.txt").read().strip())
```

```console
$ echo one; \\
  echo two
one
...
two
```

```text
shown, not run
```
"""


def test_parse_reads_blocks_options_and_setup() -> None:
    page = mdblocks.parse("page.md", PAGE)
    assert [b.lang for b in page.blocks] == ["sh", "python", "console", "text"]
    assert page.blocks[0].options == {"exit": "3"}
    assert page.blocks[1].setup == "echo made > made.txt\n"
    assert page.blocks[1].options == {}
    assert page.needs == set()


def test_run_page_runs_each_block_in_one_directory(tmp_path: pathlib.Path) -> None:
    data = tmp_path / "data"
    (data / "train" / "a").mkdir(parents=True)
    home = mdblocks.run_page(mdblocks.parse("page.md", PAGE), tmp_path, data)
    assert (home / "made.txt").read_text() == "made\n"
    assert (home / "imagenet" / "train" / "a").is_dir()


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("```\nls\n```\n", "no language"),
        ("```rust\nfn main() {}\n```\n", "a block in rust"),
        ("<!-- test: retries=2 -->\n```sh\nls\n```\n", "unknown test option"),
        ("<!-- test: exit=1 -->\nprose\n```sh\nls\n```\n", "not followed by a code block"),
        ("```sh\nls\n", "never ends"),
        ("<!-- test-page: needs=gpu -->\n", "needs=slurm"),
    ],
)
def test_a_page_the_runner_cannot_read_is_an_error(text: str, why: str) -> None:
    with pytest.raises(mdblocks.PageError, match=why):
        mdblocks.parse("bad.md", text)


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("```sh\nfalse\n```\n", "exited 1, not 0"),
        ("```python\nimport warnings\nwarnings.warn('old', DeprecationWarning)\n```\n", "old"),
        ("```console\n$ echo hi\nbye\n```\n", "lacks 'bye'"),
        ('```json\n{"a": 1,}\n```\n', "not JSON"),
    ],
)
def test_a_block_that_fails_fails_its_page(text: str, why: str, tmp_path: pathlib.Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    with pytest.raises(AssertionError, match=why):
        mdblocks.run_page(mdblocks.parse("bad.md", text), tmp_path, data)


def test_a_block_run_by_ci_must_be_in_ci(tmp_path: pathlib.Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    good = "<!-- test: by=ci -->\n```sh\nmake lint   # ruff\nmake test\n```\n"
    mdblocks.run_page(mdblocks.parse("ok.md", good), tmp_path / "a", data)
    bad = "<!-- test: by=ci -->\n```sh\nmake everything\n```\n"
    with pytest.raises(AssertionError, match="does not run 'make everything'"):
        mdblocks.run_page(mdblocks.parse("bad.md", bad), tmp_path / "b", data)
    with pytest.raises(mdblocks.PageError, match="the runners are"):
        mdblocks.run_page(
            mdblocks.parse("bad.md", "<!-- test: by=me -->\n```sh\nls\n```\n"), tmp_path / "c", data
        )
