#!/usr/bin/env bash
# Walk the real mlight-app through the whole flow in tmux on the demo model and save what a person
# sees at each step as plain text: assets/screens/<size>/<NN>-<step>.txt.
# Usage: assets/screens/capture.sh [COLSxROWS ...]   (default: 120x40 80x24). Needs tmux.
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
. .venv/bin/activate
SIZES=("${@:-120x40}")
[ $# -eq 0 ] && SIZES=(120x40 80x24)

for size in "${SIZES[@]}"; do
  cols=${size%x*}; rows=${size#*x}
  out="$ROOT/assets/screens/$size"; mkdir -p "$out"; rm -f "$out"/*.txt
  work=$(mktemp -d)
  # 32 MT-Bench first turns, 256 new tokens each: a run long enough to pause and stop by hand on a fast box
  python - "$work/mt_bench.jsonl" <<'PY'
import json, sys
with open("core/assets/mt_bench_questions.jsonl", encoding="utf-8") as f, open(sys.argv[1], "w", encoding="utf-8") as out:
    for line in list(f)[:32]:
        q = json.loads(line)
        out.write(json.dumps({"id": f"mtbench-{q['question_id']}", "prompt": q["turns"][0], "max_new_tokens": 256}) + "\n")
PY
  s="mlight-shots-$size"
  tmux kill-session -t "$s" 2>/dev/null || true
  tmux new-session -d -s "$s" -x "$cols" -y "$rows" \
    "cd $work && MLIGHT_CACHE_DIR=${MLIGHT_CACHE_DIR:-$work/cache} MLIGHT_RESULTS_DIR=$work/results mlight-app; sleep 5"

  until_matches() {
    local t=0; while ! tmux capture-pane -p -t "$s" | grep -qE -- "$1"; do
      sleep 0.5; t=$((t + 1)); [ $t -gt $(( ${2:-120} * 2 )) ] && { echo "timeout waiting for: $1" >&2; shot "timeout"; return 1; }
    done; sleep 0.3
  }
  shot() { tmux capture-pane -p -t "$s" > "$out/$1.txt"; }
  keys() { tmux send-keys -t "$s" "$@"; }
  # wait (up to $2 s, default 120) until the screen shows text $1
  until_shows() {
    local t=0; while ! tmux capture-pane -p -t "$s" | grep -qF -- "$1"; do
      sleep 0.5; t=$((t + 1)); [ $t -gt $(( ${2:-120} * 2 )) ] && { echo "timeout waiting for: $1" >&2; shot "timeout"; return 1; }
    done; sleep 0.3
  }

  until_shows "Ready. Press Enter"; shot 01-machine
  keys Enter; until_shows "none chosen yet"; shot 02-model
  keys Enter; until_shows "Ctrl+N to choose prompts"; shot 03-model-demo
  keys C-n; until_shows "none yet — type"
  keys "'$work/mt_bench.jsonl'" Enter; until_shows "prompts ready"; shot 04-prompts
  keys C-o; sleep 1; shot 05-prompts-browse; keys Escape; sleep 0.5
  keys C-n; until_shows "accepts the plan"; shot 06-plan
  keys F1; until_shows "Keys everywhere"; shot 07-help; keys Escape; sleep 0.5
  keys C-n; until_shows "tokens/s now";   until_matches "Requests +[1-9]" 600; sleep 1; shot 08-run-running
  keys q; until_shows "Quit now?"; shot 09-run-quit-asks; keys n; sleep 0.5
  keys Space; until_shows "Paused"; shot 10-run-paused
  keys s; until_shows "r resumes" 300; shot 11-run-stopped
  keys r; until_shows "Done:" 1200; shot 12-run-done
  keys t; sleep 1; shot 13-run-pipeline; keys z z; sleep 1; shot 14-run-pipeline-zoomed; keys t
  keys C-n; until_shows "results, "; shot 15-results
  keys Enter; until_shows "Output"; shot 16-result-detail
  keys Escape; sleep 0.5; keys c; until_shows "Enter writes"; shot 17-export
  keys Enter; until_shows "Wrote 32 results"; shot 18-exported
  keys C-p; sleep 1; shot 19-command-palette; keys Escape
  keys C-q; sleep 1
  tmux kill-session -t "$s" 2>/dev/null || true

  # Plan's Advanced choices with int4 experts: Tab to "Advanced", open it, Tab to Quantize, pick int4
  tmux new-session -d -s "$s" -x "$cols" -y "$rows" \
    "cd $work && MLIGHT_CACHE_DIR=${MLIGHT_CACHE_DIR:-$work/cache} MLIGHT_RESULTS_DIR=$work/results mlight-app --model demo --prompts demo; sleep 5"
  until_shows "accepts the plan"
  for _ in $(seq 11); do keys Tab; sleep 0.1; done; keys Enter; until_shows "Compute dtype"; sleep 1
  for _ in $(seq 4); do keys Tab; sleep 0.1; done; keys Enter; until_shows "int8"; sleep 1
  keys Down; sleep 0.5; keys Down; sleep 0.5; keys Enter
  until_shows "Speed-up"; shot 20-plan-int4; keys C-q; sleep 1
  tmux kill-session -t "$s" 2>/dev/null || true

  # a console whose encoding lacks ✓ ✗ ⏎ and the box drawing: ASCII signs and look-alikes, nothing shifted
  tmux new-session -d -s "$s" -x "$cols" -y "$rows" \
    "cd $work && PYTHONIOENCODING=ascii MLIGHT_CACHE_DIR=${MLIGHT_CACHE_DIR:-$work/cache} MLIGHT_RESULTS_DIR=$work/results mlight-app --model demo --prompts demo; sleep 5"
  until_shows "accepts the plan"; shot 21-plan-ascii-console; keys C-q; sleep 1
  tmux kill-session -t "$s" 2>/dev/null || true
  rm -rf "$work"
  echo "$size: $(ls "$out" | wc -l) captures in $out"
done
