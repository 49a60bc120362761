#!/usr/bin/env bash
# The wheel as a user gets it: build the sdist and, from it, the wheel (`python -m build`); install the
# wheel into a fresh virtual environment (CPU torch first); then, from a folder outside the checkout,
# run what a new user runs first — `mlight --version`, the demo model on the demo prompts, a plan on a
# bundled preset, and the app's Pilot smoke test against the installed package.
#
# Usage: packaging/check_wheel.sh [WORK_DIR]     (.ci/run calls it; about 1–2 minutes)
# Without WORK_DIR it works in a temporary folder (≈ 1.5 GB with torch) and removes it at the end.
# Needs: python3 with pip; installs `build` into the running Python when it is missing.
set -euo pipefail
SRC=$(cd "$(dirname "$0")/.." && pwd)
if [ $# -ge 1 ]; then
  WORK=$1
else
  WORK=$(mktemp -d -t mlight-wheel.XXXXXX)
  trap 'rm -rf "$WORK"' EXIT
fi
mkdir -p "$WORK"
WORK=$(cd "$WORK" && pwd)
PY=${PYTHON:-python3}
step() { printf '\n== %s (%ss)\n' "$1" "$SECONDS"; }
fail() { echo "check_wheel: FAILED: $*" >&2; exit 1; }

step "build sdist and wheel"
"$PY" -c "import build" 2>/dev/null || "$PY" -m pip install -q build
rm -rf "$WORK/dist"
"$PY" -m build --outdir "$WORK/dist" "$SRC" >"$WORK/build.log" 2>&1 || { tail -30 "$WORK/build.log"; fail "python -m build"; }
WHEEL=$(ls "$WORK"/dist/mlight-*-py3-none-any.whl)
ls "$WORK"/dist/mlight-*.tar.gz >/dev/null || fail "no sdist"
"$PY" - "$WHEEL" <<'PY' || fail "wheel contents"
import sys, zipfile
names = zipfile.ZipFile(sys.argv[1]).namelist()
need = ["core/assets/mt_bench_questions.jsonl", "core/assets/demo_prompts.jsonl", "app/tui/mlight.tcss"]
missing = [n for n in need if n not in names]
missing += [] if any(n.endswith(".dist-info/licenses/LICENSE") for n in names) else ["LICENSE"]
missing += [] if any(n.startswith("core/assets/configs/") for n in names) else ["core/assets/configs/"]
stray = [n for n in names if n.split("/")[0] not in ("core", "app") and ".dist-info/" not in n]
print(f"{len(names)} files in {sys.argv[1].rsplit('/', 1)[-1]}")
sys.exit(f"missing {missing}" if missing else f"stray top-level files {stray}" if stray else 0)
PY

step "fresh virtual environment: torch==2.13.0 (CPU) first, then the wheel"
rm -rf "$WORK/venv"
"$PY" -m venv "$WORK/venv"
VPY="$WORK/venv/bin/python"
[ -x "$VPY" ] || VPY="$WORK/venv/Scripts/python.exe"
"$VPY" -m pip install -q --no-compile torch==2.13.0
"$VPY" -m pip install -q --no-compile "$WHEEL" pytest pytest-timeout
BIN=$(dirname "$VPY")

step "run from a folder outside the checkout"
OUTSIDE="$WORK/elsewhere dir é"  # a space and a non-ASCII letter, as user folders have
mkdir -p "$OUTSIDE"
cd "$OUTSIDE"
export MLIGHT_CACHE_DIR="$WORK/cache"
"$VPY" -c "import core, app, sys; p = core.__file__; print('core from', p); sys.exit('$SRC' in p)" \
  || fail "core is imported from the checkout"

"$BIN/mlight" --version | tee version.txt
grep -q "^mlight $("$VPY" -c 'import core; print(core.__version__)')$" version.txt || fail "mlight --version"
"$BIN/mlight-app" --version | head -1 | grep -q "^mlight " || fail "mlight-app --version"

step "mlight run on the demo model"
"$BIN/mlight" run --prompts demo --out demo.jsonl --max-new-tokens 8
[ "$(wc -l < demo.jsonl)" -eq 16 ] || fail "the demo run wrote $(wc -l < demo.jsonl) results, not 16"

step "mlight plan on a bundled preset"
"$BIN/mlight" plan --model mixtral-8x7b --hardware t4 --prompt-len 77 --gen-len 128 --json > plan.json
"$VPY" -c "import json; d = json.load(open('plan.json', encoding='utf-8')); assert d, d" || fail "mlight plan --json"

step "the app's Pilot smoke test against the installed package"
# -o addopts=: the checkout's pyproject asks for xdist workers (-n auto); this venv has no xdist, and one test needs none
MLIGHT_TEST_INSTALLED=1 "$VPY" -m pytest -q -p no:cacheprovider -o addopts= \
  "$SRC/tests/test_app_flow.py::test_whole_flow_on_the_demo_model"

step "done"
echo "check_wheel: OK ($WHEEL)"
