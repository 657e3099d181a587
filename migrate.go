package idempotency

import (
	"context"
	"errors"
	"fmt"
	"hash/fnv"
	"math/rand/v2"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/exactlyonce/idempotency/internal/schema"
)

// Suffixes of the names of the objects Migrate creates beside the key
// table: the table of applied versions and the expiry index.
const (
	migrationsSuffix   = "_migrations"
	expiresIndexSuffix = schema.ExpiresIndexSuffix
)

// migrationBatchRows is how many rows each transaction of a migration that
// rewrites rows (003) looks at: its row locks are held for milliseconds.
const migrationBatchRows = 1000

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

// Migrations returns the SQL that creates and evolves the key table named
// as [WithTable] names it (an empty schema leaves it to the search_path;
// the store's default table is [DefaultTable]), in order, for a migration
// tool that runs each in a transaction of its own: goose, Atlas,
// golang-migrate. [Store.Migrate] makes the same changes, but moves the
// rows of 003 in batches of their own transactions rather than with its
// single UPDATE. It needs no database.
func Migrations(schemaName, table string) ([]Migration, error) {
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

// MigrateOption configures [Store.Migrate]. An invalid value makes Migrate
// return an error naming the option.
type MigrateOption func(*migrateOptions)

type migrateOptions struct {
	lockTimeout time.Duration
	attempts    int
}

func defaultMigrateOptions() migrateOptions {
	return migrateOptions{lockTimeout: time.Second, attempts: 10}
}

func (o migrateOptions) validate() error {
	switch {
	case o.lockTimeout < time.Millisecond:
		return fmt.Errorf("idempotency: WithMigrationLockTimeout: %v is under PostgreSQL's 1ms resolution", o.lockTimeout)
	case o.attempts < 1:
		return fmt.Errorf("idempotency: WithMigrationAttempts: %d; at least 1", o.attempts)
	}
	return nil
}

// WithMigrationLockTimeout is how long each attempt of a migration waits
// for a lock it needs (PostgreSQL's lock_timeout, set for the migration's
// transaction alone) before giving up its place in the queue and trying
// again later. Defaults to 1 second.
//
// While a migration waits for a strong lock (002 adds a column: ACCESS
// EXCLUSIVE), every call that touches the key table waits behind it, up to
// this long. Longer makes those waits longer; shorter than your calls'
// longest transactions, and under steady traffic the lock may never be
// granted (see [WithMigrationAttempts]).
func WithMigrationLockTimeout(d time.Duration) MigrateOption {
	return func(o *migrateOptions) { o.lockTimeout = d }
}

// WithMigrationAttempts is how many times Migrate tries each step whose
// lock was not granted in time, or that met a conflicting write, before it
// gives up with an error that names the sessions holding the lock.
// Between attempts it waits, from 100 ms doubling to 5 s, with jitter, so
// 10 attempts of 1 s wait about half a minute in all: more make a
// replica's startup wait longer for a transaction that may never end.
// Defaults to 10.
func WithMigrationAttempts(n int) MigrateOption {
	return func(o *migrateOptions) { o.attempts = n }
}

// Migrate brings the key table up to date, creating it (and its schema,
// when [WithTable] names one that is absent) if needed, and records
// applied versions in a table named like the key table with a
// "_migrations" suffix, beside it. Run it at startup on every replica:
// when nothing is pending it only reads that table, and takes no lock.
//
// Each pending migration runs in a transaction of its own that gives up
// waiting for a lock after [WithMigrationLockTimeout] and is tried again
// later ([WithMigrationAttempts]), so that an open transaction that read
// the table never makes calls queue behind Migrate for longer than that.
// The rows older versions wrote are moved (003) in short transactions of
// 1,000 rows each, while calls go on; a Migrate cut short (a crash, a
// canceled ctx) is simply run again. Every transaction holds
// an advisory lock of the table, so replicas that start together take
// turns. The table is named as PostgreSQL resolves it, so stores that name
// it with its schema and through the search_path share that lock; an
// unqualified name is the table the search_path finds, else one created
// in current_schema().
func (s *Store) Migrate(ctx context.Context, opts ...MigrateOption) error {
	o := defaultMigrateOptions()
	for _, opt := range opts {
		opt(&o)
	}
	if err := o.validate(); err != nil {
		return err
	}
	conn, err := s.db.Acquire(ctx)
	if err != nil {
		return fmt.Errorf("idempotency: migrate: %w", err)
	}
	err = s.migrate(ctx, conn.Conn(), o)
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

// migrator applies the migrations of one resolved table on one connection.
type migrator struct {
	conn *pgx.Conn
	opts migrateOptions
	// table and versions are schema-qualified.
	table, versions pgx.Identifier
	// lock is the advisory lock of the table's migrations.
	lock int64
}

func (s *Store) migrate(ctx context.Context, conn *pgx.Conn, o migrateOptions) error {
	table, err := resolveTable(ctx, conn, s.ident)
	if err != nil {
		return err
	}
	m := &migrator{conn: conn, opts: o, table: table, versions: pgx.Identifier{table[0], table[1] + migrationsSuffix}}
	h := fnv.New64a()
	h.Write([]byte(table.Sanitize()))
	m.lock = int64(h.Sum64())

	migrations, err := schema.Render(table)
	if err != nil {
		return err
	}
	applied, err := m.applied(ctx)
	if err != nil {
		return err
	}
	var pending []schema.Migration
	for _, mg := range migrations {
		if !applied[mg.Version] {
			pending = append(pending, mg)
		}
	}
	if len(pending) == 0 {
		return nil
	}
	if err := m.step(ctx, "create the table of versions", func(tx pgx.Tx) error {
		if len(s.ident) == 2 { // only a schema the store names may be absent
			if _, err := tx.Exec(ctx, schema.CreateSchema(table[0])); err != nil {
				return fmt.Errorf("create schema %s: %w", table[0], err)
			}
		}
		_, err := tx.Exec(ctx, "CREATE TABLE IF NOT EXISTS "+m.versions.Sanitize()+
			" (version integer PRIMARY KEY, name text NOT NULL, applied_at timestamptz NOT NULL DEFAULT now())")
		return err
	}); err != nil {
		return err
	}
	for _, mg := range pending {
		if mg.Batch != "" {
			err = m.applyInBatches(ctx, mg)
		} else {
			err = m.apply(ctx, mg)
		}
		if err != nil {
			return err
		}
	}
	return nil
}

// resolveTable names the table ident refers to with its schema: the one
// given, else the schema where the search_path finds the table, else
// current_schema(), where CREATE TABLE would put it.
func resolveTable(ctx context.Context, conn *pgx.Conn, ident pgx.Identifier) (pgx.Identifier, error) {
	if len(ident) == 2 {
		return ident, nil
	}
	var found, current *string
	// In the simple protocol, like Store.statements: it works behind any
	// pooler, whatever the pool's query mode.
	err := conn.QueryRow(ctx, `SELECT (SELECT n.nspname FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
WHERE c.oid = pg_catalog.to_regclass($1)), pg_catalog.current_schema()`, pgx.QueryExecModeSimpleProtocol, ident.Sanitize()).Scan(&found, &current)
	switch {
	case err != nil:
		return nil, fmt.Errorf("idempotency: migrate: find the key table: %w", err)
	case found != nil:
		return pgx.Identifier{*found, ident[0]}, nil
	case current != nil:
		return pgx.Identifier{*current, ident[0]}, nil
	}
	return nil, fmt.Errorf("idempotency: migrate: the key table %s would be created in the first schema of the search_path, and none of its schemas exists: "+
		"set search_path, or name the schema with WithTable", ident.Sanitize())
}

// applied returns the versions recorded as applied, none when the table
// of versions does not exist yet. It takes no lock that anything waits for.
func (m *migrator) applied(ctx context.Context) (map[int]bool, error) {
	var exists bool
	if err := m.conn.QueryRow(ctx, `SELECT pg_catalog.to_regclass($1) IS NOT NULL`, pgx.QueryExecModeSimpleProtocol, m.versions.Sanitize()).Scan(&exists); err != nil {
		return nil, fmt.Errorf("idempotency: migrate: %w", err)
	}
	applied := map[int]bool{}
	if !exists {
		return applied, nil
	}
	rows, err := m.conn.Query(ctx, "SELECT version FROM "+m.versions.Sanitize(), pgx.QueryExecModeSimpleProtocol)
	if err != nil {
		return nil, fmt.Errorf("idempotency: migrate: %w", err)
	}
	versions, err := pgx.CollectRows(rows, pgx.RowTo[int32])
	if err != nil {
		return nil, fmt.Errorf("idempotency: migrate: %w", err)
	}
	for _, v := range versions {
		applied[int(v)] = true
	}
	return applied, nil
}

// label starts every statement of a migration, so that pg_stat_activity
// and the server's log say which one waits or runs.
func label(name string) string { return "/* idempotency migration " + name + " */\n" }

// apply runs a migration and records it, in one transaction, unless a
// replica applied it meanwhile.
func (m *migrator) apply(ctx context.Context, mg schema.Migration) error {
	return m.step(ctx, mg.Name, func(tx pgx.Tx) error {
		recorded, err := m.record(ctx, tx, mg)
		if err != nil || !recorded {
			return err
		}
		_, err = tx.Exec(ctx, label(mg.Name)+mg.SQL)
		return err
	})
}

// record inserts mg's row of versions, and says whether it was not there.
// Its primary key keeps two migrators from both applying mg, even one that
// does not take the same advisory lock (an older version's).
func (m *migrator) record(ctx context.Context, tx pgx.Tx, mg schema.Migration) (bool, error) {
	tag, err := tx.Exec(ctx, "INSERT INTO "+m.versions.Sanitize()+" (version, name) VALUES ($1::int, $2::text) ON CONFLICT DO NOTHING",
		pgx.QueryExecModeExec, mg.Version, mg.Name)
	return tag.RowsAffected() == 1, err
}

// applyInBatches runs a migration that rewrites rows one batch per
// transaction, walking the table in primary-key order, and records it once
// the walk is over. Nothing else is held between batches: calls go on,
// and a walk cut short is started over by the next Migrate (a batch never
// changes a row it changed before).
func (m *migrator) applyInBatches(ctx context.Context, mg schema.Migration) error {
	done := false
	if err := m.step(ctx, mg.Name, func(tx pgx.Tx) error {
		return tx.QueryRow(ctx, "SELECT EXISTS (SELECT FROM "+m.versions.Sanitize()+" WHERE version = $1::int)", pgx.QueryExecModeExec, mg.Version).Scan(&done)
	}); err != nil || done {
		return err
	}
	batch := label(mg.Name+" (batch)") + mg.Batch
	var scope, key string // before every row: keys are never empty
	for !done {
		if err := m.step(ctx, mg.Name, func(tx pgx.Tx) error {
			var lastScope, lastKey string
			err := tx.QueryRow(ctx, batch, pgx.QueryExecModeExec, scope, key, migrationBatchRows).Scan(&lastScope, &lastKey)
			if errors.Is(err, pgx.ErrNoRows) {
				done = true
				return nil
			}
			if err != nil {
				return err
			}
			scope, key = lastScope, lastKey // once the batch commits
			return nil
		}); err != nil {
			return err
		}
	}
	return m.step(ctx, mg.Name, func(tx pgx.Tx) error {
		_, err := m.record(ctx, tx, mg)
		return err
	})
}

// step runs f in a transaction of its own, at READ COMMITTED, that holds
// the table's advisory lock and waits for any other lock at most the lock
// timeout. A lock not granted in time, a deadlock, a serialization failure
// or a unique violation (a concurrent writer of the key a batch moves a
// row to) rolls it back, and it is tried again after a backoff, up to the
// attempts. The advisory lock is taken first, without the timeout: what
// it waits for is another replica's step, itself bounded.
func (m *migrator) step(ctx context.Context, name string, f func(pgx.Tx) error) error {
	setTimeout := fmt.Sprintf("SET LOCAL lock_timeout = %d", m.opts.lockTimeout.Milliseconds())
	for attempt := 1; ; attempt++ {
		err := pgx.BeginTxFunc(ctx, m.conn, pgx.TxOptions{IsoLevel: pgx.ReadCommitted}, func(tx pgx.Tx) error {
			if _, err := tx.Exec(ctx, "SELECT pg_catalog.pg_advisory_xact_lock($1::bigint)", pgx.QueryExecModeExec, m.lock); err != nil {
				return err
			}
			if _, err := tx.Exec(ctx, setTimeout); err != nil {
				return err
			}
			return f(tx)
		})
		if err == nil {
			return nil
		}
		code := sqlState(err)
		if !retryableMigrationError(code) || ctx.Err() != nil {
			return fmt.Errorf("idempotency: migrate %s: %w", name, err)
		}
		if attempt >= m.opts.attempts {
			return m.gaveUp(ctx, name, attempt, code, err)
		}
		wait := min(100*time.Millisecond<<min(attempt-1, 6), 5*time.Second)
		wait = wait/2 + rand.N(wait/2+1)
		t := time.NewTimer(wait)
		select {
		case <-ctx.Done():
			t.Stop()
			return fmt.Errorf("idempotency: migrate %s: %w (after: %w)", name, ctx.Err(), err)
		case <-t.C:
		}
	}
}

// retryableMigrationError: the lock timeout, a deadlock, a serialization
// failure and a unique violation.
func retryableMigrationError(code string) bool {
	switch code {
	case sqlLockNotAvailable, sqlDeadlockDetected, sqlSerializationFailure, sqlUniqueViolation:
		return true
	}
	return false
}

// gaveUp is the error of a step tried attempts times: for a lock, which
// sessions hold locks on the table, the oldest transactions first, and
// what to do.
func (m *migrator) gaveUp(ctx context.Context, name string, attempts int, code string, err error) error {
	if code != sqlLockNotAvailable && code != sqlDeadlockDetected {
		return fmt.Errorf("idempotency: migrate %s: %d attempts failed on writes of other sessions; run Migrate again: %w", name, attempts, err)
	}
	return fmt.Errorf("idempotency: migrate %s: a lock it needs on %s was not granted within the lock timeout (%v) in %d attempts%s; "+
		"end those transactions or wait for them to end (pg_terminate_backend(pid) ends one), then run Migrate again, "+
		"or let it wait longer with WithMigrationLockTimeout and WithMigrationAttempts: %w",
		name, m.table.Sanitize(), m.opts.lockTimeout, attempts, m.lockHolders(ctx), err)
}

// lockHolders describes the other sessions holding locks on the table,
// those whose transactions began first, at most three; "" if none or if
// they cannot be read.
func (m *migrator) lockHolders(ctx context.Context) string {
	rows, err := m.conn.Query(ctx, `SELECT l.pid, l.mode, COALESCE(a.state, ''), COALESCE(extract(epoch FROM pg_catalog.now() - a.xact_start)::int, 0),
COALESCE(pg_catalog.left(a.query, 200), '')
FROM pg_catalog.pg_locks l LEFT JOIN pg_catalog.pg_stat_activity a ON a.pid = l.pid
WHERE l.locktype = 'relation' AND l.granted AND l.pid <> pg_catalog.pg_backend_pid()
AND l.database = (SELECT oid FROM pg_catalog.pg_database WHERE datname = pg_catalog.current_database())
AND l.relation = pg_catalog.to_regclass($1)
ORDER BY a.xact_start NULLS LAST LIMIT 3`, pgx.QueryExecModeSimpleProtocol, m.table.Sanitize())
	if err != nil {
		return ""
	}
	var holders []string
	for rows.Next() {
		var pid, seconds int32
		var mode, state, query string
		if rows.Scan(&pid, &mode, &state, &seconds, &query) != nil {
			return ""
		}
		holders = append(holders, fmt.Sprintf("pid %d (%s, %s, its transaction open %ds, last statement %q)", pid, mode, state, seconds, query))
	}
	if rows.Err() != nil || len(holders) == 0 {
		return ""
	}
	return "; sessions holding locks on it: " + strings.Join(holders, ", ")
}
