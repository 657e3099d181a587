package idempotency

import (
	"context"
	"fmt"
	"hash/fnv"

	"github.com/jackc/pgx/v5"

	"github.com/exactlyonce/idempotency/internal/schema"
)

// Suffixes of the names of the objects Migrate creates beside the key
// table: the table of applied versions and the expiry index.
const (
	migrationsSuffix   = "_migrations"
	expiresIndexSuffix = schema.ExpiresIndexSuffix
)

// Migration is one schema change of the key table, for teams that apply
// migrations with their own tool (goose, Atlas, golang-migrate, ...).
type Migration struct {
	// Version orders migrations; it is the number the name starts with.
	Version int
	// Name is the file name without its direction and extension, such as
	// "001_create_keys", as golang-migrate names its files.
	Name string
	// SQL applies the change, with the table's name filled in (and, for a
	// table in a schema, the schema created if absent).
	SQL string
	// Down reverts it.
	Down string
}

// Migrations returns the SQL that creates and evolves this store's table, in
// order, with the configured table name filled in. [Store.Migrate] applies
// exactly these.
func (s *Store) Migrations() ([]Migration, error) { return renderMigrations(s.ident) }

// MigrationsFor is [Store.Migrations] for a table named without a store,
// as [WithTable] names it (an empty schema leaves it to the search_path),
// for tools that render the SQL without a database.
func MigrationsFor(schemaName, table string) ([]Migration, error) {
	o, err := newStoreOptions([]StoreOption{WithTable(schemaName, table)})
	if err != nil {
		return nil, err
	}
	return renderMigrations(o.ident())
}

func renderMigrations(ident pgx.Identifier) ([]Migration, error) {
	rendered, err := schema.Render(ident)
	if err != nil {
		return nil, err
	}
	ms := make([]Migration, len(rendered))
	for i, m := range rendered {
		ms[i] = Migration{Version: m.Version, Name: m.Name, SQL: m.SQL, Down: m.Down}
	}
	return ms, nil
}

// Migrate brings the key table up to date. It records applied versions in a
// table named like the key table with a "_migrations" suffix and holds an
// advisory lock while it works, so replicas starting together are safe.
func (s *Store) Migrate(ctx context.Context) error {
	migrations, err := s.Migrations()
	if err != nil {
		return err
	}
	versions := append(pgx.Identifier{}, s.ident...)
	versions[len(versions)-1] += migrationsSuffix
	h := fnv.New64a()
	h.Write([]byte(s.ident.Sanitize()))

	conn, err := s.db.Acquire(ctx)
	if err != nil {
		return fmt.Errorf("idempotency: migrate: %w", err)
	}
	err = pgx.BeginTxFunc(ctx, conn, pgx.TxOptions{}, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, "SELECT pg_advisory_xact_lock($1)", int64(h.Sum64())); err != nil {
			return fmt.Errorf("idempotency: migrate: lock: %w", err)
		}
		if len(s.ident) == 2 { // the table of applied versions lives there too
			if _, err := tx.Exec(ctx, schema.CreateSchema(s.ident[0])); err != nil {
				return fmt.Errorf("idempotency: migrate: create schema %s: %w", s.ident[0], err)
			}
		}
		if _, err := tx.Exec(ctx, "CREATE TABLE IF NOT EXISTS "+versions.Sanitize()+
			" (version integer PRIMARY KEY, name text NOT NULL, applied_at timestamptz NOT NULL DEFAULT now())"); err != nil {
			return fmt.Errorf("idempotency: migrate: %w", err)
		}
		for _, m := range migrations {
			tag, err := tx.Exec(ctx, "INSERT INTO "+versions.Sanitize()+" (version, name) VALUES ($1, $2) ON CONFLICT DO NOTHING", m.Version, m.Name)
			if err != nil {
				return fmt.Errorf("idempotency: migrate %s: %w", m.Name, err)
			}
			if tag.RowsAffected() == 0 {
				continue // already applied
			}
			if _, err := tx.Exec(ctx, m.SQL); err != nil {
				return fmt.Errorf("idempotency: migrate %s: %w", m.Name, err)
			}
		}
		return nil
	})
	conn.Release() // before the statement below borrows one: the pool may hold one alone
	if err != nil {
		return err
	}
	s.forgetTable() // it may have been created just now
	if _, err := s.statements(ctx); err != nil {
		return fmt.Errorf("idempotency: migrate: find the key table: %w", err)
	}
	return nil
}
