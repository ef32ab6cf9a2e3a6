"""The documentation: the site builds with warnings as errors (a broken link, a page
missing from the nav or a bad anchor fails here), and every tutorial runs as written.

A tutorial's fenced blocks run in order in a fresh directory: a block with a
`title="FILE"` is written to FILE; a `python` block is executed (the directory on
sys.path, as a user's own files are); a `bash` block's lines are run as commands, with
`preempt` the installed CLI, from a scratch directory that sees the repository's
`experiments/`. The README's quick start runs too."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TUTORIALS = sorted((ROOT / "docs" / "tutorials").glob("*.md"))
_BLOCK = re.compile(r"^```(\w+)(?: title=\"([^\"]+)\")?\n(.*?)^```$", re.S | re.M)


def blocks(text: str) -> list[tuple[str, str | None, str]]:
    """(language, title, code) of each fenced block, in order."""
    return [(lang, title or None, code) for lang, title, code in _BLOCK.findall(text)]


def _installed(name: str) -> str:
    """A command as this environment installed it (`preempt`, `ray`: beside the running
    Python, whatever PATH says), else as given (a path, or one on PATH)."""
    beside = Path(sys.executable).parent / name
    return str(beside) if "/" not in name and beside.is_file() else name


def run_blocks(path: Path, workdir: Path, monkeypatch) -> None:
    # as from the repository's root (the tutorials name experiments/configs/...), but
    # writing into a scratch directory
    (workdir / "experiments").symlink_to(ROOT / "experiments")
    if (ROOT / ".peer").is_dir():  # the vLLM environment (`make peer`), as from the root
        (workdir / ".peer").symlink_to(ROOT / ".peer")
    monkeypatch.chdir(workdir)
    monkeypatch.syspath_prepend(str(workdir))
    env = {**os.environ, "PYTHONPATH": f"{workdir}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    for lang, title, code in blocks(path.read_text()):
        if title is not None:
            (workdir / title).write_text(code)
        elif lang == "python":
            exec(compile(code, f"{path.name}:python", "exec"), {"__name__": "__tutorial__"})
        elif lang == "bash":
            for line in code.strip().splitlines():
                argv = line.split()
                assignments = [a for a in argv if re.fullmatch(r"[A-Z_]+=\S*", a)]
                argv = argv[len(assignments) :]
                command = [_installed(argv[0]), *argv[1:]]
                line_env = dict(env)
                for assignment in assignments:  # `VAR=value command`, as a shell does
                    name, _, value = assignment.partition("=")
                    line_env[name] = env["PYTHONPATH"] if name == "PYTHONPATH" else value
                result = subprocess.run(command, env=line_env, capture_output=True, text=True, timeout=600)
                assert result.returncode == 0, f"{path.name}: {line}\n{result.stderr[-2000:]}"


def test_the_site_builds_with_warnings_as_errors(tmp_path):
    mkdocs = _installed("mkdocs")
    result = subprocess.run(
        [mkdocs, "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "site" / "tutorials" / "policy" / "index.html").is_file()


def test_a_broken_link_fails_the_build(tmp_path):
    """The check above can fail: the same site with one link to a missing page."""
    docs = tmp_path / "docs"
    shutil.copytree(ROOT / "docs", docs)
    (docs / "index.md").write_text((docs / "index.md").read_text() + "\n[gone](no_such_page.md)\n")
    config = (ROOT / "mkdocs.yml").read_text().replace("docs_dir: docs", f"docs_dir: {docs}")
    (tmp_path / "mkdocs.yml").write_text(config)
    mkdocs = _installed("mkdocs")
    result = subprocess.run(
        [
            mkdocs,
            "build",
            "--strict",
            "-f",
            str(tmp_path / "mkdocs.yml"),
            "--site-dir",
            str(tmp_path / "site"),
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        timeout=300,
    )
    assert result.returncode != 0 and "no_such_page.md" in result.stderr


@pytest.mark.parametrize("tutorial", TUTORIALS, ids=[t.stem for t in TUTORIALS])
def test_a_tutorial_runs_as_written(tutorial, tmp_path, monkeypatch):
    text = tutorial.read_text()
    assert blocks(text), f"{tutorial.name} has no code"
    if ".peer/bin/python" in text and not (ROOT / ".peer" / "bin" / "python").is_file():
        pytest.skip("needs the vLLM peer environment: make peer")
    try:
        run_blocks(tutorial, tmp_path, monkeypatch)
    finally:
        if "ray start" in text:  # a tutorial's cluster never outlives it, failed or not
            subprocess.run([_installed("ray"), "stop", "--force"], capture_output=True, timeout=120)


def test_the_readme_quick_start_runs(tmp_path, monkeypatch):
    text = (ROOT / "README.md").read_text()
    python = [code for lang, _, code in blocks(text) if lang == "python"]
    assert len(python) == 1 and len(python[0].strip().splitlines()) <= 12
    monkeypatch.chdir(tmp_path)
    exec(compile(python[0], "README.md:python", "exec"), {"__name__": "__readme__"})
