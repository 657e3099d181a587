package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/exactlyonce/idempotency"
	"github.com/exactlyonce/idempotency/internal/dburl"
	"github.com/exactlyonce/idempotency/internal/testdb"
)

// TestMain checks for leaked goroutines, like every test binary here.
func TestMain(m *testing.M) { os.Exit(testdb.RunWithLeakCheck(m)) }

// binary builds the command once per test binary.
func binary(t *testing.T) string {
	t.Helper()
	buildOnce.Do(func() {
		dir, err := os.MkdirTemp("", "idempotency-cmd")
		if err != nil {
			buildErr = err
			return
		}
		builtPath = filepath.Join(dir, "idempotency")
		if out, err := exec.Command("go", "build", "-o", builtPath, ".").CombinedOutput(); err != nil {
			buildErr = fmt.Errorf("go build: %v\n%s", err, out)
		}
	})
	require.NoError(t, buildErr, "build the command")
	return builtPath
}

var (
	buildOnce sync.Once
	builtPath string
	buildErr  error
)

// command runs the built command as a process.
func command(t *testing.T, env []string, stdin string, args ...string) (stdout, stderr string, code int) {
	t.Helper()
	cmd := exec.Command(binary(t), args...)
	cmd.Env = append(os.Environ(), env...)
	cmd.Stdin = strings.NewReader(stdin)
	var out, errOut bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errOut
	err := cmd.Run()
	code = 0
	if exit, ok := err.(*exec.ExitError); ok {
		code = exit.ExitCode()
	} else {
		require.NoError(t, err)
	}
	return out.String(), errOut.String(), code
}

func TestMigrateInspectForgetCleanup(t *testing.T) {
	t.Parallel()
	db := testdb.New(t, 2)
	url := db.URL()
	out, errOut, code := command(t, nil, "", "-database-url", url, "migrate")
	require.Zero(t, code, errOut)
	require.Equal(t, "migrations applied\n", out)

	ctx := context.Background()
	store, err := idempotency.NewStore(db.Pool)
	require.NoError(t, err)
	_, err = store.Execute(ctx, idempotency.Call{Scope: "tenant-1", Key: "k-1", Method: "/pay.v1.Pay/Charge"},
		func(context.Context, pgx.Tx) (proto.Message, error) { return wrapperspb.String("ch_1"), nil })
	require.NoError(t, err)
	_, err = store.Execute(ctx, idempotency.Call{Scope: "tenant-1", Key: "k-2", Method: "/pay.v1.Pay/Charge", TTL: time.Millisecond},
		func(context.Context, pgx.Tx) (proto.Message, error) {
			return nil, idempotency.Final(status.Error(codes.FailedPrecondition, "card declined"))
		})
	require.True(t, idempotency.IsFinal(err))

	// DATABASE_URL is read when -database-url is not given.
	out, errOut, code = command(t, []string{"DATABASE_URL=" + url}, "", "inspect", "tenant-1", "k-1")
	require.Zero(t, code, errOut)
	for _, want := range []string{`"scope": "tenant-1"`, `"key": "k-1"`, `"method": "/pay.v1.Pay/Charge"`, `"state": "succeeded"`,
		`"response_type": "google.protobuf.StringValue"`, `"response": "ch_1"`, `"expired": false`} {
		require.Contains(t, out, want)
	}
	out, _, code = command(t, []string{"DATABASE_URL=" + url}, "", "inspect", "tenant-1", "k-2")
	require.Zero(t, code)
	require.Contains(t, out, `"state": "failed"`)
	require.Contains(t, out, `"message": "card declined"`)

	out, errOut, code = command(t, nil, "", "-database-url", url, "forget", "tenant-1", "k-1")
	require.Zero(t, code, errOut)
	require.Contains(t, out, `forgot key "k-1"`)
	_, errOut, code = command(t, nil, "", "-database-url", url, "inspect", "tenant-1", "k-1")
	require.Equal(t, 1, code)
	require.Equal(t, "idempotency inspect: no record of this key in scope \"tenant-1\", nor in any other scope\n", errOut, "one prefix, the command's")
	_, errOut, code = command(t, nil, "", "-database-url", url, "forget", "tenant-1", "k-1")
	require.Equal(t, 1, code, errOut)

	time.Sleep(10 * time.Millisecond) // k-2 expires
	out, errOut, code = command(t, nil, "", "-database-url", url, "cleanup")
	require.Zero(t, code, errOut)
	require.Equal(t, "deleted 1 expired keys\n", out)
	require.Zero(t, db.Count(t, `SELECT count(*) FROM idempotency_keys`))
}

// Forget is refused while a call holds the key.
func TestForgetRefusesAKeyInProgress(t *testing.T) {
	t.Parallel()
	db := testdb.New(t, 4)
	ctx := context.Background()
	store, err := idempotency.NewStore(db.Pool)
	require.NoError(t, err)
	require.NoError(t, store.Migrate(ctx))
	holding, release := make(chan struct{}), make(chan struct{})
	var releaseOnce sync.Once
	t.Cleanup(func() { releaseOnce.Do(func() { close(release) }) })
	done := make(chan error, 1)
	go func() {
		_, err := store.Execute(ctx, idempotency.Call{Key: "busy", Method: "m"}, func(context.Context, pgx.Tx) (proto.Message, error) {
			close(holding)
			<-release
			return nil, nil
		})
		done <- err
	}()
	<-holding
	_, errOut, code := command(t, nil, "", "-database-url", db.URL(), "forget", "", "busy")
	require.Equal(t, 1, code)
	require.Contains(t, errOut, "still in progress")
	releaseOnce.Do(func() { close(release) })
	require.NoError(t, <-done)
	require.NoError(t, store.Forget(ctx, "", "busy", ""), "once the call is over")
}

// The printed SQL, applied with psql, makes a table a Store works with; the
// down SQL removes it again.
func TestPrintedSQLAppliedWithPsql(t *testing.T) {
	t.Parallel()
	if _, err := exec.LookPath("psql"); err != nil {
		t.Fatal("psql is needed to apply the printed SQL: apt-get install postgresql-client")
	}
	db := testdb.New(t, 2)
	psql := func(sql string) {
		t.Helper()
		cmd := exec.Command("psql", "-v", "ON_ERROR_STOP=1", "-q", testdb.URL())
		cmd.Env = append(os.Environ(), "PGOPTIONS=-c search_path="+db.Schema)
		cmd.Stdin = strings.NewReader(sql)
		out, err := cmd.CombinedOutput()
		require.NoError(t, err, string(out))
	}
	up, errOut, code := command(t, nil, "", "sql")
	require.Zero(t, code, errOut)
	psql(up)
	ctx := context.Background()
	store, err := idempotency.NewStore(db.Pool)
	require.NoError(t, err)
	res, err := store.Execute(ctx, idempotency.Call{Key: "k", Method: "m"}, func(context.Context, pgx.Tx) (proto.Message, error) {
		return wrapperspb.String("ok"), nil
	})
	require.NoError(t, err)
	require.Equal(t, idempotency.OutcomeExecuted, res.Outcome)
	res, err = store.Execute(ctx, idempotency.Call{Key: "k", Method: "m", Retry: true}, nil)
	require.NoError(t, err)
	require.Equal(t, idempotency.OutcomeReplayed, res.Outcome, "the table psql made is the table Migrate makes")

	down, _, code := command(t, nil, "", "sql", "-down")
	require.Zero(t, code)
	psql(down)
	require.Zero(t, db.Count(t, `SELECT count(*) FROM pg_tables WHERE schemaname = $1`, db.Schema), "down reverses up")
	psql(up) // and up again, on a clean schema
	require.Equal(t, 1, db.Count(t, `SELECT count(*) FROM pg_tables WHERE schemaname = $1`, db.Schema))
}

// The files for golang-migrate (and Atlas's golang-migrate format) and for
// goose, with the configured table.
func TestSQLFilesForMigrationTools(t *testing.T) {
	t.Parallel()
	dir := filepath.Join(t.TempDir(), "db", "migrations") // created, like a tool's output directory
	_, errOut, code := command(t, nil, "", "-schema", "app", "-table", "keys", "sql", "-format", "golang-migrate", "-dir", dir)
	require.Zero(t, code, errOut)
	names, err := filepath.Glob(filepath.Join(dir, "*"))
	require.NoError(t, err)
	var base []string
	for _, n := range names {
		base = append(base, filepath.Base(n))
	}
	require.Equal(t, []string{"001_create_keys.down.sql", "001_create_keys.up.sql", "002_add_metadata.down.sql", "002_add_metadata.up.sql",
		"003_namespace_keys.down.sql", "003_namespace_keys.up.sql", "004_claim_fillfactor.down.sql", "004_claim_fillfactor.up.sql"}, base)
	up, err := os.ReadFile(filepath.Join(dir, "001_create_keys.up.sql"))
	require.NoError(t, err)
	require.Contains(t, string(up), "THEN CREATE SCHEMA \"app\"; END IF;")
	require.Contains(t, string(up), "$create_schema$;\nCREATE TABLE IF NOT EXISTS \"app\".\"keys\"")

	out, _, code := command(t, nil, "", "sql", "-format", "goose")
	require.Zero(t, code)
	require.Contains(t, out, "-- file 001_create_keys.sql\n-- +goose Up\n")
	require.Contains(t, out, "-- +goose Down\n-- +goose StatementBegin\n")
	require.Contains(t, out, "DROP TABLE IF EXISTS \"idempotency_keys\";\n-- +goose StatementEnd\n")

	// -down has no meaning where each file holds both directions.
	for _, format := range []string{"goose", "golang-migrate"} {
		_, errOut, code := command(t, nil, "", "sql", "-format", format, "-down")
		require.Equal(t, 2, code, format)
		require.Contains(t, errOut, "-down applies to -format plain only", format)
	}
}

// A table in a schema of its own: migrate and the printed SQL create the
// schema when it is absent.
func TestSchemaOfTheTableIsCreated(t *testing.T) {
	t.Parallel()
	db := testdb.New(t, 2)
	for _, via := range []string{"migrate", "psql"} {
		schema := db.Schema + "_" + via
		t.Cleanup(func() {
			_, _ = db.Pool.Exec(context.Background(), "DROP SCHEMA IF EXISTS "+pgx.Identifier{schema}.Sanitize()+" CASCADE")
		})
		migrateVia(t, via, schema, nil)
		requireServes(t, db, schema, via)
	}
}

// A schema a DBA created for the application, and a role that owns it but
// may not create schemas in the database (as PostgreSQL's default for a
// role): migrate and the printed SQL succeed as that role.
func TestExistingSchemaNeedsNoRightToCreateSchemas(t *testing.T) {
	t.Parallel()
	db := testdb.New(t, 2)
	ctx := context.Background()
	role := db.Schema + "_app"
	_, err := db.Pool.Exec(ctx, "CREATE ROLE "+pgx.Identifier{role}.Sanitize()+" NOLOGIN")
	require.NoError(t, err)
	t.Cleanup(func() {
		_, _ = db.Pool.Exec(context.Background(), "DROP ROLE IF EXISTS "+pgx.Identifier{role}.Sanitize())
	})
	for _, via := range []string{"migrate", "psql"} {
		schema := db.Schema + "_owned_" + via
		_, err := db.Pool.Exec(ctx, "CREATE SCHEMA "+pgx.Identifier{schema}.Sanitize()+" AUTHORIZATION "+pgx.Identifier{role}.Sanitize())
		require.NoError(t, err)
		t.Cleanup(func() {
			_, _ = db.Pool.Exec(context.Background(), "DROP SCHEMA IF EXISTS "+pgx.Identifier{schema}.Sanitize()+" CASCADE")
		})
		// The session runs as the role, whatever the login.
		migrateVia(t, via, schema, []string{"PGOPTIONS=-c role=" + role})
		require.Equal(t, 1, db.Count(t, `SELECT count(*) FROM pg_tables WHERE schemaname = $1 AND tableowner = $2 AND tablename = $3`,
			schema, role, idempotency.DefaultTable), via)
		requireServes(t, db, schema, via)
	}
}

// migrateVia creates the key table in schema with the command's migrate,
// or with its printed SQL through psql, in the environment env.
func migrateVia(t *testing.T, via, schema string, env []string) {
	t.Helper()
	if via == "migrate" {
		_, errOut, code := command(t, env, "", "-database-url", testdb.URL(), "-schema", schema, "migrate")
		require.Zero(t, code, errOut)
		return
	}
	up, errOut, code := command(t, nil, "", "-schema", schema, "sql")
	require.Zero(t, code, errOut)
	cmd := exec.Command("psql", "-v", "ON_ERROR_STOP=1", "-q", testdb.URL())
	cmd.Env = append(os.Environ(), env...)
	cmd.Stdin = strings.NewReader(up)
	out, err := cmd.CombinedOutput()
	require.NoError(t, err, string(out))
}

// requireServes runs a call on the key table in schema.
func requireServes(t *testing.T, db *testdb.DB, schema, via string) {
	t.Helper()
	store, err := idempotency.NewStore(db.Pool, idempotency.WithTable(schema, idempotency.DefaultTable))
	require.NoError(t, err)
	res, err := store.Execute(context.Background(), idempotency.Call{Key: "k", Method: "m"}, func(context.Context, pgx.Tx) (proto.Message, error) {
		return wrapperspb.String("ok"), nil
	})
	require.NoError(t, err, via)
	require.Equal(t, idempotency.OutcomeExecuted, res.Outcome, via)
}

// The database defaults to the one every program here uses.
func TestDefaultDatabase(t *testing.T) {
	t.Parallel()
	_, errOut, code := command(t, []string{"DATABASE_URL="}, "", "-h")
	require.Zero(t, code)
	require.Contains(t, errOut, "else "+dburl.Redacted(dburl.Default))
}

// inspect shows an HTTP request's record as the response it replays:
// status, headers and body.
func TestInspectHTTPKey(t *testing.T) {
	t.Parallel()
	db := testdb.New(t, 2)
	ctx := context.Background()
	store, err := idempotency.NewStore(db.Pool)
	require.NoError(t, err)
	require.NoError(t, store.Migrate(ctx))
	h := idempotency.HTTPMiddleware(store, idempotency.WithHTTPScope(func(*http.Request) (string, error) { return "tenant-1", nil }),
		idempotency.WithHTTPReplayedHeaders("X-Checksum"))(
		http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			w.Header().Set("Content-Type", "application/json")
			w.Header().Set("Location", "/v1/charges/ch_1")
			w.Header().Set("Trailer", "X-Checksum")
			w.WriteHeader(http.StatusCreated)
			_, _ = io.WriteString(w, `{"id":"ch_1"}`)
			w.Header().Set("X-Checksum", "sum-1")
		}))
	req := httptest.NewRequest(http.MethodPost, "/v1/charges", strings.NewReader(`{"amount":100}`))
	req.Header.Set(idempotency.HeaderKey, "order-1")
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, req)
	require.Equal(t, http.StatusCreated, rec.Code)

	out, errOut, code := command(t, nil, "", "-database-url", db.URL(), "inspect", "tenant-1", "order-1")
	require.Zero(t, code, errOut)
	var got struct {
		Transport string `json:"transport"`
		HTTP      struct {
			Status  int                 `json:"status"`
			Header  map[string][]string `json:"header"`
			Trailer map[string][]string `json:"trailer"`
			Body    string              `json:"body"`
		} `json:"http"`
	}
	require.NoError(t, json.Unmarshal([]byte(out), &got), out)
	require.Equal(t, "http", got.Transport)
	require.Equal(t, http.StatusCreated, got.HTTP.Status)
	require.Equal(t, []string{"application/json"}, got.HTTP.Header["Content-Type"])
	require.Equal(t, []string{"/v1/charges/ch_1"}, got.HTTP.Header["Location"])
	require.Equal(t, map[string][]string{"X-Checksum": {"sum-1"}}, got.HTTP.Trailer)
	require.Equal(t, `{"id":"ch_1"}`, got.HTTP.Body)
}

// A missing table says how to create it.
func TestMissingTableSaysMigrate(t *testing.T) {
	t.Parallel()
	db := testdb.New(t, 1)
	for _, args := range [][]string{{"inspect", "s", "k"}, {"forget", "s", "k"}, {"cleanup"}} {
		_, errOut, code := command(t, nil, "", append([]string{"-database-url", db.URL()}, args...)...)
		require.Equal(t, 1, code, args)
		require.Contains(t, errOut, `the key table "idempotency_keys" does not exist`, args)
		require.Contains(t, errOut, "idempotency migrate, with the same -database-url, -schema and -table, creates the table", args)
		require.NotContains(t, errOut, "idempotency: ", "%v: one prefix", args)
	}
}
