package idempotency_test

import (
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// The README's Go and proto snippets must be copies of code that compiles
// (but the first-service walkthrough's, which its own test runs):
// each block has to appear, line for line, in a .go or .proto file of the
// repository (an Example function, an example service, a test proto). Its
// relative links must point at files that exist.
func TestREADMESnippetsComeFromCompilingCode(t *testing.T) {
	t.Parallel()
	readme, err := os.ReadFile("README.md")
	require.NoError(t, err)

	sources := map[string]string{} // normalized content by path, per language
	err = filepath.WalkDir(".", func(path string, d os.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return err
		}
		if ext := filepath.Ext(path); ext == ".go" || ext == ".proto" {
			b, err := os.ReadFile(path)
			if err != nil {
				return err
			}
			sources[path] = normalize(string(b))
		}
		return nil
	})
	require.NoError(t, err)

	// The walkthrough's files are compiled and run by
	// TestFirstServiceWalkthrough, not looked up here.
	rest := firstServiceBlock.ReplaceAllString(string(readme), "")
	blocks := regexp.MustCompile("(?s)```(go|proto)\n(.*?)```").FindAllStringSubmatch(rest, -1)
	require.NotEmpty(t, blocks)
	for _, b := range blocks {
		want := normalize(b[2])
		found := false
		for path, src := range sources {
			if strings.HasSuffix(path, "."+b[1]) && strings.Contains(src, want) {
				found = true
				break
			}
		}
		require.True(t, found, "README %s block is not a copy of any source file:\n%s", b[1], b[2])
	}

	prose := regexp.MustCompile("(?s)```.*?```").ReplaceAllString(string(readme), "") // code is not links
	for _, link := range regexp.MustCompile(`\]\(([^)#:]+)\)`).FindAllStringSubmatch(prose, -1) {
		_, err := os.Stat(link[1])
		require.NoError(t, err, "README links to %s", link[1])
	}
}

// normalize trims every line and drops empty ones, so indentation does not
// matter when comparing a snippet with its source; the surrounding newlines
// make a match start and end on whole lines.
func normalize(s string) string {
	var out []string
	for _, l := range strings.Split(s, "\n") {
		if l = strings.TrimSpace(l); l != "" {
			out = append(out, l)
		}
	}
	return "\n" + strings.Join(out, "\n") + "\n"
}
