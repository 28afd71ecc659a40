#!/usr/bin/env bash
# The quickstart: put the shipped model draft where a writer would, run the
# daemon once with the built-in reviewer (no API key), show what it wrote.
set -euo pipefail
cd "$(dirname "$0")/.."
export LITELLM_LOCAL_MODEL_COST_MAP=True

scripts=runs/example-run/epoch_00/step_00/example/scripts
mkdir -p "$scripts"
cp data/example/model_draft/ep*.txt "$scripts/"
touch "$scripts/_SUCCESS"   # "finished writing": no settle wait

skilltrain daemon --once --config config.toml 2>/dev/null
skilltrain tail --config config.toml --run example-run | tail -n 12
skilltrain status --config config.toml
echo
echo "Reports:"
ls -1 runs/example-run/loss/epoch_00/step_00/
echo
sed -n '1,20p' runs/example-run/loss/epoch_00/step_00/example_ep01-03.md

# The closed loop: the daemon runs the toy writer of each step, scores it with
# the built-in reviewer, runs the toy optimizer, and goes on to the next step
# until [loop] max_epochs (examples/loop.toml: 2 epochs x 2 steps).
echo
echo "Closed loop (examples/loop.toml):"
rm -rf runs/example-loop
log=runs/skilltrain.jsonl
seen=$(wc -l < "$log")   # the log goes on across runs of this script: look past this
skilltrain daemon --config examples/loop.toml 2>/dev/null &
daemon=$!
trap 'kill -TERM "$daemon" 2>/dev/null || true' EXIT
skilltrain start example-loop --config examples/loop.toml
for _ in $(seq 600); do
    tail -n +"$((seen + 1))" "$log" | grep '"run.finished"' | grep -q '"example-loop"' && break
    kill -0 "$daemon" 2>/dev/null || { echo "the daemon exited"; exit 1; }
    sleep 0.2
done
kill -TERM "$daemon" && wait "$daemon" || true
trap - EXIT
skilltrain tail --config examples/loop.toml --run example-loop \
    --event run.,writer.finished,step.reported,optimizer.finished | tail -n 20
skilltrain progress example-loop --config examples/loop.toml
echo
cat runs/example-loop/skill.md
