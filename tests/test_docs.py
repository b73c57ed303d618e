"""The README and the documentation site agree with the code (`mkdocs build --strict` checks docs/ itself)."""

import pathlib
import re

import keras_transformer

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
API_PAGE = ROOT / "docs" / "api" / "keras_transformer.md"


def quick_start(text):
    """The first bash block after the `## Quick start` heading."""
    section = text.split("\n## Quick start\n", 1)[1]
    return re.search(r"```bash\n(.*?)```", section, re.S).group(1)


def test_every_public_name_is_on_the_api_page():
    # mkdocs checks the page's links and `:::` names; this checks that none of kt.* is missing.
    page = API_PAGE.read_text()
    missing = [name for name in [*keras_transformer._EXPORTS, "layers"] if f"`kt.{name}`" not in page]
    assert not missing, f"docs/api/keras_transformer.md does not list {missing}"


def test_the_docs_quick_start_is_the_readme_s():
    assert quick_start((ROOT / "docs" / "index.md").read_text()) == quick_start(README.read_text())
    assert "bash tests/run.sh" in quick_start(README.read_text())


def test_the_readme_links_to_files_that_exist():
    # Relative links only (mkdocs does not read the README); anchors are left to the pages.
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", README.read_text())
    relative = [link for link in links if not re.match(r"[a-z]+://", link)]
    assert relative, "no relative links found in README.md"
    missing = [link for link in relative if not (ROOT / link).exists()]
    assert not missing, f"README.md links to missing files: {missing}"
