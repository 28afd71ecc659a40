#!/bin/bash
# The user's batch script around a stage command, as docs/scale-out.md shows
# it: whatever way it ends, its exit status goes to the daemon's done marker.
trap 'echo $? > "$SKILLTRAIN_STAGE_DONE"' EXIT
"$@"
