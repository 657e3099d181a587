// Package testdb gives each test its own schema in a real PostgreSQL.
//
// The database is named by the DATABASE_URL environment variable and
// defaults to the local server that scripts/services.sh starts (see package
// dburl). A database that cannot be reached fails the test with
// instructions; it is never skipped.
package testdb

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"log"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/exactlyonce/idempotency/internal/dburl"
	"github.com/exactlyonce/idempotency/internal/leakcheck"
)

// EnvVar names the environment variable holding the database URL.
const EnvVar = dburl.EnvVar

// URL returns the database URL the tests use: $DATABASE_URL, else the
// local test database.
func URL() string { return dburl.URL() }

var (
	adminOnce sync.Once
	admin     *pgxpool.Pool
	adminErr  error
)

// Admin returns a pool on the test database with the default search_path,
// shared by the whole test binary, for setup and fault injection.
func Admin(t testing.TB) *pgxpool.Pool {
	t.Helper()
	adminOnce.Do(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		admin, adminErr = pgxpool.New(ctx, URL())
		if adminErr == nil {
			adminErr = admin.Ping(ctx)
		}
	})
	if adminErr != nil {
		t.Fatalf("no PostgreSQL at %s (set %s to point the tests at one; `bash scripts/services.sh`, from the repository's root, starts the local one): %v", dburl.Redacted(URL()), EnvVar, adminErr)
	}
	return admin
}

// Close closes the pool of Admin, if it was opened. A TestMain calls it after
// the tests so that a goroutine leak check sees only what the tests left.
func Close() {
	if admin != nil {
		admin.Close()
	}
}

// RunWithLeakCheck runs a test binary's tests, closes the shared admin pool,
// and fails the binary if any goroutine outlived the tests: every server,
// pool, cleaner and client a test starts must be stopped by it. Use it as
// os.Exit(testdb.RunWithLeakCheck(m)) in TestMain.
func RunWithLeakCheck(m *testing.M) int { return leakcheck.Run(m, Close) }

// DB is one test's isolated database: a fresh schema and a pool whose
// search_path is that schema, so unqualified table names stay private.
type DB struct {
	Pool   *pgxpool.Pool
	Schema string
}

// New creates a schema for t and a pool bound to it; both are removed when t
// ends. maxConns sizes the pool (0 means 8).
func New(t testing.TB, maxConns int32) *DB {
	t.Helper()
	return NewConfigured(t, func(cfg *pgxpool.Config) {
		if maxConns > 0 {
			cfg.MaxConns = maxConns
		}
	})
}

// NewConfigured is New with a hook to adjust the pool's configuration (a
// tracer, sizes) before the pool is made. MaxConns defaults to 8.
func NewConfigured(t testing.TB, configure func(*pgxpool.Config)) *DB {
	t.Helper()
	a := Admin(t)
	ctx := context.Background()
	var b [6]byte
	_, _ = rand.Read(b[:])
	schema := "t_" + hex.EncodeToString(b[:])
	if _, err := a.Exec(ctx, "CREATE SCHEMA "+pgx.Identifier{schema}.Sanitize()); err != nil {
		t.Fatalf("create schema: %v", err)
	}
	cfg, err := pgxpool.ParseConfig(URL())
	if err != nil {
		t.Fatalf("parse %s: %v", EnvVar, err)
	}
	cfg.ConnConfig.RuntimeParams["search_path"] = schema
	cfg.MaxConns = 8
	if configure != nil {
		configure(cfg)
	}
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatalf("pool: %v", err)
	}
	t.Cleanup(func() {
		pool.Close()
		if _, err := a.Exec(context.Background(), "DROP SCHEMA "+pgx.Identifier{schema}.Sanitize()+" CASCADE"); err != nil {
			t.Errorf("drop schema %s: %v", schema, err)
		}
	})
	return &DB{Pool: pool, Schema: schema}
}

// OpenPool opens another pool on db's schema, for a second service of the
// same test (its own connections, as in production); it is closed when t
// ends, before the schema is dropped.
func (db *DB) OpenPool(t testing.TB, maxConns int32) *pgxpool.Pool {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(db.URL())
	if err != nil {
		t.Fatalf("parse %s: %v", EnvVar, err)
	}
	cfg.MaxConns = maxConns
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatalf("pool: %v", err)
	}
	t.Cleanup(pool.Close)
	return pool
}

// URL is the test database's URL with db's schema as its search_path, for
// a process of the test's own.
func (db *DB) URL() string {
	sep := "?"
	if strings.Contains(URL(), "?") {
		sep = "&"
	}
	return URL() + sep + "search_path=" + db.Schema
}

// Count returns the result of a count(*) query.
func (db *DB) Count(t testing.TB, sql string, args ...any) int {
	t.Helper()
	var n int
	if err := db.Pool.QueryRow(context.Background(), sql, args...).Scan(&n); err != nil {
		t.Fatalf("%s: %v", sql, err)
	}
	return n
}

// PgBouncerEnvVar names the environment variable holding the URL of a
// PgBouncer in transaction pooling mode in front of the test database.
const PgBouncerEnvVar = "PGBOUNCER_URL"

// PgBouncerURL returns $PGBOUNCER_URL, else the URL of the PgBouncer that
// scripts/services.sh started for this checkout (it writes it to
// .services/pgbouncer.url), else "" and how to get one.
func PgBouncerURL() (url, hint string) {
	if u := os.Getenv(PgBouncerEnvVar); u != "" {
		return u, ""
	}
	_, file, _, _ := runtime.Caller(0)
	path := filepath.Join(filepath.Dir(file), "..", "..", ".services", "pgbouncer.url")
	if b, err := os.ReadFile(path); err == nil {
		return strings.TrimSpace(string(b)), ""
	}
	return "", fmt.Sprintf("no PgBouncer: set %s, or run `bash scripts/services.sh` at the repository's root, which starts one for this checkout and writes its URL to %s",
		PgBouncerEnvVar, path)
}

// ForExample is a pool on a schema of its own in the test database, for
// an Example function, which has no testing.T: failures are fatal, and
// done closes the pool and drops the schema.
func ForExample(ctx context.Context) (pool *pgxpool.Pool, done func()) {
	admin, err := pgxpool.New(ctx, URL())
	if err != nil {
		log.Fatal(err)
	}
	var b [6]byte
	_, _ = rand.Read(b[:])
	schema := pgx.Identifier{"example_" + hex.EncodeToString(b[:])}
	if _, err := admin.Exec(ctx, "CREATE SCHEMA "+schema.Sanitize()); err != nil {
		log.Fatal(err)
	}
	cfg, err := pgxpool.ParseConfig(URL())
	if err != nil {
		log.Fatal(err)
	}
	cfg.ConnConfig.RuntimeParams["search_path"] = schema[0]
	cfg.MaxConns = 4
	if pool, err = pgxpool.NewWithConfig(ctx, cfg); err != nil {
		log.Fatal(err)
	}
	return pool, func() {
		pool.Close()
		_, _ = admin.Exec(context.Background(), "DROP SCHEMA "+schema.Sanitize()+" CASCADE")
		admin.Close()
	}
}
