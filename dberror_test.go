package idempotency_test

import (
	"context"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/wrapperspb"

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

// Permanent failures are never Unavailable, which clients retry forever:
// each gets a code an operator or developer can act on.
func TestPermanentErrorsAreNotUnavailable(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	run := func(context.Context, pgx.Tx) (proto.Message, error) { return nil, nil }
	t.Run("unknown database or role", func(t *testing.T) {
		t.Parallel()
		base, err := pgxpool.ParseConfig(testdb.URL())
		require.NoError(t, err)
		for name, tweak := range map[string]func(*pgxpool.Config){
			"database": func(c *pgxpool.Config) { c.ConnConfig.Database = "idempotency_no_such_database" },
			"role":     func(c *pgxpool.Config) { c.ConnConfig.User = "idempotency_no_such_role" },
		} {
			cfg := base.Copy()
			tweak(cfg)
			pool, err := pgxpool.NewWithConfig(ctx, cfg)
			require.NoError(t, err)
			t.Cleanup(pool.Close)
			store, err := idempotency.NewStore(pool)
			require.NoError(t, err)
			res, err := store.Execute(ctx, idempotency.Call{Key: "k", Method: "m"}, run)
			require.Equal(t, codes.Internal, status.Code(err), "%s: %v", name, err)
			require.Contains(t, status.Convert(err).Message(), "PostgreSQL refused the login", name)
			require.Equal(t, idempotency.OutcomeMisconfigured, res.Outcome, name)
		}
	})
	t.Run("read-only default", func(t *testing.T) {
		t.Parallel()
		db := testdb.New(t, 2)
		migratedStore(t, db)
		ro := schemaPool(t, db.Schema, 2, func(c *pgxpool.Config) { c.ConnConfig.RuntimeParams["default_transaction_read_only"] = "on" })
		store, err := idempotency.NewStore(ro)
		require.NoError(t, err)
		ran := false
		res, err := store.Execute(ctx, idempotency.Call{Key: "k", Method: "m"}, func(context.Context, pgx.Tx) (proto.Message, error) { ran = true; return nil, nil })
		require.Equal(t, codes.Internal, status.Code(err), "%v", err)
		require.Contains(t, status.Convert(err).Message(), "default_transaction_read_only is on")
		require.Equal(t, idempotency.OutcomeMisconfigured, res.Outcome)
		require.False(t, ran, "nothing runs where its result could not be stored")
	})
	t.Run("handler errors", func(t *testing.T) {
		t.Parallel()
		db := testdb.New(t, 4)
		store := migratedStore(t, db)
		createLedger(t, db)
		for name, tc := range map[string]struct {
			fn      idempotency.Func
			message string
			stored  bool
		}{
			"SET TRANSACTION READ ONLY": {func(ctx context.Context, tx pgx.Tx) (proto.Message, error) {
				_, err := tx.Exec(ctx, `SET TRANSACTION READ ONLY`)
				return nil, err
			}, "SET TRANSACTION", true},
			"transaction_read_only spelled U&": {func(ctx context.Context, tx pgx.Tx) (proto.Message, error) {
				_, err := tx.Exec(ctx, `SET LOCAL U&"transaction_read_only" = on`)
				return nil, err
			}, `SET U&"..."`, true},
			"DEALLOCATE ALL": {func(ctx context.Context, tx pgx.Tx) (proto.Message, error) {
				_, err := tx.Exec(ctx, `DEALLOCATE ALL`)
				return nil, err
			}, "DEALLOCATE", true},
			"transaction_read_only through set_config": {func(ctx context.Context, tx pgx.Tx) (proto.Message, error) {
				_, err := tx.Exec(ctx, `SELECT set_config('transaction_read_only', 'on', true)`)
				return wrapperspb.String("read only"), err
			}, "the handler made it so", true},
			"rows left open": {func(ctx context.Context, tx pgx.Tx) (proto.Message, error) {
				_, err := tx.Query(ctx, `SELECT generate_series(1, 10000)`)
				return wrapperspb.String("left open"), err
			}, "still open", true},
			"QueryRow never scanned": {func(ctx context.Context, tx pgx.Tx) (proto.Message, error) {
				tx.QueryRow(ctx, `SELECT 1`)
				return wrapperspb.String("never scanned"), nil
			}, "still open", true},
		} {
			key := strings.ReplaceAll(name, " ", "-")
			for attempt := 0; attempt < 2; attempt++ {
				res, err := store.Execute(ctx, idempotency.Call{Key: key, Method: "m"}, tc.fn)
				require.Equal(t, codes.Internal, status.Code(err), "%s: %v", name, err)
				require.Contains(t, status.Convert(err).Message(), tc.message, name)
				if tc.stored {
					want := []idempotency.Outcome{idempotency.OutcomeExecuted, idempotency.OutcomeReplayed}[attempt]
					require.Equal(t, want, res.Outcome, "%s: stored, never run again", name)
				}
			}
			// The connection is fit for the next call.
			res, err := store.Execute(ctx, idempotency.Call{Key: key + "-then", Method: "m"}, func(ctx context.Context, tx pgx.Tx) (proto.Message, error) {
				_, err := tx.Exec(ctx, `INSERT INTO ledger (note) VALUES ('next')`)
				return nil, err
			})
			require.NoError(t, err, name)
			require.Equal(t, idempotency.OutcomeExecuted, res.Outcome)
		}
	})
}

// A handler that returns the driver's error for a serialization failure or
// a deadlock: Aborted, which clients retry with the same key, not Unknown.
func TestHandlersDeadlockIsAborted(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envConfig{handler: func(ctx context.Context, req *wrapperspb.StringValue) (*wrapperspb.StringValue, error) {
		var err error
		_, err = idempotency.MustTxFromContext(ctx).Exec(ctx, `DO $$ BEGIN RAISE EXCEPTION 'deadlock' USING ERRCODE = 'deadlock_detected'; END $$`)
		return nil, err
	}})
	r := e.call(context.Background(), methodCharge, "k", "x")
	require.Equal(t, codes.Aborted, status.Code(r.err), "%v", r.err)
	require.Contains(t, retryCodes, status.Code(r.err), "a code the client interceptor retries")
	require.Equal(t, 0, e.keyRows(), "released: the retry runs again")
}
