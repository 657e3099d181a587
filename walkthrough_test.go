package idempotency_test

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/idempotency/internal/testdb"
)

// firstServiceDoc is the first-service walkthrough, which
// TestFirstServiceWalkthrough runs.
const firstServiceDoc = "docs/first-service.md"

// firstServiceBlock matches a block of the first-service walkthrough: a
// shell block to run, or a file to save (the marker names it).
var firstServiceBlock = regexp.MustCompile("(?s)<!-- first-service(?:: (\\S+))? -->\n```(\\w+)\n(.*?)```")

// The first-service walkthrough runs as a newcomer would run it: its shell
// blocks, in order, in one shell, from the root of a copy of this checkout
// named idempotency, and its files saved where it says. That includes
// installing protoc with apt-get, so the test runs as root (as CI does).
// The module it makes lives beside the copy, with nothing of this
// repository's but the replace line the walkthrough writes; its program
// calls itself twice with one key and must get one card back.
func TestFirstServiceWalkthrough(t *testing.T) {
	t.Parallel()
	doc, err := os.ReadFile(firstServiceDoc)
	require.NoError(t, err)
	blocks := firstServiceBlock.FindAllStringSubmatch(string(doc), -1)
	require.GreaterOrEqual(t, len(blocks), 6, "the walkthrough's blocks are marked in %s", firstServiceDoc)
	script := []string{"set -euo pipefail"}
	for _, b := range blocks {
		if file := b[1]; file != "" {
			script = append(script, fmt.Sprintf("mkdir -p %q && cat >%q <<'WALKTHROUGH_EOF'\n%sWALKTHROUGH_EOF", filepath.Dir(file), file, b[3]))
		} else {
			script = append(script, b[3])
		}
	}

	dir := t.TempDir()
	clone := filepath.Join(dir, "idempotency")
	copyCheckout(t, clone)
	db := testdb.New(t, 1) // a schema of the test's own, which the program's tables go into

	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, "bash", "-c", strings.Join(script, "\n"))
	cmd.Dir = clone
	bin := filepath.Join(dir, "bin")
	cmd.Env = append(os.Environ(),
		"GOBIN="+bin,
		"PATH="+bin+string(os.PathListSeparator)+os.Getenv("PATH"),
		"GOFLAGS=",
		"DATABASE_URL="+db.URL(),
	)
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	start := time.Now()
	require.NoError(t, cmd.Run(), "the walkthrough failed:\n%s", out.String())
	t.Logf("the walkthrough took %s", time.Since(start).Round(time.Second)) // the figure docs/first-service.md states
	require.Regexp(t, `card (\d+) mailed; the retry with key \S+ got card (\d+) back`, out.String())
	require.Equal(t, 1, db.Count(t, `SELECT count(*) FROM cards`), "one card, however often the call was sent")
}

// copyCheckout copies the files of the library's module in this checkout
// (tracked or new, not ignored; not the modules of their own under it) to
// dir, as a clone of the repository would have them.
func copyCheckout(t *testing.T, dir string) {
	t.Helper()
	list, err := exec.Command("git", "ls-files", "--cached", "--others", "--exclude-standard").Output()
	require.NoError(t, err)
	modules := map[string]bool{}
	files := strings.Fields(string(list))
	for _, f := range files {
		if filepath.Base(f) == "go.mod" && filepath.Dir(f) != "." {
			modules[filepath.Dir(f)] = true
		}
	}
	for _, f := range files {
		inModule := false
		for d := filepath.Dir(f); d != "." && !inModule; d = filepath.Dir(d) {
			inModule = modules[d]
		}
		if inModule {
			continue
		}
		b, err := os.ReadFile(f)
		if os.IsNotExist(err) {
			continue // deleted in the working tree
		}
		require.NoError(t, err)
		require.NoError(t, os.MkdirAll(filepath.Join(dir, filepath.Dir(f)), 0o755))
		require.NoError(t, os.WriteFile(filepath.Join(dir, f), b, 0o644))
	}
}
