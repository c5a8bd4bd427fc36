"""The JAX baseline environment: a separate virtualenv at ``<repo>/.jaxenv``.

JAX needs NumPy 2 while MindSpore 2.10 needs NumPy < 2, so the two cannot share
one environment. The benchmarks run JAX baselines as a subprocess of this
environment (``benchmarks/jax_baselines.py``), which prints its results as JSON.

    python benchmarks/jax_env.py          # create the environment if missing
    python benchmarks/jax_env.py --check  # print the JAX version, or exit 1

Example (from Python)::

    >>> from benchmarks import jax_env
    >>> python = jax_env.ensure()          # doctest: +SKIP
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV_DIR = os.path.join(REPO, ".jaxenv")
PYTHON = os.path.join(ENV_DIR, "bin", "python")
BASELINES = os.path.join(REPO, "benchmarks", "jax_baselines.py")


def available() -> bool:
    """Whether the JAX environment exists and imports ``jax``."""
    if not os.path.exists(PYTHON):
        return False
    r = subprocess.run([PYTHON, "-c", "import jax"], capture_output=True)
    return r.returncode == 0


def ensure(quiet: bool = False) -> str:
    """Create ``.jaxenv`` with ``jax`` and ``jaxlib`` if missing; return its python.

    >>> ensure()  # doctest: +SKIP
    '/.../.jaxenv/bin/python'
    """
    if available():
        return PYTHON
    out = subprocess.DEVNULL if quiet else None
    if not os.path.exists(PYTHON):
        # the interpreter running this script may live in fshard's venv; any python3
        # works for `-m venv`, the base interpreter avoids nesting virtualenvs
        base = getattr(sys, "_base_executable", None) or sys.executable
        subprocess.run([base, "-m", "venv", ENV_DIR], check=True, stdout=out)
    subprocess.run([PYTHON, "-m", "pip", "install", "--quiet", "--upgrade", "pip"],
                   check=True, stdout=out)
    subprocess.run([PYTHON, "-m", "pip", "install", "--quiet", "jax", "jaxlib"],
                   check=True, stdout=out)
    return PYTHON


def version() -> str | None:
    """The installed JAX version, or None without the environment."""
    if not available():
        return None
    r = subprocess.run([PYTHON, "-c", "import jax, jaxlib; print(jax.__version__)"],
                       capture_output=True, text=True)
    return r.stdout.strip() or None


def run_baselines(names, quick: bool = False, timeout: float = 900) -> dict:
    """Run ``jax_baselines.py`` for ``names`` in the JAX environment.

    Returns the parsed JSON: ``{name: {...timings...}, "_meta": {...}}``; an empty
    dict (with ``_error``) when the environment is missing or the run fails.
    """
    if not available():
        return {"_error": f"no JAX environment at {ENV_DIR} (run: python benchmarks/jax_env.py)"}
    cmd = [PYTHON, BASELINES, "--only", ",".join(names)]
    if quick:
        cmd.append("--quick")
    env = dict(os.environ, JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="3")
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if r.returncode != 0:
        return {"_error": f"jax_baselines.py exited {r.returncode}: {r.stderr[-2000:]}"}
    # the JSON document is the last line; JAX may print notices before it
    return json.loads(r.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--check" in argv:
        v = version()
        print(v or "JAX environment missing")
        return 0 if v else 1
    ensure()
    print(f"JAX {version()} in {ENV_DIR}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
