package idempotency_test

import (
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"unicode"

	"github.com/stretchr/testify/require"
)

// The documentation is README.md and the files of docs/. Its code is checked
// here, its links too; the first-service walkthrough's blocks are run by
// TestFirstServiceWalkthrough instead.

// docFiles lists README.md and every Markdown file of docs/.
func docFiles(t *testing.T) []string {
	t.Helper()
	docs, err := filepath.Glob("docs/*.md")
	require.NoError(t, err)
	require.NotEmpty(t, docs)
	return append([]string{"README.md"}, docs...)
}

// readDoc returns a doc's text without the walkthrough's blocks.
func readDoc(t *testing.T, path string) string {
	t.Helper()
	b, err := os.ReadFile(path)
	require.NoError(t, err)
	return firstServiceBlock.ReplaceAllString(string(b), "")
}

var (
	codeBlock  = regexp.MustCompile("(?s)```(\\w*)\n(.*?)```")
	inlineCode = regexp.MustCompile("`[^`\n]*`")
	mdLink     = regexp.MustCompile(`\]\(([^)\s]+)\)`)
	heading    = regexp.MustCompile(`(?m)^#{1,6} +(.+?) *$`)
)

// The docs' Go and proto snippets must be copies of code that compiles: each
// block has to appear, line for line, in a .go or .proto file of the
// repository (an Example function, an example service, a test proto, a
// quickstart that a test runs).
func TestDocsSnippetsComeFromCompilingCode(t *testing.T) {
	t.Parallel()
	sources := map[string]string{} // normalized content by path
	err := filepath.WalkDir(".", func(path string, d os.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() && strings.HasPrefix(d.Name(), ".") && path != "." {
			return filepath.SkipDir
		}
		if ext := filepath.Ext(path); !d.IsDir() && (ext == ".go" || ext == ".proto") {
			b, err := os.ReadFile(path)
			if err != nil {
				return err
			}
			sources[path] = normalize(string(b))
		}
		return nil
	})
	require.NoError(t, err)

	blocks := 0
	for _, doc := range docFiles(t) {
		for _, b := range codeBlock.FindAllStringSubmatch(readDoc(t, doc), -1) {
			if b[1] != "go" && b[1] != "proto" {
				continue
			}
			blocks++
			want := normalize(b[2])
			found := false
			for path, src := range sources {
				if strings.HasSuffix(path, "."+b[1]) && strings.Contains(src, want) {
					found = true
					break
				}
			}
			require.True(t, found, "%s: a %s block is not a copy of any source file:\n%s", doc, b[1], b[2])
		}
	}
	require.Greater(t, blocks, 20, "the docs' snippets were found")
}

// Every relative link of the docs points at a file that exists, and a link
// to a heading (#anchor, or file.md#anchor) at a heading that exists. Every
// file of docs/ is linked from another doc, so none is out of reach.
func TestDocsLinksResolve(t *testing.T) {
	t.Parallel()
	linked := map[string]bool{}
	for _, doc := range docFiles(t) {
		prose := inlineCode.ReplaceAllString(codeBlock.ReplaceAllString(readDoc(t, doc), ""), "")
		for _, m := range mdLink.FindAllStringSubmatch(prose, -1) {
			link := m[1]
			if strings.Contains(link, "://") || strings.HasPrefix(link, "mailto:") {
				continue
			}
			path, anchor, _ := strings.Cut(link, "#")
			target := doc
			if path != "" {
				target = filepath.Join(filepath.Dir(doc), path)
				_, err := os.Stat(target)
				require.NoError(t, err, "%s links to %s", doc, link)
				if target != doc {
					linked[target] = true
				}
			}
			if anchor != "" {
				require.Contains(t, anchors(t, target), anchor, "%s links to %s: no such heading in %s", doc, link, target)
			}
		}
	}
	for _, doc := range docFiles(t)[1:] {
		require.True(t, linked[doc], "no doc links to %s", doc)
	}
}

// anchors returns the anchors GitHub gives the headings of a Markdown file:
// lower case, letters, digits, hyphens and underscores kept, spaces made
// hyphens, the rest dropped; a repeated one numbered from -1.
func anchors(t *testing.T, path string) []string {
	t.Helper()
	b, err := os.ReadFile(path)
	require.NoError(t, err)
	text := codeBlock.ReplaceAllString(string(b), "")
	seen := map[string]int{}
	var out []string
	for _, h := range heading.FindAllStringSubmatch(text, -1) {
		var s strings.Builder
		for _, r := range strings.ToLower(h[1]) {
			switch {
			case unicode.IsLetter(r), unicode.IsDigit(r), r == '-', r == '_':
				s.WriteRune(r)
			case r == ' ':
				s.WriteRune('-')
			}
		}
		a := s.String()
		if n := seen[a]; n > 0 {
			out = append(out, a+"-"+strconv.Itoa(n))
		} else {
			out = append(out, a)
		}
		seen[a]++
	}
	return out
}

// goRun matches a command that runs a package of this repository:
// "go run ./cmd/idempotency", "go -C examples/payments run ./demo".
var goRun = regexp.MustCompile(`\bgo (?:-C (\S+) )?(?:run|test|build) (?:-\S+ )*(\./\S*)`)

// The docs' shell commands name what exists: the packages they run, the
// scripts they start. CI runs the test command itself, from the block after
// the README's marker.
func TestDocsCommandsNameWhatExists(t *testing.T) {
	t.Parallel()
	for _, doc := range docFiles(t) {
		for _, b := range codeBlock.FindAllStringSubmatch(readDoc(t, doc), -1) {
			if b[1] != "sh" && b[1] != "console" {
				continue
			}
			for _, line := range strings.Split(b[2], "\n") {
				if b[1] == "console" {
					cmd, ok := strings.CutPrefix(line, "$ ")
					if !ok {
						continue
					}
					line = cmd
				}
				for _, m := range goRun.FindAllStringSubmatch(line, -1) {
					pkg := strings.TrimSuffix(filepath.Join(m[1], m[2]), "/...")
					_, err := os.Stat(pkg)
					require.NoError(t, err, "%s runs %q", doc, line)
				}
				for _, f := range strings.Fields(line) {
					if strings.HasPrefix(f, "scripts/") {
						_, err := os.Stat(f)
						require.NoError(t, err, "%s runs %q", doc, line)
					}
				}
			}
		}
	}
}

// The README is a front door: at most 300 lines, and its test command, the
// one CI runs, right after the marker.
func TestREADMEIsAFrontDoor(t *testing.T) {
	t.Parallel()
	b, err := os.ReadFile("README.md")
	require.NoError(t, err)
	require.LessOrEqual(t, strings.Count(string(b), "\n"), 300, "README.md lines; the rest belongs in docs/")
	require.Contains(t, string(b), "<!-- test-command -->\n```sh\nbash scripts/test.sh\n```")
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
