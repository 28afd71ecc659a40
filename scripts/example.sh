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
