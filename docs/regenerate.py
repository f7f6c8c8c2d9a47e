"""Regenerate the command outputs the docs print, so that a figure the docs repeat is the command's own.

    .venv/bin/python docs/regenerate.py            # rewrite every marked block from its commands' output
    .venv/bin/python docs/regenerate.py --check    # exit 1 and print a diff where a doc's copy differs

A marked block in a Markdown file:

    <!-- regenerate: the commands below are run and their output pasted by docs/regenerate.py -->
    ```console
    $ .venv/bin/python -m job plan --config configs/qwen3.6-27b.yaml --prompts 914000 ... \\
        --usd-per-gpu-hour 3.81
    (the output, as printed)
    ```

Every `$ ` line (with its `\\`-continued lines) is a command, run from the repository root with this interpreter in
place of `.venv/bin/python`; the lines after it up to the next `$ ` line or the fence are its output, blank lines
between commands kept as one. Only commands that need nothing but the checkout are marked (plans, `make -n`).
tests/test_docs_outputs.py runs `--check`'s comparison on every file in DOCS.
"""

from __future__ import annotations

import difflib
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DOCS = ("docs/OPERATIONS.md", "README.md")
MARKER = "<!-- regenerate: the commands below are run and their output pasted by docs/regenerate.py -->"
_BLOCK = re.compile(re.escape(MARKER) + r"\n```console\n(?P<body>.*?)```\n", re.S)


def commands(body: str) -> list[list[str]]:
    """The commands of a block's body, each as its printed lines (a `$ ` line and its continuations)."""
    out, lines = [], body.splitlines()
    i = 0
    while i < len(lines):
        if lines[i].startswith("$ "):
            cmd = [lines[i]]
            while cmd[-1].endswith("\\") and i + 1 < len(lines):
                i += 1
                cmd.append(lines[i])
            out.append(cmd)
        i += 1
    return out


def run(printed: list[str]) -> str:
    """A printed command's stdout, run from the repository root (`.venv/bin/python` → this interpreter)."""
    text = " ".join(line.rstrip("\\").strip() for line in printed)[2:]
    argv = shlex.split(text)
    if argv[0] == ".venv/bin/python":
        argv[0] = sys.executable
    env = {**os.environ, "COLUMNS": "120"}
    proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"`{text}` failed ({proc.returncode}): {proc.stderr.strip()[-2000:]}")
    return proc.stdout.rstrip("\n")


def render(doc: str) -> str:
    """`doc` with every marked block's outputs replaced by what its commands print now."""

    def block(m: re.Match) -> str:
        parts = ["\n".join(cmd) + "\n" + run(cmd) for cmd in commands(m["body"])]
        return f"{MARKER}\n```console\n" + "\n\n".join(parts) + "\n```\n"

    return _BLOCK.sub(block, doc)


def diff(path: str) -> str:
    """A unified diff from the doc's copy to the commands' output ('' when they agree)."""
    now = (REPO / path).read_text()
    return "".join(difflib.unified_diff(now.splitlines(True), render(now).splitlines(True), f"{path} (docs)",
                                        f"{path} (the commands)"))


def main(argv: list[str]) -> int:
    check = "--check" in argv
    stale = False
    for path in DOCS:
        text = (REPO / path).read_text()
        if not _BLOCK.search(text):
            continue
        if check:
            d = diff(path)
            if d:
                print(d, end="")
                stale = True
        else:
            (REPO / path).write_text(render(text))
            print(f"regenerated {path}")
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
