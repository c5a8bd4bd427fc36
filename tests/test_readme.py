"""The README contract: .ci/run runs exactly README's test command; the demo runs."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _commands():
    return re.findall(r"```sh\n(.*?)\n```", (ROOT / "README.md").read_text(), re.S)


def test_ci_runs_readme_test_command():
    demo, tests, full = _commands()[:3]
    assert "pytest" in tests and "examples/demo.py" in demo
    # CI runs README's test command with the full-matrix flag README documents
    assert full.strip() == ".venv/bin/python -m pytest --full"
    assert tests.strip() + " --full" in (ROOT / ".ci" / "run").read_text()


def test_demo_runs():
    env = {**os.environ, "FSHARD_DEVICES": "1"}
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "demo.py")], cwd=ROOT,
                         capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    for marker in ("make_ir", "jit", "vmap(grad)", "shard", "result.shape: (32, 10)"):
        assert marker in out.stdout
