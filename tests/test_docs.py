"""The documentation against the repository it describes.

- README.md is a front page: at most 300 lines.
- Every relative link in README.md, docs/*.md and CHANGELOG.md names a file inside the
  repository that exists, and an anchor into a Markdown file names one of its headings (as
  GitHub spells heading anchors). Nothing points outside the repository but http(s) URLs.
- Every "DESIGN §N" / "DESIGN.md §N" reference in the code names a heading ``§N`` of
  docs/design.md.
- Every command the docs show (in code blocks and in inline code) that runs a project module
  or script (``python -m akv_jax...``, ``python -m converters...``, ``python bench/X.py``,
  ``bash scripts/X.sh``, ...) names one that exists, and every ``--flag`` it shows is accepted:
  for Python, the flag appears in the ``--help`` text (one ``--help`` per module, run in a
  subprocess); for shell scripts, in the script's text unless it passes ``"$@"`` on. A command
  that cannot be checked fails with a message; nothing is skipped.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DESIGN = ROOT / "docs" / "design.md"
MAX_README_LINES = 300
PROJECT_TOPS = ("akv_jax", "converters", "bench", "tests", "notebooks", "scripts")
CODE_DIRS = ("akv_jax", "converters", "bench", "tests", "scripts", "notebooks")
CODE_SUFFIXES = {".py", ".sh", ".cc", ".h", ".ipynb", ".md", ".toml", ".txt", ".jinja"}
SHELL_LANGS = {"", "bash", "sh", "shell", "console", "text"}
HELP_TIMEOUT_S = 60


def doc_files() -> list[Path]:
    return [README, *sorted((ROOT / "docs").glob("*.md")), ROOT / "CHANGELOG.md"]


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


# --- Markdown: fences, code spans, links, headings -------------------------------------------

FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([\w+-]*)[^\n]*$")
CODE_SPAN = re.compile(r"(`+)(.+?)\1", re.S)
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^(#{1,6})\s+(.+?)\s*#*\s*$")


def split_fences(text: str) -> tuple[str, list[tuple[str, str]]]:
    """The text outside fenced code blocks (fences blanked, line count kept), and the blocks
    as (info string, body)."""
    prose: list[str] = []
    blocks: list[tuple[str, str]] = []
    lines = text.split("\n")
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            prose.append(lines[i])
            i += 1
            continue
        marker, lang = m.group(2), m.group(3).lower()
        body: list[str] = []
        prose.append("")
        i += 1
        while i < len(lines) and not lines[i].strip().startswith(marker):
            body.append(lines[i])
            prose.append("")
            i += 1
        prose.append("")
        i += 1
        indent = len(m.group(1))
        dedented = (ln[indent:] if ln[:indent].isspace() else ln for ln in body)
        blocks.append((lang, "\n".join(dedented)))
    return "\n".join(prose), blocks


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup dropped, lower case, punctuation removed,
    spaces to hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = text.replace("`", "").lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


@cache
def anchors(path: Path) -> frozenset[str]:
    prose, _ = split_fences(path.read_text(encoding="utf-8"))
    seen: dict[str, int] = {}
    out = set()
    for line in prose.split("\n"):
        m = HEADING.match(line)
        if not m:
            continue
        base = slug(m.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return frozenset(out)


def links(path: Path) -> list[tuple[int, str]]:
    """(line, target) of every inline link and image outside code."""
    prose, _ = split_fences(path.read_text(encoding="utf-8"))
    # Code spans become placeholders of the same line count: a link's text may be code.
    prose = CODE_SPAN.sub(lambda m: "code" + "\n" * m.group(0).count("\n"), prose)
    out = []
    for m in LINK.finditer(prose):
        out.append((prose.count("\n", 0, m.start()) + 1, m.group(1)))
    return out


def test_readme_is_a_front_page():
    n = len(README.read_text(encoding="utf-8").splitlines())
    assert n <= MAX_README_LINES, (
        f"README.md has {n} lines (at most {MAX_README_LINES}): move detail into docs/ "
        "and link it"
    )


def test_links_resolve_inside_the_repository():
    problems = []
    checked = 0
    for doc in doc_files():
        for line, target in links(doc):
            where = f"{rel(doc)}:{line}: {target}"
            checked += 1
            if re.match(r"https?://", target):
                continue
            if re.match(r"[a-zA-Z][\w+.-]*:", target) or target.startswith(("/", "\\")):
                problems.append(f"{where}: not a relative link or an http(s) URL")
                continue
            path_part, _, anchor = target.partition("#")
            dest = (doc.parent / path_part).resolve() if path_part else doc
            try:
                dest.relative_to(ROOT)
            except ValueError:
                problems.append(f"{where}: points outside the repository")
                continue
            if not dest.exists():
                problems.append(f"{where}: {rel(dest)} does not exist")
                continue
            if anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                problems.append(f"{where}: no heading #{anchor} in {rel(dest)}")
    assert checked > 50, f"only {checked} links found: is the link pattern broken?"
    assert not problems, "broken links:\n" + "\n".join(problems)


# --- DESIGN § references ---------------------------------------------------------------------

DESIGN_REF = re.compile(r"DESIGN(?:\.md)?(?:'s)?\s*§\s*(\d+(?:\.\d+)*)")
DESIGN_HEADING = re.compile(r"^#{1,6}\s+§(\d+(?:\.\d+)*)\s", re.M)


def design_sections() -> list[str]:
    prose, _ = split_fences(DESIGN.read_text(encoding="utf-8"))
    return DESIGN_HEADING.findall(prose)


def test_design_sections_are_unique():
    sections = design_sections()
    assert sections, "docs/design.md has no '§N' headings"
    dupes = sorted({s for s in sections if sections.count(s) > 1})
    assert not dupes, f"docs/design.md repeats section numbers: {dupes}"


def test_design_references_in_the_code_resolve():
    sections = set(design_sections())
    problems = []
    found = 0
    for top in CODE_DIRS:
        for path in sorted((ROOT / top).rglob("*")):
            if not path.is_file() or path.suffix not in CODE_SUFFIXES:
                continue
            if "fixtures" in path.relative_to(ROOT).parts:
                continue
            text = path.read_text(encoding="utf-8", errors="replace")
            for m in DESIGN_REF.finditer(text):
                found += 1
                if m.group(1) not in sections:
                    line = text.count("\n", 0, m.start()) + 1
                    problems.append(
                        f"{rel(path)}:{line}: {m.group(0)!r} has no heading '§{m.group(1)}' "
                        "in docs/design.md"
                    )
    assert found, "no DESIGN § reference found in the code: is the pattern broken?"
    assert not problems, "\n".join(problems)


# --- Commands shown in the docs --------------------------------------------------------------

INTERPRETER = re.compile(r"(?:^|/)python(?:\d+(?:\.\d+)*)?$")
COMMAND_START = re.compile(r"^(?:[A-Za-z_]\w*=\S*\s+)*(?:\S*/)?(?:python[\d.]*|bash)\s")
PROJECT_HINT = re.compile(
    r"(?:python[\d.]*\s+(?:-m\s+)?(?:" + "|".join(PROJECT_TOPS) + r")[./])|(?:bash\s+scripts/)"
)
OPERATORS = {"&&", "||", ";", "|", "&", ";;", "(", ")"}
SUBCOMMAND = re.compile(r"^[a-z][a-z0-9_-]*$")


def logical_lines(block: str) -> list[str]:
    """Lines of a shell block with backslash continuations joined."""
    out: list[str] = []
    cur = ""
    for line in block.split("\n"):
        if line.rstrip().endswith("\\"):
            cur += line.rstrip()[:-1] + " "
            continue
        out.append(cur + line)
        cur = ""
    if cur:
        out.append(cur)
    return out


def shown_commands() -> list[tuple[str, str]]:
    """(where, command line) for every shown command that may run a project module/script."""
    out = []
    for doc in doc_files():
        text = doc.read_text(encoding="utf-8")
        prose, blocks = split_fences(text)
        for lang, body in blocks:
            if lang not in SHELL_LANGS:
                continue
            for line in logical_lines(body):
                code = line.split(" #", 1)[0] if not line.lstrip().startswith("#") else ""
                if PROJECT_HINT.search(code):
                    out.append((f"{rel(doc)} (code block)", code.strip()))
        for m in CODE_SPAN.finditer(prose):
            span = " ".join(m.group(2).split())
            if COMMAND_START.match(span) and PROJECT_HINT.search(span):
                line = prose.count("\n", 0, m.start()) + 1
                out.append((f"{rel(doc)}:{line}", span))
    return out


def module_file(module: str) -> Path | None:
    base = ROOT.joinpath(*module.split("."))
    for cand in (base.with_suffix(".py"), base / "__main__.py"):
        if cand.is_file():
            return cand
    return None


def parse_command(where: str, line: str) -> tuple[list[tuple], list[str]]:
    """The checks a command line asks for: ("python", target, kind, subcommand, flags) and
    ("bash", script, flags) entries; and the problems found on the way."""
    problems: list[str] = []
    try:
        lex = shlex.shlex(line, posix=True, punctuation_chars=True)
        lex.whitespace_split = True
        lex.commenters = ""
        tokens = list(lex)
    except ValueError as e:
        return [], [f"{where}: cannot parse {line!r}: {e}"]
    simple: list[list[str]] = [[]]
    for tok in tokens:
        if tok in OPERATORS or set(tok) <= set("&|;()"):
            simple.append([])
        else:
            simple[-1].append(tok)
    checks: list[tuple] = []
    for cmd in simple:
        while cmd and re.match(r"^[A-Za-z_]\w*=", cmd[0]):
            cmd = cmd[1:]
        if not cmd:
            continue
        head = cmd[0]
        if INTERPRETER.search(head):
            rest = cmd[1:]
            if rest[:1] == ["-m"] and len(rest) > 1:
                target, args, kind = rest[1], rest[2:], "module"
                if target.split(".")[0] not in PROJECT_TOPS:
                    continue  # pytest, venv, pip, vllm...: not a project module
                if module_file(target) is None:
                    problems.append(f"{where}: no module {target} ({line!r})")
                    continue
            elif rest and rest[0].endswith(".py"):
                target, args, kind = rest[0], rest[1:], "script"
                if target.split("/")[0] not in PROJECT_TOPS:
                    continue
                if not (ROOT / target).is_file():
                    problems.append(f"{where}: no script {target} ({line!r})")
                    continue
            else:
                continue
            sub = []
            for a in args:
                if a.startswith("-"):
                    break
                sub.append(a)
            subcommand = tuple(sub[:1]) if sub and SUBCOMMAND.match(sub[0]) else ()
            flags = sorted({a.split("=", 1)[0] for a in args if re.match(r"^--[\w-]+", a)})
            checks.append(("python", target, kind, subcommand, tuple(flags), where, line))
        elif head == "bash" and len(cmd) > 1 and cmd[1].startswith("scripts/"):
            script = ROOT / cmd[1]
            if not script.is_file():
                problems.append(f"{where}: no script {cmd[1]} ({line!r})")
                continue
            flags = sorted({a.split("=", 1)[0] for a in cmd[2:] if re.match(r"^--[\w-]+", a)})
            checks.append(("bash", cmd[1], tuple(flags), where, line))
    return checks, problems


def help_text(target: str, kind: str, subcommand: tuple[str, ...]) -> tuple[int, str]:
    argv = [sys.executable, *(("-m", target) if kind == "module" else (target,))]
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    try:
        p = subprocess.run(
            [*argv, *subcommand, "--help"], cwd=ROOT, env=env, capture_output=True, text=True,
            timeout=HELP_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired:
        return -1, f"--help took over {HELP_TIMEOUT_S} s"
    return p.returncode, p.stdout + p.stderr


def test_shown_commands_exist_and_take_their_flags():
    commands = shown_commands()
    assert len(commands) > 20, f"only {len(commands)} commands found: is the pattern broken?"
    checks: list[tuple] = []
    problems: list[str] = []
    for where, line in commands:
        c, p = parse_command(where, line)
        checks += c
        problems += p
    # One --help per (module or script, subcommand), run side by side.
    wanted = sorted({(c[1], c[2], c[3]) for c in checks if c[0] == "python" and c[4]})
    with ThreadPoolExecutor(max_workers=4) as pool:
        helps = dict(zip(wanted, pool.map(lambda w: help_text(*w), wanted), strict=True))
    for c in checks:
        if c[0] == "python":
            _, target, kind, subcommand, flags, where, line = c
            if not flags:
                continue
            rc, text = helps[(target, kind, subcommand)]
            name = " ".join((target, *subcommand))
            if rc != 0 or "usage" not in text.lower():
                problems.append(
                    f"{where}: cannot check the flags of {line!r}: `{name} --help` exited "
                    f"{rc}: {text.strip()[-300:]}"
                )
                continue
            for flag in flags:
                if not re.search(r"(?<![\w-])" + re.escape(flag) + r"(?![\w-])", text):
                    problems.append(f"{where}: {name} does not accept {flag} ({line!r})")
        else:
            _, script, flags, where, line = c
            source = (ROOT / script).read_text(encoding="utf-8")
            if '"$@"' in source:
                continue  # flags go on to the command the script runs
            for flag in flags:
                if flag not in source:
                    problems.append(f"{where}: {script} does not take {flag} ({line!r})")
    assert not problems, "\n".join(problems)
