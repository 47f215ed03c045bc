#!/usr/bin/env bash
# The compile tests (graph, break and recompile counts of the compiled routed model) under another torch:
#
#     bash scripts/compile_check.sh 2.11.0
#
# Makes a throwaway virtual environment in a temporary folder with torch==VERSION, sees the current
# environment's other packages through a .pth file (its own torch comes first), runs the tests listed below
# with PYTHONPATH at this checkout, prints which passed and the graph and break counts, and deletes the
# folder. Run it from the project's environment (`python` on PATH, or PYTHON=...). A GPU is not needed: the
# tests trace with dynamo (explain, and the eager backend) on the CPU.
set -euo pipefail
version=${1:-}
if [[ -z "$version" || "$version" == -* ]]; then
    echo "usage: bash scripts/compile_check.sh TORCH_VERSION   (e.g. 2.11.0)" >&2
    exit 2
fi
repo=$(cd "$(dirname "$0")/.." && pwd)
python=${PYTHON:-python}
tests=(tests/test_compile_graphs.py "tests/test_performance_paths.py::test_compile_with_routing_compiles_once_without_graph_breaks"
       "tests/test_performance_paths.py::test_compile_with_routing_survives_a_changing_batch_size")
tmp=$(mktemp -d "${TMPDIR:-/tmp}/compile_check.XXXXXX")
trap 'rm -rf "$tmp"' EXIT

outer_site=$("$python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
"$python" -m venv "$tmp/venv"
inner_site=$("$tmp/venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo "$outer_site" > "$inner_site/_outer_environment.pth"
# timm imports torchvision, whose compiled ops must match torch: torch 2.N pairs with torchvision 0.(N+15).
minor=$(echo "$version" | cut -d. -f2)
vision="torchvision==0.$((minor + 15)).*"
echo "installing torch==$version and $vision in $tmp/venv" >&2
# An installation-wide pip constraint may cap torch at the environment's own version: this one asks for another.
if ! PIP_CONSTRAINT="" "$tmp/venv/bin/python" -m pip install -q --disable-pip-version-check "torch==$version" "$vision" \
        > "$tmp/pip.log" 2>&1; then
    grep -v "is ignored: it is neither" "$tmp/pip.log" >&2
    echo "error: pip could not install torch==$version with $vision (released versions for this Python?)" >&2
    exit 1
fi

cd "$repo"
run=("env" "PYTHONPATH=$repo:$repo/tests" "$tmp/venv/bin/python")
echo "torch $("${run[@]}" -c 'import torch; print(torch.__version__)') (asked for $version), checkout $repo"
"${run[@]}" - <<'PY'
from test_compile_graphs import graph_counts
for name, (graphs, breaks, reason) in graph_counts().items():
    print(f"{name}: {graphs} graph(s), {breaks} break(s){', first: ' + reason if reason else ''}")
PY
status=0
"${run[@]}" -m pytest -p no:cacheprovider -q -rA "${tests[@]}" > "$tmp/pytest.log" 2>&1 || status=$?
if ! grep -E "^(PASSED|FAILED|ERROR) |^E  +(AssertionError|assert)" "$tmp/pytest.log"; then
    cat "$tmp/pytest.log"
fi
echo "torch $version: $(grep -c '^PASSED ' "$tmp/pytest.log") passed, $(grep -c '^FAILED ' "$tmp/pytest.log") failed," \
     "$(grep -c '^ERROR ' "$tmp/pytest.log") errors"
exit "$status"
