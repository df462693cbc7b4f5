# Sourced by the benchmarks/h200_*.sh device scripts: $OUT, unbuffered Python, the carried wheels
# (fla-core, when `.whl` was carried) on PYTHONPATH, and `step LIMIT_S NAME CMD...`, which runs
# CMD under a time limit into $OUT/NAME.log and prints its exit status and the log's tail.
OUT=${OUT:-/tmp/h200_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if ls .whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=/tmp/site:.
step() {
  local t=$1; shift; local name=$1; shift
  echo "== $name"; timeout "$t" "$@" > "$OUT/$name.log" 2>&1; echo "rc=$?"
  grep -v '^# \[' "$OUT/$name.log" | grep -v '^op=' | tail -"${TAILN:-30}"
}
