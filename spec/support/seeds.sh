#!/bin/sh
# make test-seeds: the seeded #cuda specs (SPECS, file names under spec/
# without .lua) under N seeds each, JOBS runs at a time, in the simulator
# (EXE).  make test runs them under one fixed seed; this draws new inputs
# (GL_CUDA_SPEC_SEED, spec/support/cuda_twin.lua): seeds FIRST, FIRST + 1000,
# ... (each run's inputs take the seeds that follow its own, so runs 1000
# apart draw no input twice).  Every failing run is printed with its failures
# and the command that repeats it; the exit status is 1 when any failed.
#   N=50 FIRST=<from the clock> JOBS=2 EXE=build/sim/gptlua SPECS="cuda_spec ..."
#   LOGS=DIR keeps every run's output there (SEED-FILE.log), else a temporary
#   directory is removed at the end
set -u
N=${N:-50}
JOBS=${JOBS:-2}
EXE=${EXE:-build/sim/gptlua}
FIRST=${FIRST:-$(( $(date +%s) % 1000000 * 1000 ))}
SPECS=${SPECS:?SPECS: the spec files to run, e.g. "cuda_spec cuda_attention_spec"}
case "$N$JOBS$FIRST" in *[!0-9]*) echo "test-seeds: N, JOBS and FIRST must be non-negative integers, got N=$N JOBS=$JOBS FIRST=$FIRST" >&2; exit 2;; esac
[ -x "$EXE" ] || { echo "test-seeds: $EXE not found, expected the simulator build (make sim)" >&2; exit 2; }
if [ -n "${LOGS:-}" ]; then mkdir -p "$LOGS" || exit 2
else LOGS=$(mktemp -d); trap 'rm -rf "$LOGS"' EXIT; fi
echo "test-seeds: $N seeds from $FIRST (step 1000) x $(echo $SPECS | wc -w) spec files, $JOBS at a time"
i=0
while [ "$i" -lt "$N" ]; do
  seed=$(( FIRST + 1000 * i ))
  for s in $SPECS; do echo "$seed $s"; done
  i=$(( i + 1 ))
done | xargs -P "$JOBS" -L 1 sh -c '
  seed=$1; s=$2; log="'"$LOGS"'/$seed-$s.log"
  if GL_CUDA_SPEC_SEED=$seed "'"$EXE"'" spec/run.lua --tags=cuda "spec/$s.lua" > "$log" 2>&1; then
    echo ok > "$log.status"
  else
    echo fail > "$log.status"
    { echo "FAILED: seed $seed, spec/$s.lua; repeat: GL_CUDA_SPEC_SEED=$seed '"$EXE"' spec/run.lua --tags=cuda spec/$s.lua"
      grep -E "^(spec/.*[0-9]: |Failure|Error)|allowed|expected|mismatch" "$log" | head -20 | sed "s/^/    /"; } >&2
  fi' sh
runs=$(ls "$LOGS"/*.status 2>/dev/null | wc -l)
failed=$(grep -l fail "$LOGS"/*.status 2>/dev/null | wc -l)
echo "test-seeds: $runs runs ($N seeds x $(echo $SPECS | wc -w) files), $failed failed"
if [ "$failed" -gt 0 ]; then
  echo "failing seeds:"; grep -l fail "$LOGS"/*.status | sed 's|.*/||; s|\.log\.status$||; s|-| spec/|; s|$|.lua|; s|^|  |'
  exit 1
fi
