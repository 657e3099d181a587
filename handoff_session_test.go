package idempotency_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/exactlyonce/idempotency"
	"github.com/exactlyonce/idempotency/internal/testdb"
)

// The engine's reads do not depend on how the session formats values: on
// a database whose defaults format bytea, dates, intervals, time zones and
// floats unusually, every path that reads a key's row works, in every
// query mode of pgx (text results in exec and simple_protocol, binary in
// the others).
func TestFormattingSettingsChangeNothing(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	dbName := formattedDatabase(t, map[string]string{
		"bytea_output": "escape", "DateStyle": "SQL, DMY", "IntervalStyle": "sql_standard",
		"TimeZone": "Pacific/Chatham", "extra_float_digits": "-15",
	})
	for _, mode := range []pgx.QueryExecMode{pgx.QueryExecModeCacheStatement, pgx.QueryExecModeCacheDescribe,
		pgx.QueryExecModeDescribeExec, pgx.QueryExecModeExec, pgx.QueryExecModeSimpleProtocol} {
		t.Run(mode.String(), func(t *testing.T) {
			cfg, err := pgxpool.ParseConfig(testdb.URL())
			require.NoError(t, err)
			cfg.ConnConfig.Database = dbName
			cfg.ConnConfig.DefaultQueryExecMode = mode
			cfg.MaxConns = 2
			pool, err := pgxpool.NewWithConfig(ctx, cfg)
			require.NoError(t, err)
			t.Cleanup(pool.Close)
			var bytea string
			require.NoError(t, pool.QueryRow(ctx, `SELECT current_setting('bytea_output') || ' ' || current_setting('DateStyle')`).Scan(&bytea))
			require.Equal(t, "escape SQL, DMY", bytea, "the database's settings apply")
			store, err := idempotency.NewStore(pool)
			require.NoError(t, err)
			require.NoError(t, store.Migrate(ctx))
			scope := mode.String()
			// Bytes that every bytea format writes differently.
			odd := []byte{0, '\\', '\'', 0xff, 'x', '\n', 0x80}
			message := "naïve \\ ' \n 10.0 20:00 1 day"
			fp := []byte("fp\x00\\\xff")
			var runs int
			ok := func(context.Context, pgx.Tx) (proto.Message, error) {
				runs++
				return wrapperspb.Bytes(odd), nil
			}
			call := idempotency.Call{Scope: scope, Key: "k", Method: "m", Fingerprint: fp, TTL: time.Hour}
			res, err := store.Execute(ctx, call, ok)
			require.NoError(t, err)
			require.Equal(t, idempotency.OutcomeExecuted, res.Outcome)
			for _, retry := range []bool{false, true} {
				call.Retry = retry
				res, err := store.Execute(ctx, call, ok)
				require.NoError(t, err, "retry marker %v", retry)
				require.Equal(t, idempotency.OutcomeReplayed, res.Outcome)
				require.Equal(t, odd, res.Response.(*wrapperspb.BytesValue).GetValue())
			}
			_, err = store.Execute(ctx, idempotency.Call{Scope: scope, Key: "k", Method: "m", Fingerprint: []byte("other")}, ok)
			require.ErrorIs(t, err, idempotency.ErrKeyReused, "the stored fingerprint is read exactly")

			// A final error, stored outside the call's transaction and read
			// back; a claim its handler committed, settled by the next call.
			final := func(context.Context, pgx.Tx) (proto.Message, error) {
				runs++
				return nil, idempotency.Final(status.Error(codes.NotFound, message))
			}
			ended := func(ctx context.Context, tx pgx.Tx) (proto.Message, error) {
				runs++
				_, err := tx.Conn().Exec(ctx, `COMMIT`)
				return wrapperspb.String("ended"), err
			}
			for key, tc := range map[string]struct {
				fn   idempotency.Func
				code codes.Code
			}{"final": {final, codes.NotFound}, "ended": {ended, codes.Internal}} {
				for range 2 {
					_, err := store.Execute(ctx, idempotency.Call{Scope: scope, Key: key, Method: "m"}, tc.fn)
					require.Equal(t, tc.code, status.Code(err), "%s: %v", key, err)
					require.True(t, idempotency.IsFinal(err), key)
				}
			}
			require.Equal(t, 3, runs)

			rec, err := store.Inspect(ctx, scope, "k")
			require.NoError(t, err)
			require.Equal(t, "succeeded", rec.State)
			require.Equal(t, fp, rec.Fingerprint)
			require.WithinDuration(t, time.Now(), rec.CreatedAt, time.Minute)
			require.WithinDuration(t, rec.CreatedAt.Add(time.Hour), rec.ExpiresAt, time.Second)
			require.False(t, rec.CompletedAt.Before(rec.CreatedAt))
			rec, err = store.Inspect(ctx, scope, "final")
			require.NoError(t, err)
			require.Equal(t, message, rec.Status.Message())

			// An expired key runs again, and the cleaner deletes expired ones.
			short := idempotency.Call{Scope: scope, Key: "short", Method: "m", TTL: time.Millisecond}
			for range 2 {
				res, err := store.Execute(ctx, short, ok)
				require.NoError(t, err)
				require.Equal(t, idempotency.OutcomeExecuted, res.Outcome)
				require.Eventually(t, func() bool { r, err := store.Inspect(ctx, scope, "short"); return err == nil && r.Expired }, liveness, time.Millisecond)
			}
			n, err := store.DeleteExpired(ctx, 10)
			require.NoError(t, err)
			require.GreaterOrEqual(t, n, int64(1))
			require.NoError(t, store.Forget(ctx, scope, "k", ""))
			res, err = store.Execute(ctx, call, ok)
			require.NoError(t, err)
			require.Equal(t, idempotency.OutcomeExecuted, res.Outcome, "a forgotten key runs again")
		})
	}
}

// formattedDatabase creates a database with settings as its defaults
// (ALTER DATABASE ... SET), dropped when t ends.
func formattedDatabase(t *testing.T, settings map[string]string) string {
	t.Helper()
	ctx := context.Background()
	var b [4]byte
	_, _ = rand.Read(b[:])
	name := "idempotency_fmt_" + hex.EncodeToString(b[:])
	quoted := pgx.Identifier{name}.Sanitize()
	admin := testdb.Admin(t)
	if _, err := admin.Exec(ctx, "CREATE DATABASE "+quoted); err != nil {
		t.Fatalf("create database %s (the tests need CREATEDB): %v", name, err)
	}
	t.Cleanup(func() {
		if _, err := admin.Exec(context.Background(), "DROP DATABASE "+quoted+" WITH (FORCE)"); err != nil {
			t.Errorf("drop database %s: %v", name, err)
		}
	})
	for k, v := range settings {
		if _, err := admin.Exec(ctx, "ALTER DATABASE "+quoted+" SET "+pgx.Identifier{k}.Sanitize()+" = "+quoteLiteral(v)); err != nil {
			t.Fatalf("ALTER DATABASE SET %s: %v", k, err)
		}
	}
	return name
}

// quoteLiteral quotes s as an SQL string literal.
func quoteLiteral(s string) string {
	out := []byte{'\''}
	for i := 0; i < len(s); i++ {
		if s[i] == '\'' {
			out = append(out, '\'')
		}
		out = append(out, s[i])
	}
	return string(append(out, '\''))
}
