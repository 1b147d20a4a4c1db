#!/usr/bin/env bash
# Static-analysis gate (CI runs it before the tests): ruff over megatron_rl, tools and tests
# (ruff.toml), then pyright over the megatron_rl package and tools/ (pyrightconfig.json), which
# resolves torch, megatron-core and transformers from the main environment, .venv. The tools live in
# their own environment, .venv-lint, pinned in requirements-lint.txt (pyright's wheel carries
# the checker and Node.js comes as a wheel: nothing is downloaded at run time).
# Idempotent: a second run only re-checks the pins. Fails when either tool reports an error.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv-lint/bin/python ]; then
  "$PY" -m venv .venv-lint
fi
stamp=.venv-lint/.requirements-lint.sha
want=$(sha256sum requirements-lint.txt | cut -c1-16)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  .venv-lint/bin/python -m pip install -q --upgrade pip
  .venv-lint/bin/python -m pip install -q -r requirements-lint.txt
  echo "$want" > "$stamp"
fi
bash scripts/setup.sh  # the environment pyright reads the dependencies' types from
# no query to PyPI for a newer pyright release at each run
export PYRIGHT_PYTHON_IGNORE_WARNINGS=1
status=0
echo "== ruff $(.venv-lint/bin/ruff --version | cut -d' ' -f2): megatron_rl tools tests"
.venv-lint/bin/ruff check --no-cache megatron_rl tools tests || status=1
echo "== pyright $(.venv-lint/bin/pyright --version | cut -d' ' -f2): megatron_rl tools"
.venv-lint/bin/pyright || status=1
exit $status
