#!/usr/bin/env bash
# The project's test command: starts the services the tests need when they
# are down, then runs every test of every module with the race detector.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/services.sh
go test -race -count=1 -timeout 15m ./...
