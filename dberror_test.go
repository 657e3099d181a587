package idempotency_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/exactlyonce/idempotency"
	"github.com/exactlyonce/idempotency/internal/testdb"
)

// Failures that no retry can fix are Internal, with what to do, never
// Unavailable (which clients and the client chain retry): a TLS
// certificate that cannot verify, a library file the server cannot load,
// an answer pgx cannot decode. Nothing runs.
func TestPermanentFailuresOfTheConnectionAreInternal(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testdb.New(t, 2)
	migratedStore(t, db)
	var ran bool
	run := func(context.Context, pgx.Tx) (proto.Message, error) { ran = true; return nil, nil }
	for name, tc := range map[string]struct {
		tweak func(t *testing.T, cfg *pgxpool.Config)
		says  string
	}{
		// The local server's certificate is self-signed: verify-full can
		// never accept it.
		"sslmode=verify-full against a self-signed certificate": {func(t *testing.T, cfg *pgxpool.Config) {
			url := strings.Replace(db.URL(), "sslmode=disable", "sslmode=verify-full", 1)
			if !strings.Contains(url, "sslmode=verify-full") {
				url += "&sslmode=verify-full"
			}
			c, err := pgxpool.ParseConfig(url)
			require.NoError(t, err)
			*cfg = *c
		}, "TLS handshake with the server cannot succeed"},
		// A role whose sessions preload a library that is not installed:
		// every login fails with 58P01.
		"a missing session_preload_libraries file": {func(t *testing.T, cfg *pgxpool.Config) {
			cfg.ConnConfig.User = testRole(t, "ALTER ROLE %s SET session_preload_libraries = 'idempotency_missing_library'")
		}, "cannot load a file its configuration names"},
		// A type registered on the pool's connections that cannot decode
		// what the engine reads.
		"an answer pgx cannot decode": {func(t *testing.T, cfg *pgxpool.Config) {
			cfg.AfterConnect = func(_ context.Context, c *pgx.Conn) error {
				c.TypeMap().RegisterType(&pgtype.Type{Name: "tid", OID: pgtype.TIDOID, Codec: pgtype.BoolCodec{}})
				return nil
			}
		}, "pgx could not use the server's answer"},
	} {
		t.Run(name, func(t *testing.T) {
			cfg, err := pgxpool.ParseConfig(db.URL())
			require.NoError(t, err)
			tc.tweak(t, cfg)
			pool, err := pgxpool.NewWithConfig(ctx, cfg)
			require.NoError(t, err)
			t.Cleanup(pool.Close)
			store, err := idempotency.NewStore(pool)
			require.NoError(t, err)
			res, err := store.Execute(ctx, idempotency.Call{Key: "k", Method: "m"}, run)
			require.Equal(t, codes.Internal, status.Code(err), "%v", err)
			require.Contains(t, status.Convert(err).Message(), tc.says)
			require.Equal(t, idempotency.OutcomeMisconfigured, res.Outcome)
			require.False(t, ran, "nothing runs")
			require.Zero(t, db.Count(t, `SELECT count(*) FROM idempotency_keys`))
		})
	}
}

// testRole creates a login role for t (dropped when t ends) with the
// privileges of the test database's schema, and runs each alter on it (%s
// is the role's quoted name). Creating roles needs CREATEROLE, and some
// settings a superuser: the tests' role has both on the local server.
func testRole(t *testing.T, alters ...string) string {
	t.Helper()
	var b [4]byte
	_, _ = rand.Read(b[:])
	name := "idempotency_test_" + hex.EncodeToString(b[:])
	quoted := pgx.Identifier{name}.Sanitize()
	admin := testdb.Admin(t)
	ctx := context.Background()
	if _, err := admin.Exec(ctx, "CREATE ROLE "+quoted+" LOGIN"); err != nil {
		t.Fatalf("create role %s (the tests need CREATEROLE): %v", name, err)
	}
	t.Cleanup(func() {
		_, _ = admin.Exec(ctx, "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = $1", name)
		if _, err := admin.Exec(ctx, "DROP OWNED BY "+quoted+"; DROP ROLE "+quoted); err != nil {
			t.Errorf("drop role %s: %v", name, err)
		}
	})
	for _, alter := range alters {
		if _, err := admin.Exec(ctx, strings.ReplaceAll(alter, "%s", quoted)); err != nil {
			t.Fatalf("%s: %v", alter, err)
		}
	}
	return name
}
