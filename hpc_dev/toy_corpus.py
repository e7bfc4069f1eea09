"""The toy target's corpus: natural, chat-shaped English prose that every machine has.

What: questions about the Python standard library, answered by its own documentation: the
public docstrings of its modules, classes and functions. Each becomes one user/assistant
exchange ("What does json.dumps do?" -> the docstring's leading prose paragraphs).

Why this text: it is prose (sentences, not code); it is chat-shaped like the real training
data; it is licensed (PSF) and installed with every Python, so a build needs no download; and
at ~1.2 MB it fits a 5-minute CPU training budget. The language-reference topics in
`pydoc_data` were tried too and dropped: their keyword lists and `"x" or "y"` grammar taught
the target loops no other text did. The corpus it replaces (stdlib source code)
taught a target whose greedy output was `the the the ...` and `#\n#\n...`: every acceptance
figure then measured a repeat loop, not a draft.

One exchange in twenty (by a hash of its text, so the split never depends on order) is held
out: the build reports perplexity on it, and the training never sees it.
"""

from __future__ import annotations

import ast
import hashlib
import re
import sysconfig
import zlib
from pathlib import Path

# Package trees that are tests, GUI demos or vendored code, not documentation.
# The codec modules under encodings/ repeat one generated docstring a hundred times.
SKIP_PARTS = {"test", "tests", "idlelib", "lib2to3", "site-packages", "dist-packages", "turtledemo",
              "__phello__", "tkinter", "ensurepip", "pydoc_data", "__pycache__", "encodings"}
QUESTIONS = ("What does {name} do?", "Explain {name}.", "How does {name} work?", "Tell me about {name}.",
             "What is {name} for?", "Describe {name} briefly.", "Can you explain {name} to me?")
MAX_ANSWER = 400  # characters: short answers teach the target to end its turn instead of looping
HELD_OUT_EVERY = 20

Exchange = tuple[str, str]  # (user question, assistant answer)


def _stable(text: str) -> int:
    return zlib.crc32(text.encode())


def _is_prose_line(line: str) -> bool:
    # Doctests, indented code and grammar blocks, tables and heading underlines are not prose.
    stripped = line.strip()
    return not (">>>" in line or stripped.startswith(("... ", "|", "+")) or line.startswith("   ")
                or (stripped and set(stripped) <= set("=-*~^#")))


def _prose(doc: str) -> str:
    """The text's leading prose paragraphs, up to MAX_ANSWER characters."""
    lines = [ln.rstrip() for ln in doc.splitlines() if _is_prose_line(ln)]
    text = re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip()
    out = ""
    for para in text.split("\n\n"):
        if out and len(out) + len(para) > MAX_ANSWER:
            break
        out = f"{out}\n\n{para}" if out else para
    return out[:MAX_ANSWER].strip()


def _ask(templates: tuple[str, ...], name: str) -> str:
    return templates[_stable(name) % len(templates)].format(name=name)


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def source_files(stdlib: Path) -> list[Path]:
    """The modules whose docstrings the corpus reads."""
    return [p for p in sorted(stdlib.rglob("*.py")) if not SKIP_PARTS & set(p.relative_to(stdlib).parts)]


def fingerprint() -> bytes:
    """Everything the corpus is made from (sources and these rules), without parsing it."""
    h = hashlib.sha256(Path(__file__).read_bytes())
    stdlib = stdlib_dir()
    for path in source_files(stdlib):
        h.update(str(path.relative_to(stdlib)).encode() + hashlib.sha256(path.read_bytes()).digest())
    return h.digest()


def docstring_exchanges(stdlib: Path) -> list[Exchange]:
    out = []
    for path in source_files(stdlib):
        rel = path.relative_to(stdlib)
        try:
            tree = ast.parse(path.read_text(encoding="utf-8", errors="replace"))
        except (SyntaxError, ValueError):
            continue
        module = ".".join(rel.with_suffix("").parts).removesuffix(".__init__")
        for node in [tree, *ast.walk(tree)]:
            if not isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            name = getattr(node, "name", None)
            if name is not None and name.startswith("_"):
                continue
            doc = ast.get_docstring(node)
            answer = _prose(doc) if doc else ""
            if len(answer) < 40:
                continue
            subject = f"the {module} module" if name is None else f"{module}.{name}"
            out.append((_ask(QUESTIONS, subject), answer))
    return out


def exchanges(limit: int = 0) -> list[Exchange]:
    stdlib = stdlib_dir()
    seen: set[str] = set()
    pairs = []
    for q, a in docstring_exchanges(stdlib):
        if a not in seen:  # an answer given twice (inherited, copied docstrings) teaches repetition
            seen.add(a)
            pairs.append((q, a))
    return pairs[:limit] if limit > 0 else pairs


def split(pairs: list[Exchange]) -> tuple[list[Exchange], list[Exchange]]:
    """(training, held out)."""
    held = [_stable(q + "\0" + a) % HELD_OUT_EVERY == 0 for q, a in pairs]
    return [p for p, h in zip(pairs, held) if not h], [p for p, h in zip(pairs, held) if h]
