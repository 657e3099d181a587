package idempotency_test

import (
	"context"
	"sync/atomic"
	"testing"

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

// What a handler changes in its session, past the call's transaction,
// never reaches the next call that gets the connection: on a pool of one,
// the call after it starts from a session as the pool made it (its
// AfterConnect settings included), and the engine's own statements work.
func TestSessionStateNeverReachesAnotherCall(t *testing.T) {
	t.Parallel()
	const pristine = `SELECT current_setting('statement_timeout') || ' ' || current_setting('work_mem') || ' ' ||
current_setting('default_transaction_read_only') || ' ' || current_user || ' ' || current_setting('search_path')`
	for name, tc := range map[string]struct {
		sql string
		// fails: the call itself fails, stored, naming what happened.
		fails string
	}{
		"set_config(default_transaction_read_only, false)": {sql: `SELECT set_config('default_transaction_read_only', 'on', false)`},
		"set_config(statement_timeout, false)":             {sql: `SELECT set_config('statement_timeout', '10min', false)`},
		"SET for the session":                              {sql: `SET statement_timeout = '10min'`},
		"SET SESSION search_path":                          {sql: `SET SESSION search_path = pg_catalog`},
		"RESET of an AfterConnect setting":                 {sql: `RESET statement_timeout`},
		"RESET ALL":                                        {sql: `RESET ALL`},
		"UPDATE pg_settings":                               {sql: `UPDATE pg_settings SET setting = '123kB' WHERE name = 'work_mem'`},
		// The call's result is written as the role the call began with,
		// which the handler changed: it fails once (see TestHandlerRole).
		"SET ROLE for the session":     {sql: `SET ROLE pg_monitor`, fails: "role the handler set"},
		"DEALLOCATE ALL in a DO block": {sql: `DO $$ BEGIN EXECUTE 'DEALLOCATE ALL'; END $$`},
		"DEALLOCATE ALL in a function the engine cannot read": {
			sql:   `SELECT deallocate_everything()`,
			fails: "prepared statements vanished",
		},
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			db := testdb.NewConfigured(t, func(cfg *pgxpool.Config) {
				cfg.MaxConns = 1 // the next call gets the same connection, unless it was closed
				cfg.AfterConnect = func(ctx context.Context, c *pgx.Conn) error {
					_, err := c.Exec(ctx, `SET statement_timeout = '5min'`)
					return err
				}
			})
			store := migratedStore(t, db)
			createLedger(t, db)
			ctx := context.Background()
			_, err := db.Pool.Exec(ctx, `CREATE FUNCTION deallocate_everything() RETURNS void LANGUAGE plpgsql AS $$ BEGIN EXECUTE 'DEALLOCATE ALL'; END $$`)
			require.NoError(t, err)
			var before string
			write := func(key string, then func(ctx context.Context, tx pgx.Tx) error) (idempotency.Result, error) {
				return store.Execute(ctx, idempotency.Call{Key: key, Method: "m"}, func(ctx context.Context, tx pgx.Tx) (proto.Message, error) {
					if _, err := tx.Exec(ctx, `INSERT INTO ledger (note) VALUES ($1)`, key); err != nil {
						return nil, err
					}
					return wrapperspb.String(key), then(ctx, tx)
				})
			}
			// The connection has served a call: the engine's statements are
			// prepared on it.
			_, err = write("warm", func(ctx context.Context, tx pgx.Tx) error {
				return tx.QueryRow(ctx, pristine).Scan(&before)
			})
			require.NoError(t, err)
			res, err := write("changes", func(ctx context.Context, tx pgx.Tx) error {
				_, err := tx.Exec(ctx, tc.sql)
				return err
			})
			if tc.fails != "" {
				requireStoredInternal(t, err, tc.fails)
			} else {
				require.NoError(t, err)
				require.Equal(t, idempotency.OutcomeExecuted, res.Outcome)
			}
			var after string
			res, err = write("next", func(ctx context.Context, tx pgx.Tx) error {
				return tx.QueryRow(ctx, pristine).Scan(&after)
			})
			require.NoError(t, err, "the next call works")
			require.Equal(t, idempotency.OutcomeExecuted, res.Outcome)
			require.Equal(t, before, after, "the next call's session is as the pool made it")
			// A finished key replays, both ways the engine reads it.
			for _, retry := range []bool{false, true} {
				res, err := store.Execute(ctx, idempotency.Call{Key: "warm", Method: "m", Retry: retry}, nil)
				require.NoError(t, err)
				require.Equal(t, idempotency.OutcomeReplayed, res.Outcome)
			}
			wantRows := 3
			if tc.fails != "" {
				wantRows = 2
			}
			require.Equal(t, wantRows, db.Count(t, `SELECT count(*) FROM ledger`))
		})
	}
}

// The row-level-security pattern: a handler sets a tenant's role for the
// call's transaction. The key's row is written as the role the call began
// with; a tenant role that may not write the key table makes the call fail
// once, its error stored and naming the cause (it never runs again), unless
// the handler sets the role back, or the tenant role may write it. A
// store's own role that lacks the privilege is an operator's to fix: the
// error says so and is not stored, so the call runs once it is granted.
func TestHandlerRole(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testdb.New(t, 4)
	store := migratedStore(t, db)
	createLedger(t, db)
	schema := pgx.Identifier{db.Schema}.Sanitize()
	grants := "GRANT USAGE ON SCHEMA " + schema + " TO %s; GRANT INSERT, SELECT ON " + schema + ".ledger TO %s; GRANT USAGE ON ALL SEQUENCES IN SCHEMA " + schema + " TO %s"
	tenant := testRole(t, grants)
	writer := testRole(t, grants, "GRANT SELECT, UPDATE ON "+schema+".idempotency_keys TO %s")
	var storeRole string
	require.NoError(t, db.Pool.QueryRow(ctx, `SELECT current_user`).Scan(&storeRole))
	var runs atomic.Int64
	as := func(role string, back bool) idempotency.Func {
		return func(ctx context.Context, tx pgx.Tx) (proto.Message, error) {
			runs.Add(1)
			if _, err := tx.Exec(ctx, "SET LOCAL ROLE "+pgx.Identifier{role}.Sanitize()); err != nil {
				return nil, err
			}
			if _, err := tx.Exec(ctx, `INSERT INTO ledger (note) VALUES ('as tenant')`); err != nil {
				return nil, err
			}
			if back {
				if _, err := tx.Exec(ctx, "SET LOCAL ROLE "+pgx.Identifier{storeRole}.Sanitize()); err != nil {
					return nil, err
				}
			}
			return wrapperspb.String("charged"), nil
		}
	}
	for range 2 {
		_, err := store.Execute(ctx, idempotency.Call{Key: "tenant", Method: "m"}, as(tenant, false))
		requireStoredInternal(t, err, "the role the handler set")
		require.Contains(t, err.Error(), storeRole, "names the role to set back")
	}
	require.EqualValues(t, 1, runs.Load(), "it never runs again")
	require.Zero(t, db.Count(t, `SELECT count(*) FROM ledger`))

	for key, fn := range map[string]idempotency.Func{"set-back": as(tenant, true), "may-write": as(writer, false)} {
		res, err := store.Execute(ctx, idempotency.Call{Key: key, Method: "m"}, fn)
		require.NoError(t, err, key)
		require.Equal(t, idempotency.OutcomeExecuted, res.Outcome, key)
		require.Equal(t, "succeeded", keyState(t, db, key))
	}
	require.Equal(t, 2, db.Count(t, `SELECT count(*) FROM ledger`))

	// The store's own role may insert keys but not update them.
	limited := testRole(t, grants, "GRANT SELECT, INSERT ON "+schema+".idempotency_keys TO %s")
	cfg, err := pgxpool.ParseConfig(db.URL())
	require.NoError(t, err)
	cfg.ConnConfig.User = limited
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	limitedStore, err := idempotency.NewStore(pool)
	require.NoError(t, err)
	plain := func(ctx context.Context, tx pgx.Tx) (proto.Message, error) {
		_, err := tx.Exec(ctx, `INSERT INTO ledger (note) VALUES ('limited')`)
		return wrapperspb.String("ok"), err
	}
	res, err := limitedStore.Execute(ctx, idempotency.Call{Key: "limited", Method: "m"}, plain)
	require.Equal(t, codes.Internal, status.Code(err), "%v", err)
	require.Contains(t, status.Convert(err).Message(), "grant it SELECT, INSERT, UPDATE and DELETE")
	require.Equal(t, idempotency.OutcomeMisconfigured, res.Outcome)
	require.False(t, idempotency.IsFinal(err), "not stored")
	require.Empty(t, keyState(t, db, "limited"))
	_, err = testdb.Admin(t).Exec(ctx, "GRANT UPDATE ON "+schema+".idempotency_keys TO "+pgx.Identifier{limited}.Sanitize())
	require.NoError(t, err)
	res, err = limitedStore.Execute(ctx, idempotency.Call{Key: "limited", Method: "m"}, plain)
	require.NoError(t, err)
	require.Equal(t, idempotency.OutcomeExecuted, res.Outcome)
}
