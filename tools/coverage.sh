#!/usr/bin/env bash
# Branch coverage of the test suite, per file, including the scripts the tests run as subprocesses
# (python train.py, torchrun, experiments.py's runs): each Python process started under this script
# imports a sitecustomize.py from a temporary folder on PYTHONPATH that starts coverage
# (coverage.process_startup(), configured by [tool.coverage.run] in pyproject.toml).
#   tools/coverage.sh                        # the whole suite, then the table per file
#   tools/coverage.sh -k "sample or resume"  # pytest's arguments pass through
# Needs the coverage package (pip install coverage; it is in requirements-extra.txt).
set -euo pipefail
cd "$(dirname "$0")/.."
if ! python -c "import coverage" 2>/dev/null; then
    echo "tools/coverage.sh needs the coverage package: pip install coverage (not needed otherwise)" >&2
    exit 2
fi
hook=$(mktemp -d)
data=$(mktemp -d)
trap 'rm -rf "$hook" "$data"' EXIT
echo "import coverage; coverage.process_startup()" > "$hook/sitecustomize.py"
export COVERAGE_PROCESS_START="$PWD/pyproject.toml" COVERAGE_FILE="$data/.coverage" COVERAGE_ROOT="$PWD"
export PYTHONPATH="$hook${PYTHONPATH:+:$PYTHONPATH}"
status=0
python -m pytest -q -p no:cacheprovider "$@" || status=$?
python -m coverage combine -q
python -m coverage report --show-missing --skip-empty --include="$PWD/*"
exit $status
