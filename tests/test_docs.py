"""Every command and code block of README.md and docs/*.md runs (CPU).

A fenced ```bash or ```python block runs as it is written, except:

* a block right after ``<!-- gpu -->`` (needs a CUDA GPU) or ``<!-- torchrun -->`` (spawns
  ranks; the same runs are in tests/test_train_ep.py and tests/test_distributed.py) is
  skipped here, and so is one after ``<!-- not-run: REASON -->`` (installs, the suite itself);
* ``python -m sonic.train`` commands get small sizes appended (argparse keeps the last value of
  a repeated option), so the whole file runs in seconds.

Bash blocks run line by line (``\\`` continues a line) in a fresh folder with this checkout on
``PYTHONPATH``; python blocks run in this process, each in a fresh namespace and folder.
"""

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SKIPS = ("gpu", "torchrun", "not-run")
SMALL_TRAIN = ["--steps", "3", "--batch-size", "2", "--seq-len", "16", "--d-model", "32",
               "--layers", "1", "--heads", "2", "--experts", "4", "--top-k", "2",
               "--d-expert", "16", "--tile", "4", "--eval-batches", "1", "--eval-every", "2",
               "--no-progress"]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
MARKER = re.compile(r"<!--\s*([\w-]+)(?::\s*(.*?))?\s*-->\s*$")


def blocks():
    """(file, line, language, marker, code) of every fenced block."""
    found = []
    for path in DOCS:
        text = path.read_text(encoding="utf-8")
        for m in FENCE.finditer(text):
            before = text[:m.start()].rstrip("\n").rsplit("\n", 1)[-1]
            marker = MARKER.match(before.strip())
            line = text.count("\n", 0, m.start()) + 1
            found.append((path.relative_to(ROOT).as_posix(), line, m.group(1),
                          marker.group(1) if marker else None, m.group(2)))
    return found


BLOCKS = blocks()
RUNNABLE = [b for b in BLOCKS if b[2] in ("bash", "python")]


def test_every_block_is_bash_python_or_text_with_a_known_marker():
    assert len(RUNNABLE) >= 10
    for path, line, lang, marker, _ in BLOCKS:
        assert lang in ("bash", "python", "text"), f"{path}:{line}: language {lang!r}"
        assert marker in (None, *SKIPS), f"{path}:{line}: unknown marker {marker!r}"


def test_readme_install_commands():
    """The CPU install really is CPU-only (PyTorch's CPU index) and each install is one line;
    the README is at most 200 lines and links every docs page."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    installs = [code.strip() for path, _, _, marker, code in BLOCKS
                if path == "README.md" and marker == "not-run" and "pip install" in code]
    assert installs == [
        'pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu && '
        'pip install -e ".[test,hf,plot]"',
        'pip install torch --index-url https://download.pytorch.org/whl/cu130 && '
        'pip install -e ".[test,gpu,hf,plot]"']
    assert len(readme.splitlines()) <= 200
    for page in ("expert-parallelism", "fp8", "token-rounding", "huggingface", "memory",
                 "performance", "design"):
        assert f"(docs/{page}.md)" in readme, page
    ci = (ROOT / ".ci" / "run").read_text()
    assert "python -m pytest -q" in readme and "python -m pytest -q\n" in ci


def _commands(code: str) -> list[str]:
    joined = code.replace("\\\n", " ")
    return [line.split(" #")[0].strip() for line in joined.splitlines()
            if line.strip() and not line.strip().startswith("#")]


def _env():
    return {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}


@pytest.mark.parametrize("path, line, lang, marker, code", RUNNABLE,
                         ids=[f"{b[0]}:{b[1]}" for b in RUNNABLE])
def test_block_runs(tmp_path, monkeypatch, path, line, lang, marker, code):
    if marker in SKIPS:
        pytest.skip(f"marked {marker}")
    if lang == "python":
        # In this process (no second start-up of torch), in a fresh namespace and folder.
        monkeypatch.chdir(tmp_path)
        exec(compile(code, f"{path}:{line}", "exec"), {"__name__": "__main__"})
        return
    for command in _commands(code):
        argv = shlex.split(command)
        assert argv[0] == "python", f"{path}:{line}: only python commands run here: {command}"
        argv[0] = sys.executable
        if argv[1:3] == ["-m", "sonic.train"]:
            argv += SMALL_TRAIN
        proc = subprocess.run(argv, cwd=tmp_path, env=_env(), capture_output=True, text=True,
                              timeout=300)
        assert proc.returncode == 0, f"{path}:{line}: {command}\n{proc.stderr[-3000:]}"


def test_package_metadata():
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["authors"] and project["urls"] and project["keywords"]
    classifiers = project["classifiers"]
    assert len(set(classifiers)) == len(classifiers) and classifiers == sorted(classifiers)
    # PEP 639: a license expression excludes License :: classifiers (setuptools refuses both).
    assert project["license"] == "Apache-2.0"
    assert not any(c.startswith("License ::") for c in classifiers)
    versions = {c.rsplit(" ", 1)[1] for c in classifiers
                if c.startswith("Programming Language :: Python :: 3.")}
    assert min(versions, key=lambda v: tuple(map(int, v.split(".")))) == \
        project["requires-python"].removeprefix(">=")
