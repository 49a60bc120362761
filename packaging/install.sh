#!/bin/sh
# Install mlight for this user (Linux, macOS): an isolated environment made by uv, holding the build of
# torch that fits this machine — the CUDA build the NVIDIA driver runs, the CPU build without an NVIDIA
# GPU, the default build on macOS — then mlight; `mlight` and `mlight-app` go on PATH.
#
#   curl -LsSf https://raw.githubusercontent.com/mlight-project/mlight/main/packaging/install.sh | sh
#   sh install.sh [--cpu | --cuda VERSION] [--python VERSION] [--from SPEC] [--dry-run]
#   curl -LsSf .../install.sh | sh -s -- --cpu        (options through a pipe)
#
#   --cpu             the CPU build of torch, even with an NVIDIA GPU
#   --cuda VERSION    this CUDA build of torch (12.6, 12.8, 13.0, ...), whatever the driver says
#   --python VERSION  Python for mlight's environment (default 3.12; uv fetches it when missing)
#   --from SPEC       what to install: mlight==0.1.0, a wheel file, a source folder (default: mlight)
#   --dry-run         say what would be installed and the commands, change nothing
#
# The torch choice is packaging/torch_choice.py (tested with fake nvidia-smi outputs); this script finds
# it beside itself or fetches it from $MLIGHT_INSTALL_BASE. Uninstall: uv tool uninstall mlight
set -eu

BASE=${MLIGHT_INSTALL_BASE:-https://raw.githubusercontent.com/mlight-project/mlight/main/packaging}
PYVER=3.12
SPEC=mlight
DRY=0
CHOICE_ARGS=""

say() { printf '%s\n' "$*"; }
die() { printf 'mlight installer: error: %s\n' "$*" >&2; exit "${2:-1}"; }
usage() { sed -n '2,17s/^# \{0,1\}//p' "$0" 2>/dev/null || true; }

while [ $# -gt 0 ]; do
  case $1 in
    --cpu) CHOICE_ARGS="$CHOICE_ARGS --cpu" ;;
    --cuda) [ $# -ge 2 ] || die "--cuda needs a version, like --cuda 12.8" 2; CHOICE_ARGS="$CHOICE_ARGS --cuda $2"; shift ;;
    --cuda=*) CHOICE_ARGS="$CHOICE_ARGS --cuda ${1#--cuda=}" ;;
    --python) [ $# -ge 2 ] || die "--python needs a version, like --python 3.12" 2; PYVER=$2; shift ;;
    --from) [ $# -ge 2 ] || die "--from needs a package spec, wheel or folder" 2; SPEC=$2; shift ;;
    --dry-run) DRY=1 ;;
    -h|--help) usage; exit 0 ;;
    *) die "unknown option $1 (see --help)" 2 ;;
  esac
  shift
done

case $(uname -s) in
  Darwin) SYSTEM=macos ;;
  Linux) SYSTEM=linux ;;
  MINGW*|MSYS*|CYGWIN*) die "on Windows, run packaging/install.ps1 in PowerShell" 2 ;;
  *) SYSTEM=linux ;;
esac
SYSTEM=${MLIGHT_SYSTEM:-$SYSTEM}

# ---- uv ------------------------------------------------------------------------------------------
UV=$(command -v uv 2>/dev/null || true)
[ -n "$UV" ] || { [ -x "$HOME/.local/bin/uv" ] && UV=$HOME/.local/bin/uv; } || true
if [ -z "$UV" ]; then
  if [ "$DRY" = 1 ]; then
    say "would install uv (Astral's installer, into ~/.local/bin)"
    UV=uv
  else
    say "installing uv (Astral's installer, into ~/.local/bin) ..."
    if command -v curl >/dev/null 2>&1; then curl -LsSf https://astral.sh/uv/install.sh | sh
    elif command -v wget >/dev/null 2>&1; then wget -qO- https://astral.sh/uv/install.sh | sh
    else die "neither curl nor wget is here to fetch uv: install uv yourself, then run this again"; fi
    UV=$HOME/.local/bin/uv
    [ -x "$UV" ] || UV=$(command -v uv 2>/dev/null) || die "uv was installed but cannot be found: open a new terminal and run this again"
  fi
fi

# ---- which torch ----------------------------------------------------------------------------------
HERE=$(cd "$(dirname "$0")" 2>/dev/null && pwd || echo .)
CHOOSER=$HERE/torch_choice.py
if [ ! -f "$CHOOSER" ]; then  # run through a pipe: fetch the chooser from where this script came from
  CHOOSER=$(mktemp "${TMPDIR:-/tmp}/mlight-torch-choice.XXXXXX")
  trap 'rm -f "$CHOOSER"' EXIT
  if command -v curl >/dev/null 2>&1; then curl -LsSf "$BASE/torch_choice.py" -o "$CHOOSER"
  else wget -qO "$CHOOSER" "$BASE/torch_choice.py"; fi || die "cannot fetch $BASE/torch_choice.py"
fi
PY=""
for p in python3 python; do
  if command -v "$p" >/dev/null 2>&1 && "$p" -c 'import sys; sys.exit(sys.version_info < (3, 8))' 2>/dev/null; then
    PY=$p; break
  fi
done
# shellcheck disable=SC2086  # CHOICE_ARGS is a list of words
if [ -n "$PY" ]; then
  BACKEND=$("$PY" "$CHOOSER" --system "$SYSTEM" $CHOICE_ARGS) || exit $?
elif [ "$DRY" = 0 ] || [ "$UV" != uv ]; then
  BACKEND=$("$UV" run --no-project --quiet --python "$PYVER" -- python "$CHOOSER" --system "$SYSTEM" $CHOICE_ARGS) || exit $?
else
  die "no Python 3.8+ here to decide which torch to install (and no uv yet): install python3 or uv first"
fi

# ---- install ---------------------------------------------------------------------------------------
set -- tool install --force --python "$PYVER"
[ "$BACKEND" = default ] || set -- "$@" --torch-backend "$BACKEND"
set -- "$@" --reinstall-package torch "$SPEC"
if [ "$DRY" = 1 ]; then
  say "would install: $SPEC with torch's ${BACKEND} build, Python $PYVER, in its own environment"
  say "would run:     uv $*"
  say "would run:     uv tool update-shell   (puts mlight and mlight-app on PATH)"
  exit 0
fi
"$UV" --version >/dev/null 2>&1 || die "$UV does not run"
"$UV" tool install --help 2>/dev/null | grep -q -- --torch-backend \
  || die "this uv ($("$UV" --version)) is too old to choose torch builds: run 'uv self update' and try again"
say "installing $SPEC (torch: $BACKEND) ..."
"$UV" "$@"

BIN=$("$UV" tool dir --bin 2>/dev/null || echo "$HOME/.local/bin")
case ":$PATH:" in
  *":$BIN:"*) ON_PATH=1 ;;
  *) ON_PATH=0; "$UV" tool update-shell >/dev/null 2>&1 || true ;;
esac
"$BIN/mlight" --version || die "mlight was installed into $BIN but does not start"
say ""
say "mlight is installed."
[ "$ON_PATH" = 1 ] || say "Open a new terminal first (or run: export PATH=\"$BIN:\$PATH\"), then:"
say "  mlight-app                                       the app, on the built-in demo model"
say "  mlight run --prompts demo --out results.jsonl    the same, headless"
say "  mlight --help                                    everything else"
say "Uninstall: uv tool uninstall mlight"
