// Package schema holds the SQL migrations of the idempotency key table.
//
// The migrations are plain SQL files with two placeholders, {{table}} (the
// quoted, possibly schema-qualified table name) and {{expires_index}} (the
// quoted name of the expiry index), so that teams running their own migration
// tool can render and copy them.
package schema

import (
	"embed"
	"fmt"
	"io/fs"
	"path"
	"sort"
	"strconv"
	"strings"

	"github.com/jackc/pgx/v5"
)

//go:embed migrations/*.sql
var files embed.FS

// ExpiresIndexSuffix ends the name of the expiry index, after the table's.
const ExpiresIndexSuffix = "_expires_at_idx"

// Migration is one rendered schema change.
type Migration struct {
	// Version orders migrations; it is the number the file name starts with.
	Version int
	// Name is the file name without its extension, e.g. "001_create_keys".
	Name string
	// SQL is the statement text with the table names filled in.
	SQL string
}

// Render returns every migration, in version order, for the table named by
// ident (schema-qualified when it has two parts).
func Render(ident pgx.Identifier) ([]Migration, error) {
	entries, err := fs.ReadDir(files, "migrations")
	if err != nil {
		return nil, err
	}
	r := strings.NewReplacer(
		"{{table}}", ident.Sanitize(),
		"{{expires_index}}", pgx.Identifier{ident[len(ident)-1] + ExpiresIndexSuffix}.Sanitize(),
	)
	var out []Migration
	for _, e := range entries {
		name := strings.TrimSuffix(e.Name(), ".sql")
		prefix, _, _ := strings.Cut(name, "_")
		v, err := strconv.Atoi(prefix)
		if err != nil {
			return nil, fmt.Errorf("schema: migration %q does not start with a version number", e.Name())
		}
		b, err := files.ReadFile(path.Join("migrations", e.Name()))
		if err != nil {
			return nil, err
		}
		out = append(out, Migration{Version: v, Name: name, SQL: r.Replace(string(b))})
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Version < out[j].Version })
	return out, nil
}
