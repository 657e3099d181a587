#!/usr/bin/env bash
# The project's test command: starts the services the tests need when they
# are down, then runs every test of every Go module in the repository (the
# library and the examples that live in modules of their own) with the race
# detector. Every module runs even when an earlier one failed; the script
# fails at the end if any did.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/services.sh
failed=()
for mod in $(git ls-files --cached --others --exclude-standard -- '*go.mod' | xargs -n1 dirname | sort); do
	echo "==> go test ./... in $mod"
	if ! (cd "$mod" && go test -race -count=1 -timeout 15m ./...); then
		failed+=("$mod")
	fi
done
if ((${#failed[@]})); then
	echo "FAILED modules: ${failed[*]}" >&2
	exit 1
fi
echo "all modules passed"
