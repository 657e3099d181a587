// Package schema holds the SQL migrations of the idempotency key table.
//
// The migrations are plain SQL files, up and down, with three placeholders:
// {{table}} (the quoted, possibly schema-qualified table name),
// {{expires_index}} (the quoted name of the expiry index) and
// {{create_schema}} (a statement creating the schema of a
// schema-qualified table unless it exists, empty otherwise), so that teams running their own
// migration tool can render and copy them.
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

// CreateSchema is a statement that creates the schema name unless it
// exists. It is not CREATE SCHEMA IF NOT EXISTS: PostgreSQL checks the
// database's CREATE privilege before it looks for the schema, which fails a
// role given an existing schema and no right to create one. Two of them at
// once, for two tables of one new schema, both succeed.
func CreateSchema(name string) string {
	body := "BEGIN IF NOT EXISTS (SELECT FROM pg_catalog.pg_namespace WHERE nspname = " + QuoteLiteral(name) + ") THEN CREATE SCHEMA " +
		pgx.Identifier{name}.Sanitize() + "; END IF; EXCEPTION WHEN duplicate_schema OR unique_violation THEN NULL; END"
	tag := "$create_schema$"
	for i := 0; strings.Contains(body, tag); i++ {
		tag = "$create_schema" + strconv.Itoa(i) + "$"
	}
	return "DO " + tag + " " + body + " " + tag
}

// QuoteLiteral quotes s as an SQL string literal that means the same
// whatever standard_conforming_strings says.
func QuoteLiteral(s string) string {
	return "E'" + strings.NewReplacer(`\`, `\\`, "'", "''").Replace(s) + "'"
}

// Migration is one rendered schema change.
type Migration struct {
	// Version orders migrations; it is the number the file name starts with.
	Version int
	// Name is the file name without its direction and extension, e.g.
	// "001_create_keys".
	Name string
	// SQL applies the change, with the table names filled in.
	SQL string
	// Down reverts it.
	Down string
}

// Render returns every migration, in version order, for the table named by
// ident (schema-qualified when it has two parts). The files are named as
// golang-migrate names them: NNN_name.up.sql and NNN_name.down.sql.
func Render(ident pgx.Identifier) ([]Migration, error) {
	entries, err := fs.ReadDir(files, "migrations")
	if err != nil {
		return nil, err
	}
	createSchema := ""
	if len(ident) == 2 {
		createSchema = CreateSchema(ident[0]) + ";\n"
	}
	r := strings.NewReplacer(
		"{{table}}", ident.Sanitize(),
		"{{expires_index}}", pgx.Identifier{ident[len(ident)-1] + ExpiresIndexSuffix}.Sanitize(),
		"{{create_schema}}", createSchema,
	)
	byName := map[string]*Migration{}
	for _, e := range entries {
		name, dir, ok := strings.Cut(strings.TrimSuffix(e.Name(), ".sql"), ".")
		if !ok || (dir != "up" && dir != "down") {
			return nil, fmt.Errorf("schema: migration %q is not named NNN_name.up.sql or NNN_name.down.sql", e.Name())
		}
		prefix, _, _ := strings.Cut(name, "_")
		v, err := strconv.Atoi(prefix)
		if err != nil {
			return nil, fmt.Errorf("schema: migration %q does not start with a version number", e.Name())
		}
		b, err := files.ReadFile(path.Join("migrations", e.Name()))
		if err != nil {
			return nil, err
		}
		m := byName[name]
		if m == nil {
			m = &Migration{Version: v, Name: name}
			byName[name] = m
		}
		if dir == "up" {
			m.SQL = r.Replace(string(b))
		} else {
			m.Down = r.Replace(string(b))
		}
	}
	var out []Migration
	for _, m := range byName {
		if m.SQL == "" || m.Down == "" {
			return nil, fmt.Errorf("schema: migration %s needs both an up and a down file", m.Name)
		}
		out = append(out, *m)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Version < out[j].Version })
	return out, nil
}
