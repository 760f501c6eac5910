"""Every reference in the docs and the example YAMLs resolves: Markdown links and their anchors, the sections
named after a docs file (`docs/planner.md, "Host memory"`) or within one (`"Placement" above`), the repository
paths they mention, the modules `python -m` runs, and docs/architecture.md's file map lists every module.

Files read: README.md, every *.md under docs/ (the measurement reports in docs/bench/ included), every
examples/*.yaml and docs/bench/*.sh, and for sections and paths the Python files of lightning_oomb/, examples/
and tests/. Each failure names file, line and reference.
"""

from __future__ import annotations

import glob
import re
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "lightning_oomb"

# Paths under the checked folders that the docs name but the repository need not hold, each with its reason.
# None at present: what runs write goes to runs/, models/ and OUT folders, which are not checked, and
# placeholders (below) are skipped.
ALLOWED_MISSING: dict[str, str] = {}
# A path component of capital letters (OUT, DIR, MODEL_DIR, NAME) or <...> is a placeholder the reader fills in.
PLACEHOLDER = re.compile(r"(^|/)([A-Z][A-Z_0-9]*|<[^>]*>)(/|\.|$)|\$|\{|\.\.\.")


def _files() -> list[Path]:
    files = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    files += sorted((ROOT / "examples").glob("*.yaml")) + sorted((ROOT / "docs" / "bench").glob("*.sh"))
    return files


def _sources() -> list[Path]:
    """Python files, whose docstrings and comments cite the docs too (this file's made-up references left out)."""
    files = sorted(PACKAGE.rglob("*.py")) + sorted((ROOT / "examples").glob("*.py")) + sorted((ROOT / "tests").glob("*.py"))
    return [f for f in files if f != Path(__file__).resolve()]


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


@cache
def _text(path: Path) -> str:
    """The file's text, line for line; a YAML's or script's comment markers removed, so that a reference
    continued on the next comment line reads as one sentence."""
    lines = path.read_text(encoding="utf-8").splitlines()
    if path.suffix in (".yaml", ".sh"):
        lines = [re.sub(r"^\s*# ?", "", line) for line in lines]
    return "\n".join(lines)


def _line(text: str, offset: int) -> int:
    return text.count("\n", 0, offset) + 1


def _outside_code_fences(text: str) -> str:
    """The text with fenced code blocks blanked (line breaks kept), for what only prose may hold."""
    out, fenced = [], False
    for line in text.split("\n"):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            out.append("")
        else:
            out.append("" if fenced else line)
    return "\n".join(out)


def _github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: its rendered text lower-cased, punctuation but - and _ dropped, spaces
    made hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip())  # a link renders as its text
    text = re.sub(r"[^\w\- ]", "", text.lower())
    return text.replace(" ", "-")


@cache
def _headings(path: Path) -> tuple[list[str], set[str], set[str]]:
    """(headings, their GitHub anchors, bold run-in labels such as **Placement** or **Models.**) of a
    Markdown file."""
    prose = _outside_code_fences(path.read_text(encoding="utf-8"))
    headings = [m.group(1).strip() for m in re.finditer(r"^#{1,6}\s+(.+?)\s*#*\s*$", prose, re.M)]
    anchors, seen = set(), {}
    for heading in headings:
        slug = _github_slug(heading)
        anchors.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    labels = {re.sub(r"[.:]$", "", m.group(1).strip()) for m in re.finditer(r"\*\*([^*\n]+?)\*\*", prose)}
    return headings, anchors, labels


def _names_section(path: Path, name: str) -> bool:
    """Whether ``name`` is a heading of ``path`` (the heading may go on with "?", ":" or a parenthesis, as
    "The attention kernels (`kernels/`)" does) or the bold label of a paragraph or list item."""
    headings, _, labels = _headings(path)
    return name in labels or any(h == name or (h.startswith(name) and h[len(name):].startswith(("?", ":", " (")))
                                 for h in headings)


def _resolve_doc(source: Path, ref: str) -> Path | None:
    """A Markdown file named from ``source``: relative to its folder, the repository or docs/."""
    for base in (source.parent, ROOT, ROOT / "docs"):
        if (base / ref).is_file():
            return base / ref
    return None


def _squash(name: str) -> str:
    return re.sub(r"\s+", " ", name).strip()


MD_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
QUOTED = r'"([^"\n]*(?:\n[^"\n]*)?)"'  # a quoted name, which may wrap onto the next line
AFTER_FILE = re.compile(
    r"(?<![\w/.-])((?:[\w.-]+/)*[\w.-]+\.md)(?:\]\([^)]*\))?\)?(?:,\s*|\s*\(\s*|\s+)" + QUOTED
    + r"((?:\s*(?:,\s*and|,|and)\s*" + QUOTED.replace("(", "(?:", 1) + r")*)"
)
MORE_QUOTED = re.compile(QUOTED)
IN_FILE = re.compile(QUOTED + r"\s+(?:above|below)\b|\b(?:above|below),?\s*\(" + QUOTED + r"|\b[Ss]ee\s+" + QUOTED
                     + r"|\|\s*" + QUOTED + r"\s*[;|]")
REPO_PATH = re.compile(r"(?<![\w./$~-])((?:docs|examples|tests|lightning_oomb)/[^\s`'\"()\[\],;|]*)")
PACKAGE_PATH = re.compile(
    r"(?<![\w./$~-])((?:bench|core|kernels|integrations|lightning|plan)/[\w./*-]*"
    r"(?:\.(?:py|csv|txt|json|log|md|sh|png|tgz)|/))(?![\w/])"
)
MODULE = re.compile(r"python3? -m (lightning_oomb(?:\.\w+)+)")


def _path_exists(ref: str, bases: list[Path]) -> bool:
    ref, _, test = ref.partition("::")
    ref = ref.rstrip(".:")
    for base in bases:
        matches = glob.glob(str(base / ref)) if "*" in ref else ([str(base / ref)] if (base / ref).exists() else [])
        if matches:
            if test:  # tests/test_x.py::test_name: the test exists
                return any(re.search(rf"^\s*def {re.escape(test)}\b", Path(m).read_text(), re.M) for m in matches)
            return True
    return False


def _broken_links(path: Path, text: str) -> list[str]:
    text = _outside_code_fences(text)
    broken = []
    for m in MD_LINK.finditer(text):
        target = m.group(1)
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        resolved = (path.parent / file) if file else path
        where = f"{_rel(path)}:{_line(text, m.start())}: link ({target})"
        if not resolved.exists():
            broken.append(f"{where}: no file {file}")
        elif anchor and (resolved.suffix != ".md" or anchor not in _headings(resolved)[1]):
            broken.append(f"{where}: no heading with anchor #{anchor} in {_rel(resolved)}")
    return broken


def _broken_sections(path: Path, text: str) -> list[str]:
    broken = []
    for m in AFTER_FILE.finditer(text):
        ref = m.group(1)
        names = [m.group(2)] + MORE_QUOTED.findall(m.group(3))
        target = _resolve_doc(path, ref)
        where = f"{_rel(path)}:{_line(text, m.start())}: {ref}"
        if target is None:
            broken.append(f"{where}: no such file")
            continue
        broken += [f'{where}, "{_squash(n)}": no such section in {_rel(target)}' for n in names
                   if not _names_section(target, _squash(n))]
    if path.suffix == ".md":
        for m in IN_FILE.finditer(_outside_code_fences(text)):
            name = _squash(next(g for g in m.groups() if g is not None))
            if not _names_section(path, name):
                broken.append(f'{_rel(path)}:{_line(text, m.start())}: "{name}": no such section in this file')
    return broken


def _broken_paths(path: Path, text: str) -> list[str]:
    broken = []
    for m in REPO_PATH.finditer(text):
        ref = m.group(1).rstrip(".:")
        if not ref or PLACEHOLDER.search(ref) or any(ref.startswith(a) for a in ALLOWED_MISSING):
            continue
        if not _path_exists(ref, [ROOT]):
            broken.append(f"{_rel(path)}:{_line(text, m.start())}: path {ref} does not exist")
    for m in PACKAGE_PATH.finditer(text):
        ref = m.group(1)
        if PLACEHOLDER.search(ref):
            continue
        if not _path_exists(ref, [path.parent, PACKAGE, PACKAGE / "core"]):
            broken.append(f"{_rel(path)}:{_line(text, m.start())}: path {ref} does not exist (relative to "
                          f"{_rel(path.parent) or '.'}, lightning_oomb/ or lightning_oomb/core/)")
    for m in MODULE.finditer(text):
        if PLACEHOLDER.search(m.group(1).replace(".", "/")):
            continue
        module = PACKAGE.parent / m.group(1).replace(".", "/")
        if not (module.with_suffix(".py").is_file() or (module / "__init__.py").is_file()):
            broken.append(f"{_rel(path)}:{_line(text, m.start())}: module {m.group(1)} does not exist")
    return broken


def test_markdown_links_resolve():
    broken = [b for path in _files() if path.suffix == ".md" for b in _broken_links(path, _text(path))]
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_named_sections_exist():
    broken = [b for path in _files() + _sources() for b in _broken_sections(path, _text(path))]
    assert not broken, "sections that do not exist:\n" + "\n".join(broken)


def test_mentioned_paths_exist():
    broken = [b for path in _files() + _sources() for b in _broken_paths(path, _text(path))]
    assert not broken, "paths that do not exist:\n" + "\n".join(broken)


def _file_map() -> tuple[set[str], list[str]]:
    """The files docs/architecture.md's map ("Who owns what") lists, as paths, and the entries it lists twice."""
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    section = text.split("## Who owns what", 1)[1]
    block = section.split("```", 2)[1]
    listed, twice, stack = set(), [], []
    for line in block.split("\n")[1:]:
        m = re.match(r"( *)([\w.]+(?:\.py|/))(?:\s|$)", line)
        if not m or len(m.group(1)) >= 24:  # a description's continuation line
            continue
        depth = len(m.group(1)) // 2
        stack[depth:] = [m.group(2)]
        entry = "".join(stack)
        if entry in listed:
            twice.append(entry)
        listed.add(entry)
    return listed, twice


def test_architecture_file_map_lists_every_module():
    listed, twice = _file_map()
    modules = {p.relative_to(ROOT).as_posix() for p in PACKAGE.rglob("*.py")}
    listed_modules = {e for e in listed if e.endswith(".py")}
    assert not twice, f"docs/architecture.md, \"Who owns what\": listed twice: {twice}"
    assert not modules - listed_modules, (
        f"docs/architecture.md, \"Who owns what\": modules missing from the file map: {sorted(modules - listed_modules)}")
    assert not listed_modules - modules, (
        f"docs/architecture.md, \"Who owns what\": the file map lists modules that do not exist: "
        f"{sorted(listed_modules - modules)}")


def test_the_checker_finds_what_it_should():
    """The patterns above on a made-up file: each kind of broken reference is reported, the good ones not."""
    fake = ROOT / "docs" / "fake.md"
    text = ('See [the guide](guide.md#installing) and [bad](guide.md#no-such-heading), [gone](nothere.md).\n'
            'As docs/planner.md, "Host memory" says; benchmarks.md ("No such section"); [planner.md](planner.md),\n'
            '"Several GPUs" and "Tensor parallel"; `docs/bench/no-such-file.csv`, `examples/lora.yaml`,\n'
            '`bench/h200-gpu-suite-593c57c.log`, `docs/bench/OUT`, `python -m lightning_oomb.bench.nothing`.\n')
    problems = _broken_links(fake, text) + _broken_sections(fake, text) + _broken_paths(fake, text)
    joined = "\n".join(problems)
    assert "#no-such-heading" in joined and "nothere.md" in joined
    assert '"No such section"' in joined and "Host memory" not in joined and "Tensor parallel" not in joined
    assert "docs/bench/no-such-file.csv" in joined and "lora.yaml" not in joined and "suite" not in joined
    assert "lightning_oomb.bench.nothing" in joined and "OUT" not in joined
    assert len(problems) == 5, joined

