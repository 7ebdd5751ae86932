"""Every ```python block of README.md and docs/*.md runs on the simulated device, so that none goes stale.

Each block runs alone in a fresh interpreter (CUDA hidden, a timeout, a temporary working directory) and must exit
0. A block that cannot run there says so in its first line, with the reason:
- `# needs: gpu (why)`: a whole program that needs a GPU; skipped here, run (CUDA visible) where a GPU is usable;
- `# needs: vllm (why)`: needs vLLM serving a model; never run;
- `# needs: model (why)`: a fragment around the user's own model or workers (placeholders); never run.
Shell blocks are not run.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
FILES = [README, *sorted(DOCS.glob("*.md"))] if DOCS.is_dir() else [README]

pytestmark = pytest.mark.skipif(not README.is_file() or not DOCS.is_dir(),
                                reason="needs the source tree (README.md, docs/)")

#: The marker of a block that cannot run on the simulated device: its first line, the need and why.
MARKER = re.compile(r"#\s*needs:\s*(?P<need>\S+?)\s*\((?P<why>[^)]*)\)\s*$")
NEEDS = ("gpu", "vllm", "model")
TIMEOUT_S = 120


def python_blocks(path: Path) -> list[tuple[int, str]]:
    """(line of the opening fence, code) of every ```python block of `path`."""
    blocks = []
    lines = path.read_text().splitlines()
    i = 0
    while i < len(lines):
        fence = lines[i].strip()
        if fence.startswith("```"):
            lang = fence[3:].strip()
            j = i + 1
            while j < len(lines) and not lines[j].strip().startswith("```"):
                j += 1
            if lang == "python":
                blocks.append((i + 1, "\n".join(lines[i + 1 : j]) + "\n"))
            i = j
        i += 1
    return blocks


def _all_blocks() -> list[tuple[str, str]]:
    if not README.is_file():
        return []
    out = []
    for path in FILES:
        for line, code in python_blocks(path):
            out.append((f"{path.relative_to(ROOT)}:{line}", code))
    return out


BLOCKS = _all_blocks()


def need_of(code: str) -> str | None:
    """The block's need from its first line's marker, None when it has none. A line that starts like a marker but
    names no known need or gives no reason is an error, not a silent skip."""
    first = code.lstrip("\n").splitlines()[0] if code.strip() else ""
    if not re.match(r"#\s*needs\s*:", first):
        return None
    m = MARKER.fullmatch(first.strip())
    if not m or m["need"] not in NEEDS or not m["why"].strip():
        raise AssertionError(f"bad marker {first!r}: write `# needs: gpu (why)` or `# needs: vllm (why)`")
    return m["need"]


def gpu_usable() -> bool:
    import cumem_rs

    if not cumem_rs.cuda_available():
        return False
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


@pytest.mark.parametrize("where, code", BLOCKS, ids=[w for w, _ in BLOCKS])
def test_block_runs_on_the_simulated_device(where, code, tmp_path):
    need = need_of(code)
    if need == "gpu" and not gpu_usable():
        pytest.skip(f"{where}: needs a GPU")
    if need not in (None, "gpu"):
        pytest.skip(f"{where}: needs {need}")
    env = dict(os.environ) if need == "gpu" else dict(os.environ, CUDA_VISIBLE_DEVICES="")
    p = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=TIMEOUT_S)
    assert p.returncode == 0, f"{where} failed:\n{code}\n--- stdout\n{p.stdout}\n--- stderr\n{p.stderr}"


def test_the_block_finder_and_the_markers(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("text\n```bash\nls\n```\n```python\nprint(1)\n```\n```\nplain\n```\n"
                    "```python\n# needs: gpu (torch tensors on CUDA)\nimport torch\n```\n")
    blocks = python_blocks(page)
    assert [line for line, _ in blocks] == [5, 11]
    assert need_of(blocks[0][1]) is None and need_of(blocks[1][1]) == "gpu"
    assert need_of("# needs: vllm (a served model)\n") == "vllm"
    assert need_of("\n# needs: model (your loader)\nmodel = load()\n") == "model"
    for bad in ("# needs: gpu\n", "# needs: tpu (why)\n", "# needs: gpu ()\n"):
        with pytest.raises(AssertionError, match="bad marker"):
            need_of(bad)


def test_every_page_has_blocks_that_run_and_every_marker_is_valid():
    runnable = [w for w, code in BLOCKS if need_of(code) is None]  # need_of raises on a malformed marker
    assert any(w.startswith("README.md:") for w in runnable), "the README has no block the tests run"
    assert len(runnable) >= 5, runnable


def test_the_readme_reads_in_minutes_and_opens_with_the_two_commands():
    text = README.read_text()
    assert len(text.splitlines()) <= 250
    first = text.split("```bash\n", 1)[1].split("```", 1)[0].splitlines()
    assert [ln.split("#")[0].strip() for ln in first] == ["scripts/dev.sh demo", "scripts/dev.sh test"]
    for path in FILES[1:]:
        assert f"(docs/{path.name})" in text, f"the README does not link {path.name}"


def test_configuration_lists_every_environment_variable_the_code_reads():
    """Each `CUMEM_RS_*` name the Rust or Python source spells as a string literal (what it reads from the
    environment) is a row of the table in docs/configuration.md, and the table names nothing the code never reads."""
    sources = [*(ROOT / "rust" / "src").rglob("*.rs"), *(ROOT / "python" / "cumem_rs").rglob("*.py")]
    read = {m for f in sources for m in re.findall(r'"(CUMEM_RS_[A-Z0-9_]+)"', f.read_text())}
    assert len(read) >= 10, read
    table = set(re.findall(r"^\| `(CUMEM_RS_[A-Z0-9_]+)` \|", (DOCS / "configuration.md").read_text(), re.M))
    assert sorted(read - table) == [], "read by the code, missing from docs/configuration.md"
    assert sorted(table - read) == [], "in docs/configuration.md, read nowhere"
