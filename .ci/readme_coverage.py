"""Check that moving the README into docs/ lost nothing: every sentence of an older README must appear in
today's README.md or docs/*.md.

    python .ci/readme_coverage.py [OLD_REV]   # default: the README before it was split into docs/ pages

A sentence counts as kept when it appears word for word (markdown links, list markers and line breaks
aside), or, where a long sentence was cut into a list, when every clause of it (the pieces between
commas, semicolons and colons, three words or more) appears; `REWORDED` lists the few changed on purpose.
Code blocks count line by line. Prints the
counts and every sentence or code line not found; exits 1 if any is missing. Not run by CI: it compares
against a fixed old revision, for whoever moves README text into the pages.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BEFORE_SPLIT = "3077f3d"  # main when the README was split into docs/ pages
SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z`(\"])")
CLAUSE_CUT = re.compile(r"[;:,()]\s|\s[(]|[.]$")
REWORDED = {  # sentences changed on purpose when they moved, with why
    "CI runs `.ci/run`, which is the test command above.":
        "CI now also builds the docs; docs/development.md says so",
    'Parallel layouts (`tensor_parallel_size`, `data_parallel_size`, `enable_expert_parallel`, `enable_eplb`, '
    '`eplb_config`, `context_parallel_size`) are described under "Parallelism" below; a layout not implemented '
    'yet raises `NotImplementedError` naming it.':
        '"below" became a link to the Parallelism page (docs/offline.md)',
}


def normalise(text: str) -> str:
    """Markdown links to their text, no list markers or emphasis, one space between words; a quoted section
    name reads as the link that replaced it."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = re.sub(r"^\s*(?:[-*] |\d+\. |> )", "", text, flags=re.MULTILINE)
    text = text.replace("**", "").replace('"Tensor and context parallelism"', "Tensor and context parallelism")
    return re.sub(r"\s+", " ", text).strip()


def blocks(markdown: str) -> tuple[list[str], list[str]]:
    """(prose paragraphs, code lines) of a markdown text."""
    prose, code, paragraph, in_code = [], [], [], False
    for line in markdown.splitlines():
        if line.startswith("```"):
            in_code = not in_code
            continue
        if in_code:
            if line.strip():
                code.append(line.strip())
        elif line.strip() and not line.startswith("#"):
            if line.startswith("- ") and paragraph:  # a list item starts a sentence of its own
                prose.append(" ".join(paragraph))
                paragraph = []
            paragraph.append(line)
        elif paragraph:
            prose.append(" ".join(paragraph))
            paragraph = []
    if paragraph:
        prose.append(" ".join(paragraph))
    return prose, code


def main(old_rev: str) -> int:
    old = subprocess.run(["git", "show", f"{old_rev}:README.md"], cwd=ROOT, check=True, capture_output=True,
                         text=True).stdout
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("**/*.md"))]
    new_text = "\n\n".join(page.read_text(encoding="utf-8") for page in pages)
    corpus = normalise(new_text)
    new_code = {line.strip() for line in new_text.splitlines()}
    prose, code = blocks(old)
    verbatim, clauses, missing, reworded = 0, 0, [], []
    for paragraph in prose:
        for sentence in SENTENCE_END.split(normalise(paragraph)):
            if sentence in corpus:
                verbatim += 1
                continue
            if sentence in REWORDED:
                reworded.append(f"{sentence}\n    ({REWORDED[sentence]})")
                continue
            pieces = [re.sub(r"^and |[().]+$", "", p.strip()) for p in CLAUSE_CUT.split(sentence)]
            pieces = [p for p in pieces if len(p.split()) >= 3]
            if pieces and all(p in corpus for p in pieces):
                clauses += 1
            else:
                missing.append(sentence + "".join(f"\n    not found: {p}" for p in pieces if p not in corpus))
    code_missing = [line for line in code if line not in new_code]
    print(f"{verbatim + clauses + len(reworded) + len(missing)} sentences: {verbatim} word for word, {clauses} cut "
          f"into lists (every clause kept), {len(reworded)} reworded on purpose, {len(missing)} missing; "
          f"{len(code) - len(code_missing)}/{len(code)} code lines kept")
    for sentence in reworded:
        print("REWORDED:", sentence)
    for sentence in missing:
        print("MISSING:", sentence)
    for line in code_missing:
        print("MISSING CODE:", line)
    return 1 if missing or code_missing else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else BEFORE_SPLIT))
