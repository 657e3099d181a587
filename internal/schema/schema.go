// Package schema holds the SQL migrations of the idempotency key table.
//
// The migrations are plain SQL files, up and down, with three placeholders:
// {{table}} (the quoted, possibly schema-qualified table name),
// {{expires_index}} (the quoted name of the expiry index) and
// {{create_schema}} (a statement creating the schema of a
// schema-qualified table unless it exists, empty otherwise), so that teams running their own
// migration tool can render and copy them.
//
// Adding a migration is adding its files, NNN_name.up.sql and
// NNN_name.down.sql, numbered after the last: Render finds them, and
// Store.Migrate applies each pending one in a transaction of its own, under
// a short lock_timeout, trying again later when a lock is not granted in
// time (calls queued behind its lock request wait at most that long). So
// write statements that, once granted their lock, are quick: ADD COLUMN
// without a volatile default, SET of a storage parameter. CREATE INDEX
// holds a SHARE lock for its whole build, which blocks calls' writes while
// it runs (CREATE INDEX CONCURRENTLY cannot run in the transaction): a
// moment on a small table, a stall on a large one. A migration that
// rewrites rows also gets NNN_name.batch.sql: one statement that does the
// up file's work to the $3 rows after ($1 scope, $2 key) in primary-key
// order and returns the last of them (no row when none is left), so that
// Migrate runs it in short transactions that lock the table no more than
// a call does, instead of the up file; it must be safe to run again on
// rows it already changed, and the up file, which tools run, stays the
// reference. Batch files are for Store.Migrate alone: they are not
// exported.
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
	// Batch, when the migration rewrites rows, is the statement that does
	// SQL's work one batch at a time (see the package's doc); empty
	// otherwise.
	Batch string
}

// Render returns every migration, in version order, for the table named by
// ident (schema-qualified when it has two parts). The files are named as
// golang-migrate names them: NNN_name.up.sql and NNN_name.down.sql, and
// NNN_name.batch.sql beside them for a migration that rewrites rows.
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
		if !ok || (dir != "up" && dir != "down" && dir != "batch") {
			return nil, fmt.Errorf("schema: migration %q is not named NNN_name.up.sql, NNN_name.down.sql or NNN_name.batch.sql", e.Name())
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
		switch dir {
		case "up":
			m.SQL = r.Replace(string(b))
		case "down":
			m.Down = r.Replace(string(b))
		default:
			m.Batch = r.Replace(string(b))
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
	for i := 1; i < len(out); i++ {
		if out[i].Version == out[i-1].Version {
			return nil, fmt.Errorf("schema: migrations %s and %s have one version number", out[i-1].Name, out[i].Name)
		}
	}
	return out, nil
}
