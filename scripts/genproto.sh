#!/usr/bin/env bash
# Regenerates the Go code of every .proto file in the repository.
#
#   scripts/genproto.sh           regenerate, writing changed files only
#   scripts/genproto.sh --check   regenerate into a temporary directory and
#                                 fail if the committed files differ
#
# Every tool is pinned below and built from the Go module proxy with the
# go command, so the only prerequisite is Go; builds are cached in GOCACHE
# and GOMODCACHE like any other Go build. Nothing is fetched for .proto
# imports: the well-known types (google/protobuf/*.proto) are compiled into
# buf, and imports between the repository's own modules are resolved
# locally.
#
# Modules: every directory under proto/, internal/ or examples/ that holds a
# buf.yaml is the root of one buf module (its .proto files import each other
# relative to it). All modules are compiled together as one workspace, so
# they can import each other. To add protos elsewhere, put a one-line
# buf.yaml ("version: v2") at their import root; a .proto file outside every
# module is an error. If a workspace buf.yaml is ever added at the repository
# root, it is used as is instead.
#
# Generated code goes where each file's go_package says (see
# proto/buf.gen.yaml). Generated *.pb.go files under proto/, internal/ and
# examples/ that no longer have a source are deleted.
set -euo pipefail

# Pinned tool versions. protoc-gen-go should match google.golang.org/protobuf
# in go.mod; the code protoc-gen-go-grpc generates needs google.golang.org/grpc
# v1.64.0 or newer.
BUF_VERSION=v1.75.0
PROTOC_GEN_GO_VERSION=v1.36.12
PROTOC_GEN_GO_GRPC_VERSION=v1.6.2

SEARCH_DIRS=(proto internal examples)
TEMPLATE=proto/buf.gen.yaml

usage() {
	echo "usage: $0 [--check]" >&2
	exit 2
}

check=false
case $# in
0) ;;
1) [[ $1 == --check ]] || usage; check=true ;;
*) usage ;;
esac

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# Look in the module cache before the configured proxy: once the tools have
# been downloaded, a run needs no network at all.
GOPROXY="file://$(go env GOMODCACHE)/cache/download,$(go env GOPROXY)"
export GOPROXY

buf() {
	go run "github.com/bufbuild/buf/cmd/buf@${BUF_VERSION}" "$@"
}

# Lists files named $1 in SEARCH_DIRS, skipping vendored and test data trees.
find_in_search_dirs() {
	local dirs=() d
	for d in "${SEARCH_DIRS[@]}"; do
		if [[ -d $d ]]; then
			dirs+=("$d")
		fi
	done
	((${#dirs[@]})) || return 0
	find "${dirs[@]}" \( -name vendor -o -name testdata -o -name node_modules -o -name '.*' \) -prune \
		-o -type f -name "$1" -print | LC_ALL=C sort
}

# A warning, not an error: go.mod is edited independently of this script.
gomod_protobuf=$(go list -m -f '{{.Version}}' google.golang.org/protobuf 2>/dev/null || true)
if [[ -n $gomod_protobuf && $gomod_protobuf != "$PROTOC_GEN_GO_VERSION" ]]; then
	echo "warning: go.mod has google.golang.org/protobuf $gomod_protobuf but protoc-gen-go is pinned to $PROTOC_GEN_GO_VERSION; update the pin in $0" >&2
fi

# --- the workspace -----------------------------------------------------------

config_args=()
if [[ -f buf.yaml ]]; then
	modules=()
	echo "using the workspace in buf.yaml" >&2
else
	mapfile -t roots < <(find_in_search_dirs buf.yaml | xargs -r -n1 dirname)
	mapfile -t protos < <(find_in_search_dirs '*.proto')

	# Modules are the roots holding at least one .proto file (buf rejects
	# empty ones); files outside every root are an error.
	modules=()
	orphans=()
	declare -A has_protos=()
	for f in "${protos[@]}"; do
		covered=false
		for m in "${roots[@]}"; do
			if [[ $f == "$m"/* ]]; then
				covered=true
				has_protos[$m]=1
			fi
		done
		$covered || orphans+=("$f")
	done
	for m in "${roots[@]}"; do
		if [[ -n ${has_protos[$m]:-} ]]; then
			modules+=("$m")
		fi
	done
	if ((${#orphans[@]})); then
		echo "error: these .proto files are in no buf module:" >&2
		printf '  %s\n' "${orphans[@]}" >&2
		echo "add a buf.yaml containing \"version: v2\" to the directory their imports are relative to" >&2
		exit 1
	fi
	if ((${#modules[@]} == 0)); then
		echo "error: no .proto files in a buf module under ${SEARCH_DIRS[*]}" >&2
		exit 1
	fi
	config='{"version":"v2","modules":['
	sep=
	for m in "${modules[@]}"; do
		config+="$sep{\"path\":\"$m\"}"
		sep=,
	done
	config+=']}'
	config_args=(--config "$config")
	echo "modules: ${modules[*]}" >&2
fi

# --- the plugins ---------------------------------------------------------------

mkdir -p "$work/bin" "$work/out"
GOBIN="$work/bin" go install "google.golang.org/protobuf/cmd/protoc-gen-go@${PROTOC_GEN_GO_VERSION}"
GOBIN="$work/bin" go install "google.golang.org/grpc/cmd/protoc-gen-go-grpc@${PROTOC_GEN_GO_GRPC_VERSION}"
export PATH="$work/bin:$PATH"

# --- generate --------------------------------------------------------------------

buf generate "${config_args[@]}" --template "$TEMPLATE" --output "$work/out" .

mapfile -t generated < <(cd "$work/out" && find . -type f | sed 's|^\./||' | LC_ALL=C sort)

# Generated files already in the tree, recognised by the standard header
# that protoc-gen-go and protoc-gen-go-grpc put before the package clause.
existing=()
while IFS= read -r f; do
	if sed '/^package /q' "$f" | grep -Eq '^// Code generated by protoc-gen-go(-grpc)?\. DO NOT EDIT\.$'; then
		existing+=("$f")
	fi
done < <(find_in_search_dirs '*.pb.go')

declare -A is_generated=()
for f in "${generated[@]}"; do
	is_generated[$f]=1
done
stale=()
for f in "${existing[@]}"; do
	[[ -n ${is_generated[$f]:-} ]] || stale+=("$f")
done

if $check; then
	bad=0
	for f in "${generated[@]}"; do
		if [[ ! -f $f ]]; then
			echo "missing: $f" >&2
			bad=1
		elif ! cmp -s "$work/out/$f" "$f"; then
			echo "differs: $f" >&2
			diff -u "$f" "$work/out/$f" --label "$f (committed)" --label "$f (generated)" >&2 || true
			bad=1
		fi
	done
	for f in "${stale[@]}"; do
		echo "stale (its .proto is gone): $f" >&2
		bad=1
	done
	if ((bad)); then
		echo "error: generated protobuf code is out of date; run scripts/genproto.sh and commit the result" >&2
		exit 1
	fi
	echo "generated protobuf code is up to date (${#generated[@]} files)" >&2
	exit 0
fi

changed=0
for f in "${generated[@]}"; do
	if ! cmp -s "$work/out/$f" "$f" 2>/dev/null; then
		mkdir -p "$(dirname "$f")"
		cp "$work/out/$f" "$f"
		echo "wrote $f" >&2
		changed=$((changed + 1))
	fi
done
for f in "${stale[@]}"; do
	rm -- "$f"
	echo "removed $f" >&2
	changed=$((changed + 1))
done
echo "${#generated[@]} generated files, $changed changed" >&2
