#!/usr/bin/env bash
# The kind of script a CI job runs around csrun: validate, train, check the JSON, and
# make sure a broken config fails with exit code 2 (not a crash).
#   bash tests/integration/smoke.sh CONFIG
set -euo pipefail
config="$1"

csrun validate "$config" train.epochs=1
csrun train "$config" train.epochs=1 --json result.json > train.log

python - <<'PY'
import json
result = json.load(open("result.json"))
assert result["status"] == "completed", result["status"]
assert result["exit_code"] == 0
assert len(result["per_replica"]) == 2, result["per_replica"]
assert len(result["params_sha256"]) == 64
print("params_sha256", result["params_sha256"])
PY

printf 'model: {kind: linear}\ntrain: {steps: 1}\n' > broken.yaml
set +e
csrun validate broken.yaml 2> broken.err
code=$?
set -e
if [ "$code" -ne 2 ]; then
  echo "expected exit code 2 for a broken config, got $code" >&2
  exit 1
fi
grep -q "dataset: missing section" broken.err
echo "smoke: ok"
