"""The documentation: the site builds with warnings as errors (a broken link, a page
missing from the nav or a bad anchor fails here), and every tutorial runs as written.

A tutorial's fenced blocks run in order in a fresh directory: a block with a
`title="FILE"` is written to FILE; a `python` block is executed (the directory on
sys.path, as a user's own files are); a `bash` block's lines are run as commands, with
`preempt` the installed CLI, from a scratch directory that sees the repository's
`experiments/`; an `output` block is what the block before it printed, every line of it
(so a tutorial's numbers are what its commands print today). The README's quick start
runs too. The generated reference pages (docs/reference/: every config key, every CLI
flag) are what `python scripts/gen_reference.py` writes from the code today."""

from __future__ import annotations

import contextlib
import functools
import io
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Literal

import pytest
from pydantic import BaseModel, Field

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
    # as from the repository's root (the tutorials name bundled configs, experiments/), but
    # writing into a scratch directory
    (workdir / "experiments").symlink_to(ROOT / "experiments")
    if (ROOT / ".peer").is_dir():  # the vLLM environment (`make peer`), as from the root
        (workdir / ".peer").symlink_to(ROOT / ".peer")
    monkeypatch.chdir(workdir)
    monkeypatch.syspath_prepend(str(workdir))
    env = {**os.environ, "PYTHONPATH": f"{workdir}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    printed = ""  # what the last python or bash block printed
    for lang, title, code in blocks(path.read_text()):
        if title is not None:
            (workdir / title).write_text(code)
        elif lang == "output":
            lines = {line.rstrip() for line in printed.splitlines()}
            shown = [line.rstrip() for line in code.splitlines() if line.strip()]
            assert shown, f"{path.name}: an empty output block"
            missing = [line for line in shown if line not in lines]
            report = [f"{path.name}: shown but not printed:", *missing, "printed:", printed]
            assert not missing, "\n".join(report)
        elif lang == "python":
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                exec(compile(code, f"{path.name}:python", "exec"), {"__name__": "__tutorial__"})
            printed = out.getvalue()
        elif lang == "bash":
            printed = ""
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
                printed += result.stdout


def build_site(site: Path) -> None:
    """`mkdocs build --strict` into `site` (the browser check builds it the same way)."""
    result = subprocess.run(
        [_installed("mkdocs"), "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]


def test_the_site_builds_with_warnings_as_errors(tmp_path):
    build_site(tmp_path / "site")
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
    run_blocks(tutorial, tmp_path, monkeypatch)


def test_an_output_block_is_what_the_block_before_printed(tmp_path, monkeypatch):
    page = tmp_path / "page.md"
    page.write_text('```python\nprint("| lstm | 0.422 |")\n```\n\n```output\n| lstm | 0.428 |\n```\n')
    (tmp_path / "a").mkdir()
    with pytest.raises(AssertionError, match=r"shown but not printed:\n\s*\| lstm \| 0\.428 \|"):
        run_blocks(page, tmp_path / "a", monkeypatch)
    page.write_text(page.read_text().replace("0.428", "0.422"))
    (tmp_path / "b").mkdir()
    run_blocks(page, tmp_path / "b", monkeypatch)


def test_the_readme_quick_start_runs(tmp_path, monkeypatch):
    text = (ROOT / "README.md").read_text()
    python = [code for lang, _, code in blocks(text) if lang == "python"]
    assert len(python) == 1 and len(python[0].strip().splitlines()) <= 12
    monkeypatch.chdir(tmp_path)
    exec(compile(python[0], "README.md:python", "exec"), {"__name__": "__readme__"})


# ------------------------------------------------------- the generated reference pages

REFERENCE = ROOT / "docs" / "reference"
GENERATE = "python scripts/gen_reference.py"


@functools.cache
def _generator():
    """scripts/gen_reference.py as a module (scripts/ is no package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gen_reference", ROOT / "scripts" / "gen_reference.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["gen_reference"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_the_reference_pages_are_what_the_code_generates(tmp_path):
    """docs/reference/{config,cli}.md are generated from the config models and the CLI's
    parser: a new key, flag, default or docstring needs the pages regenerated. Run in a
    fresh process: a plug-in registered by another test must not show up."""
    pytest.importorskip("fastapi", reason="`preempt serve`'s flags need the server's packages")
    out = tmp_path / "reference"
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_reference.py"), "--out", str(out)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    import difflib

    for page in ("config.md", "cli.md"):
        committed = REFERENCE / page
        assert committed.is_file(), f"docs/reference/{page} is missing: run `{GENERATE}`"
        fresh = (out / page).read_text()
        if committed.read_text() != fresh:
            diff = difflib.unified_diff(
                committed.read_text().splitlines(),
                fresh.splitlines(),
                f"docs/reference/{page}",
                "generated",
                lineterm="",
                n=0,
            )
            pytest.fail(
                f"docs/reference/{page} is stale (the config models or the CLI changed): run "
                f"`{GENERATE}` and commit the result\n" + "\n".join(list(diff)[:40])
            )


def test_the_staleness_check_can_fail(tmp_path, capsys):
    """The comparison above, on a page with one row too many, and `--check`'s message."""
    gen = _generator()
    pages = {"config.md": "| `a` |\n", "cli.md": "x\n"}
    for name, text in pages.items():
        (tmp_path / name).write_text(text)
    assert gen.stale_pages(tmp_path, pages) == []
    (tmp_path / "config.md").write_text("| `a` |\n| `b` |\n")
    (tmp_path / "cli.md").unlink()
    assert gen.stale_pages(tmp_path, pages) == ["config.md", "cli.md"]
    pytest.importorskip("fastapi", reason="`preempt serve`'s flags need the server's packages")
    assert gen.main(["--out", str(tmp_path / "empty"), "--check"]) == 1
    err = capsys.readouterr().err
    assert "config.md is stale: run `python scripts/gen_reference.py`" in err and "cli.md is stale" in err
    assert not (tmp_path / "empty").exists()  # --check writes nothing


class _Knobs(BaseModel):
    """A made-up section."""

    level: int = Field(3, gt=0, le=9)
    """How much."""
    mode: Literal["a", "b"] | None = None
    undocumented: dict[int, float] = Field(default_factory=lambda: {0: 1.0})


def test_a_new_knob_gets_its_row():
    """What a section's table says of each field: key, type, default, constraints, doc."""
    gen = _generator()
    page = gen.section_markdown(gen.Section("knobs", _Knobs, "`knobs`"), {}, {})
    assert page.startswith("### `knobs`\n\nA made-up section.\n")
    assert "| `knobs.level` | `int` | `3` | > 0; <= 9 | How much. |" in page
    assert "| `knobs.mode` | one of `a`, `b` or `None` | `null` |  |  |" in page
    assert "| `knobs.undocumented` | `dict[int, float]` | `{0: 1.0}` |  |  |" in page


def test_every_config_key_and_every_flag_is_in_the_reference():
    """What the generator must not skip: each key of each config model and each flag of
    each command has a row in the committed pages."""
    import argparse

    from pydantic import BaseModel

    from preempt.cli import build_parser
    from preempt.core.config import EngineConfig

    gen = _generator()
    config = (REFERENCE / "config.md").read_text()

    def keys(model: type, prefix: str = "") -> list[str]:
        found = []
        for name, info in model.model_fields.items():
            key = f"{prefix}{name}"
            found.append(key)
            for nested, suffix in gen.nested_models(info.annotation):
                if issubclass(nested, BaseModel):
                    found += keys(nested, f"{key}{suffix}.")
        return found

    engine_keys = keys(EngineConfig)
    assert (
        "preemption.mlfq.quantum_ratio" in engine_keys
        and "scheduler.sglang.max_prefill_tokens" in engine_keys
    )
    missing = [k for k in engine_keys if f"| `{k}` |" not in config]
    assert not missing, f"not in docs/reference/config.md: {missing}; run `{GENERATE}`"

    cli = (REFERENCE / "cli.md").read_text()

    def commands(parser: argparse.ArgumentParser) -> list[tuple[str, str]]:
        found = []
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for child in action.choices.values():
                    found += commands(child)
            elif action.option_strings and not isinstance(action, argparse._HelpAction):
                found.append((parser.prog, action.option_strings[0]))
        return found

    flags = commands(build_parser())
    assert ("preempt lm train", "--max-steps") in flags and ("preempt parity vllm", "--workload") in flags
    sections = _cli_sections(cli)
    missing_flags = [
        f"{prog} {flag}" for prog, flag in flags if f"| `{flag}` |" not in sections.get(prog, "")
    ]
    assert not missing_flags, f"not in docs/reference/cli.md: {missing_flags}; run `{GENERATE}`"


def _cli_sections(page: str) -> dict[str, str]:
    """Command -> the text under its heading in cli.md."""
    parts = re.split(r"^#+ `([^`]+)`\n", page, flags=re.M)
    return dict(zip(parts[1::2], parts[2::2], strict=True))


def test_field_docstrings_are_read_from_the_source():
    """The models document fields with a string right after them, which pydantic drops
    (no `use_attribute_docstrings`): the generator reads them with ast, bases included."""
    from preempt.core.config import EarlySaveConfig, PreemptionConfig

    gen = _generator()
    docs = gen.attribute_docstrings(PreemptionConfig)
    assert docs["mode"].startswith("What happens to a victim's KV")
    assert "time_slice_strategy" not in docs  # a field without one stays without
    assert "\n" in docs["mode"] and not docs["mode"].startswith(" ")  # cleaned, lines kept
    assert gen.attribute_docstrings(EarlySaveConfig)["max_inflight"] == (
        "Early saves queued or running at once (the bounded queue)."
    )
    assert gen.cell("a | b `c | d`\n  e") == "a \\| b `c | d` e"
    assert gen.cell("<stem>.json") == "&lt;stem>.json"
