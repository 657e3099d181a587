package idempotency_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/exactlyonce/idempotency"
	"github.com/exactlyonce/idempotency/internal/testdb"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/wrapperspb"
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
		"SET ROLE for the session": {sql: `SET ROLE pg_monitor`, fails: "role the handler set"},
		// The engine reads no handler SQL for what it does to the session:
		// a DEALLOCATE in a DO block is one in a function.
		"DEALLOCATE ALL in a DO block": {
			sql:   `DO $$ BEGIN EXECUTE 'DEALLOCATE ALL'; END $$`,
			fails: "prepared statements vanished",
		},
		"DEALLOCATE ALL in a function": {
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

// What a handler leaves in its session, whatever the call's outcome, never
// reaches the next call on the same server connection: directly, on a pool
// of one connection, and through a PgBouncer in transaction mode with one
// server connection, where closing the client's connection resets nothing.
// Each kind of state is left the way the engine cannot read in the SQL (a
// function, a lock taken by a call that then fails), and the next call does
// what a tenant's handler would: copy its staging table into its writes,
// take the lock, prepare its statement, read its tenant. A handler that
// commits the call's transaction itself and begins another commits what it
// set for the session before, whatever the call's outcome: that is reset
// too.
func TestSessionStateResetOnEveryOutcome(t *testing.T) {
	t.Parallel()
	db := testdb.New(t, 4)
	migratedStore(t, db)
	ctx := context.Background()
	_, err := db.Pool.Exec(ctx, `CREATE TABLE ledger (id bigserial PRIMARY KEY, note text NOT NULL);
CREATE FUNCTION set_tenant(tenant text) RETURNS void LANGUAGE plpgsql AS $$ BEGIN PERFORM set_config('app.tenant', tenant, false); END $$;
CREATE SEQUENCE invoice_numbers;
CREATE FUNCTION last_number() RETURNS text LANGUAGE plpgsql AS $$ BEGIN RETURN lastval()::text;
EXCEPTION WHEN object_not_in_prerequisite_state THEN RETURN 'none'; END $$`)
	require.NoError(t, err)
	ledger := pgx.Identifier{db.Schema, "ledger"}.Sanitize()
	setTenant := pgx.Identifier{db.Schema, "set_tenant"}.Sanitize()
	invoiceNumbers := pgx.Identifier{db.Schema, "invoice_numbers"}.Sanitize()
	lastNumber := pgx.Identifier{db.Schema, "last_number"}.Sanitize()
	admin := testdb.Admin(t)

	// Each kind: what call A leaves (leave), and what call B, on the same
	// session, then finds (next), which must be want. lock is the advisory
	// lock's key, one per way of connecting, which run side by side.
	kinds := func(lock int) []struct {
		name  string
		leave []string
		next  func(ctx context.Context, tx pgx.Tx) (string, error)
		want  string
	} {
		return []struct {
			name  string
			leave []string
			next  func(ctx context.Context, tx pgx.Tx) (string, error)
			want  string
		}{
			{
				name:  "temporary table",
				leave: []string{`CREATE TEMP TABLE staging (note text)`, `INSERT INTO staging VALUES ('tenant-a')`},
				next: func(ctx context.Context, tx pgx.Tx) (string, error) {
					for _, sql := range []string{`CREATE TEMP TABLE IF NOT EXISTS staging (note text)`, `INSERT INTO staging VALUES ('tenant-b')`} {
						if _, err := tx.Exec(ctx, sql); err != nil {
							return "", err
						}
					}
					var notes string
					err := tx.QueryRow(ctx, `WITH w AS (INSERT INTO `+ledger+` (note) SELECT note FROM staging RETURNING note)
SELECT string_agg(note, ',' ORDER BY note) FROM w`).Scan(&notes)
					return notes, err
				},
				want: "tenant-b",
			},
			{
				name:  "session advisory lock",
				leave: []string{fmt.Sprintf(`SELECT pg_advisory_lock(%d)`, lock)},
				next: func(ctx context.Context, tx pgx.Tx) (string, error) {
					// Another session asks for the lock.
					var free bool
					if err := admin.QueryRow(ctx, `SELECT pg_try_advisory_lock($1)`, lock).Scan(&free); err != nil || !free {
						return "held", err
					}
					_, err := admin.Exec(ctx, `SELECT pg_advisory_unlock($1)`, lock)
					return "free", err
				},
				want: "free",
			},
			{
				name:  "statement prepared by SQL",
				leave: []string{`PREPARE staged AS SELECT 1`},
				next: func(ctx context.Context, tx pgx.Tx) (string, error) {
					_, err := tx.Exec(ctx, `PREPARE staged AS SELECT 2`)
					return "prepared", err
				},
				want: "prepared",
			},
			{
				name:  "setting set in a function",
				leave: []string{`SELECT ` + setTenant + `('tenant-a')`},
				next: func(ctx context.Context, tx pgx.Tx) (string, error) {
					var tenant string
					err := tx.QueryRow(ctx, `SELECT coalesce(current_setting('app.tenant', true), '')`).Scan(&tenant)
					return "tenant=" + tenant, err
				},
				want: "tenant=",
			},
			{
				// A sequence's current value survives a rollback.
				name:  "sequence's current value",
				leave: []string{`SELECT nextval('` + invoiceNumbers + `')`},
				next: func(ctx context.Context, tx pgx.Tx) (string, error) {
					var last string
					err := tx.QueryRow(ctx, `SELECT `+lastNumber+`()`).Scan(&last)
					return "last=" + last, err
				},
				want: "last=none",
			},
			{
				// The handler commits the call's transaction itself, and
				// begins another: what it set for the session is
				// committed, whatever the call's outcome.
				name: "setting and temporary table the handler committed",
				leave: []string{`SELECT ` + setTenant + `('tenant-a')`, `CREATE TEMP TABLE staging (note text)`,
					`COMMIT AND CHAIN`},
				next: func(ctx context.Context, tx pgx.Tx) (string, error) {
					var found string
					err := tx.QueryRow(ctx, `SELECT 'tenant=' || coalesce(current_setting('app.tenant', true), '') ||
' staging=' || (pg_catalog.to_regclass('pg_temp.staging') IS NOT NULL)::text`).Scan(&found)
					return found, err
				},
				want: "tenant= staging=false",
			},
		}
	}
	// Each outcome: how call A ends once it has left its state.
	outcomes := []struct {
		name string
		end  func(ctx context.Context, tx pgx.Tx, cancel func()) (proto.Message, error)
	}{
		{"committed", func(context.Context, pgx.Tx, func()) (proto.Message, error) { return wrapperspb.String("a"), nil }},
		{"failed", func(context.Context, pgx.Tx, func()) (proto.Message, error) {
			return nil, errors.New("tenant a failed")
		}},
		{"stored error", func(context.Context, pgx.Tx, func()) (proto.Message, error) {
			return nil, idempotency.Final(status.Error(codes.InvalidArgument, "tenant a refused"))
		}},
		{"aborted", func(ctx context.Context, tx pgx.Tx, _ func()) (proto.Message, error) {
			_, _ = tx.Exec(ctx, `SELECT 1/0`) // the error ignored: the transaction is aborted
			return wrapperspb.String("a"), nil
		}},
		{"panicked", func(context.Context, pgx.Tx, func()) (proto.Message, error) { panic("tenant a panicked") }},
		{"cancelled", func(ctx context.Context, _ pgx.Tx, cancel func()) (proto.Message, error) {
			cancel()
			return nil, ctx.Err()
		}},
	}
	for i, path := range []struct {
		name string
		url  func(t *testing.T) string
	}{
		{"direct", func(*testing.T) string { return testdb.URL() }},
		{"pgbouncer", pgbouncerOfOne},
	} {
		t.Run(path.name, func(t *testing.T) {
			t.Parallel()
			cfg, err := pgxpool.ParseConfig(path.url(t))
			require.NoError(t, err)
			cfg.MaxConns = 1 // the next call gets the same connection, unless it was closed
			pool, err := pgxpool.NewWithConfig(ctx, cfg)
			require.NoError(t, err)
			t.Cleanup(pool.Close)
			// The reset reads none of the handler's SQL: the check of it
			// for transaction control (which refuses COMMIT AND CHAIN) is
			// off.
			store, err := idempotency.NewStore(pool, idempotency.WithTable(db.Schema, idempotency.DefaultTable), idempotency.WithoutSQLCheck())
			require.NoError(t, err)
			for _, kind := range kinds(4242 + i) {
				for _, outcome := range outcomes {
					t.Run(kind.name+"/"+outcome.name, func(t *testing.T) {
						key := strings.ReplaceAll(path.name+"/"+kind.name+"/"+outcome.name, " ", "-")
						var pidA, pidB uint32
						func() {
							defer func() { _ = recover() }()
							actx, cancel := context.WithCancel(ctx)
							defer cancel()
							_, _ = store.Execute(actx, idempotency.Call{Key: key + "/a", Method: "m"}, func(ctx context.Context, tx pgx.Tx) (proto.Message, error) {
								if err := tx.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&pidA); err != nil {
									return nil, err
								}
								for _, sql := range kind.leave {
									if _, err := tx.Exec(ctx, sql); err != nil {
										return nil, err
									}
								}
								return outcome.end(ctx, tx, cancel)
							})
						}()
						var got string
						res, err := store.Execute(ctx, idempotency.Call{Key: key + "/b", Method: "m"}, func(ctx context.Context, tx pgx.Tx) (proto.Message, error) {
							if err := tx.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&pidB); err != nil {
								return nil, err
							}
							var err error
							got, err = kind.next(ctx, tx)
							return wrapperspb.String(got), err
						})
						require.NoError(t, err)
						require.Equal(t, idempotency.OutcomeExecuted, res.Outcome)
						require.Equal(t, kind.want, got, "what the next call found of the session")
						if path.name == "pgbouncer" {
							require.Equal(t, pidA, pidB, "through PgBouncer both calls ran on the one server connection")
						}
					})
				}
			}
		})
	}
}

// Transaction-local settings (SET LOCAL, set_config(name, value, true)),
// the way a handler binds a tenant for row-level security, end with the
// call's transaction: the connection goes back to the pool, and calls on a
// pool of two connections run on at most two server processes.
func TestTransactionLocalSettingsKeepTheConnection(t *testing.T) {
	t.Parallel()
	for name, set := range map[string]func(ctx context.Context, tx pgx.Tx, tenant string) error{
		"set_config(name, value, true)": func(ctx context.Context, tx pgx.Tx, tenant string) error {
			_, err := tx.Exec(ctx, `SELECT set_config('app.tenant', $1, true)`, tenant)
			return err
		},
		"SET LOCAL": func(ctx context.Context, tx pgx.Tx, tenant string) error {
			_, err := tx.Exec(ctx, `SET LOCAL app.tenant = `+pgx.Identifier{tenant}.Sanitize())
			return err
		},
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			db := testdb.New(t, 2)
			store := migratedStore(t, db)
			ctx := context.Background()
			const calls = 20
			pids := map[uint32]bool{}
			for i := range calls {
				tenant := fmt.Sprint("tenant-", i)
				var pid uint32
				var seen string
				res, err := store.Execute(ctx, idempotency.Call{Key: tenant, Method: "m"}, func(ctx context.Context, tx pgx.Tx) (proto.Message, error) {
					if err := set(ctx, tx, tenant); err != nil {
						return nil, err
					}
					err := tx.QueryRow(ctx, `SELECT pg_backend_pid(), current_setting('app.tenant')`).Scan(&pid, &seen)
					return wrapperspb.String(seen), err
				})
				require.NoError(t, err)
				require.Equal(t, idempotency.OutcomeExecuted, res.Outcome)
				require.Equal(t, tenant, seen, "the call sees its own tenant")
				pids[pid] = true
			}
			require.LessOrEqual(t, len(pids), 2, "%d calls on a pool of 2 ran on %d server processes: connections were closed after calls", calls, len(pids))
		})
	}
}

// The engine's statement that writes the call's result runs in the call's
// transaction, after the handler: the names the handler's session resolves
// (its temporary types, which come before pg_catalog's, or a tenant's
// schema it puts before pg_catalog with SET LOCAL search_path) change none
// of the types and operators the statement uses. The call commits, as the
// handler asked, and replays.
func TestSessionNamesDoNotReachTheEngine(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testdb.New(t, 2)
	store := migratedStore(t, db)
	createLedger(t, db)
	tenant := pgx.Identifier{db.Schema}.Sanitize()
	// The tenant's schema (the test's own) has tables named like types,
	// and an equality of text that never holds.
	_, err := db.Pool.Exec(ctx, `CREATE TABLE tid (a int); CREATE TABLE xid (a int);
CREATE FUNCTION never(text, text) RETURNS boolean LANGUAGE sql IMMUTABLE AS 'SELECT false';
CREATE OPERATOR = (LEFTARG = text, RIGHTARG = text, FUNCTION = never);
CREATE FUNCTION nowhere(timestamptz, interval) RETURNS timestamptz LANGUAGE sql IMMUTABLE AS 'SELECT ''-infinity''::timestamptz';
CREATE OPERATOR + (LEFTARG = timestamptz, RIGHTARG = interval, FUNCTION = nowhere)`)
	require.NoError(t, err)
	for name, sql := range map[string]string{
		"a temporary domain named text":            `CREATE DOMAIN pg_temp.text AS int`,
		"a temporary type named bytea":             `CREATE TYPE pg_temp.bytea AS (a int)`,
		"a tenant's schema before pg_catalog":      `SET LOCAL search_path = ` + tenant + `, pg_catalog`,
		"a tenant's schema before pg_catalog, set": `SELECT set_config('search_path', '` + tenant + `, pg_catalog', true)`,
	} {
		t.Run(name, func(t *testing.T) {
			key := strings.NewReplacer(" ", "-", "'", "").Replace(name)
			call := idempotency.Call{Key: key, Method: "m"}
			res, err := store.Execute(ctx, call, func(ctx context.Context, tx pgx.Tx) (proto.Message, error) {
				if _, err := tx.Exec(ctx, sql); err != nil {
					return nil, err
				}
				_, err := tx.Exec(ctx, `INSERT INTO `+tenant+`.ledger (note) VALUES ($1::pg_catalog.text)`, name)
				return wrapperspb.String(name), err
			})
			require.NoError(t, err)
			require.Equal(t, idempotency.OutcomeExecuted, res.Outcome)
			require.Equal(t, 1, db.Count(t, `SELECT count(*) FROM ledger WHERE note = $1`, name), "the handler's write committed")
			require.Equal(t, "succeeded", keyState(t, db, key))
			res, err = store.Execute(ctx, call, nil)
			require.NoError(t, err)
			require.Equal(t, idempotency.OutcomeReplayed, res.Outcome)
			require.True(t, proto.Equal(wrapperspb.String(name), res.Response))
		})
	}
}

// A handler that switches search_path to a tenant's schema cannot move the
// key's row: with or without a key table in the tenant's schema, the key
// is stored in the store's table and replays.
func TestTenantSearchPathCannotMoveTheKey(t *testing.T) {
	t.Parallel()
	for name, tenantHasKeyTable := range map[string]bool{"tenant schema with a key table": true, "tenant schema without one": false} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			db := testdb.New(t, 4)
			ctx := context.Background()
			store := migratedStore(t, db)
			tenant := db.Schema + "_tenant"
			_, err := testdb.Admin(t).Exec(ctx, `CREATE SCHEMA `+pgx.Identifier{tenant}.Sanitize()+`; CREATE TABLE `+pgx.Identifier{tenant, "ledger"}.Sanitize()+` (note text)`)
			require.NoError(t, err)
			t.Cleanup(func() {
				_, _ = testdb.Admin(t).Exec(context.Background(), `DROP SCHEMA `+pgx.Identifier{tenant}.Sanitize()+` CASCADE`)
			})
			if tenantHasKeyTable {
				tenantStore, err := idempotency.NewStore(db.Pool, idempotency.WithTable(tenant, idempotency.DefaultTable))
				require.NoError(t, err)
				require.NoError(t, tenantStore.Migrate(ctx))
			}
			var runs atomic.Int64
			fn := func(ctx context.Context, tx pgx.Tx) (proto.Message, error) {
				runs.Add(1)
				if _, err := tx.Exec(ctx, `SET LOCAL search_path = `+pgx.Identifier{tenant}.Sanitize()); err != nil {
					return nil, err
				}
				_, err := tx.Exec(ctx, `INSERT INTO ledger (note) VALUES ('tenant write')`)
				return wrapperspb.String("done"), err
			}
			for i, want := range []idempotency.Outcome{idempotency.OutcomeExecuted, idempotency.OutcomeReplayed, idempotency.OutcomeReplayed} {
				res, err := store.Execute(ctx, idempotency.Call{Key: "k", Method: "m", Retry: i == 2}, fn)
				require.NoError(t, err)
				require.Equal(t, want, res.Outcome, "call %d", i)
			}
			require.EqualValues(t, 1, runs.Load())
			require.Equal(t, 1, db.Count(t, `SELECT count(*) FROM `+pgx.Identifier{db.Schema, idempotency.DefaultTable}.Sanitize()), "the key is in the store's table")
			if tenantHasKeyTable {
				require.Equal(t, 0, db.Count(t, `SELECT count(*) FROM `+pgx.Identifier{tenant, idempotency.DefaultTable}.Sanitize()), "not in the tenant's")
			}
			require.Equal(t, 1, db.Count(t, `SELECT count(*) FROM `+pgx.Identifier{tenant, "ledger"}.Sanitize()))
		})
	}
}

// A session setting of the handler's own (a tenant, as row-level-security
// set-ups keep one) set by SQL the engine cannot read as set_config costs
// the connection, like set_config: the next calls on a pool of one start
// from a session as the pool made it.
func TestHiddenSetConfigCostsAReset(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name string
		sql  string
		next int // innocent calls after it; each must see no tenant
	}{
		{
			name: "set_config named by a Unicode-escaped identifier",
			sql:  `SELECT U&"\0073et_config"('app.tenant', 'acme', false)`,
			next: 1,
		},
		{
			// Had the connection gone back to the pool as the handler left
			// it, each would see tenant-a.
			name: "set_config in SQL text that a built-in function runs (query_to_xml)",
			sql:  `SELECT query_to_xml('SELECT set_config(''app.tenant'', ''tenant-a'', false)', false, false, '')`,
			next: 3,
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			_, store := onePool(t)
			_, err := execString(store, "a", func(ctx context.Context, tx pgx.Tx) (string, error) {
				_, err := tx.Exec(ctx, tc.sql)
				return "a", err
			})
			require.NoError(t, err)
			var seen []string
			for i := range tc.next {
				res, err := execString(store, fmt.Sprintf("b%d", i), func(ctx context.Context, tx pgx.Tx) (string, error) {
					var tenant string
					err := tx.QueryRow(ctx, `SELECT coalesce(current_setting('app.tenant', true), '')`).Scan(&tenant)
					return tenant, err
				})
				require.NoError(t, err)
				seen = append(seen, res.Response.(*wrapperspb.StringValue).GetValue())
			}
			require.Equal(t, make([]string, tc.next), seen, "innocent calls see the session setting another call's handler made")
		})
	}
}

// A statement a handler prepares by name with tx.Prepare would stay
// prepared on the pooled connection: the connection is closed instead, and
// the next call prepares the same name afresh.
func TestNamedPrepareCostsAReset(t *testing.T) {
	t.Parallel()
	db, store := onePool(t)
	_, err := execString(store, "a", func(ctx context.Context, tx pgx.Tx) (string, error) {
		if _, err := tx.Prepare(ctx, "add_note", `INSERT INTO ledger (note) VALUES ($1)`); err != nil {
			return "", err
		}
		_, err := tx.Exec(ctx, "add_note", "a")
		return "a", err
	})
	require.NoError(t, err)
	var leftOver []string
	_, err = execString(store, "b", func(ctx context.Context, tx pgx.Tx) (string, error) {
		rows, err := tx.Query(ctx, `SELECT name FROM pg_prepared_statements WHERE name = 'add_note'`)
		if err != nil {
			return "", err
		}
		leftOver, err = pgx.CollectRows(rows, pgx.RowTo[string])
		if err != nil {
			return "", err
		}
		if _, err := tx.Prepare(ctx, "add_note", `INSERT INTO ledger (note) VALUES ($1) RETURNING id`); err != nil {
			return "", err
		}
		_, err = tx.Exec(ctx, "add_note", "b")
		return "b", err
	})
	t.Logf("prepared statements of call a seen by call b: %v", leftOver)
	require.NoError(t, err, "an innocent call fails on the statement call a's handler prepared")
	require.Equal(t, 2, db.Count(t, `SELECT count(*) FROM ledger`))
}

// A temporary table created by a function the handler calls (the engine
// cannot read its body) is seen by the session's temporary schema
// appearing during the call: the connection is closed, and the next call
// creates its own scratch table.
func TestTemporaryObjectFromAFunctionCostsAReset(t *testing.T) {
	t.Parallel()
	db, store := onePool(t)
	ctx := context.Background()
	_, err := db.Pool.Exec(ctx, `CREATE FUNCTION stage() RETURNS void LANGUAGE plpgsql AS $$ BEGIN EXECUTE 'CREATE TEMPORARY TABLE scratch (x int)'; END $$`)
	require.NoError(t, err)
	_, err = execString(store, "a", func(ctx context.Context, tx pgx.Tx) (string, error) {
		_, err := tx.Exec(ctx, `SELECT stage()`)
		return "a", err
	})
	require.NoError(t, err)
	_, err = execString(store, "b", func(ctx context.Context, tx pgx.Tx) (string, error) {
		_, err := tx.Exec(ctx, `CREATE TEMPORARY TABLE scratch (x int) ON COMMIT DROP`)
		return "b", err
	})
	require.NoError(t, err, "an innocent call fails on the temporary table of call a's handler")
}

// A session-level advisory lock taken through query_to_xml does not
// outlive the call: the round trip that commits it releases the session's
// advisory locks.
func TestSessionAdvisoryLockDoesNotOutliveTheCall(t *testing.T) {
	t.Parallel()
	db := testdb.New(t, 2)
	store := migratedStore(t, db)
	createLedger(t, db)
	_, err := execString(store, "a", func(ctx context.Context, tx pgx.Tx) (string, error) {
		_, err := tx.Exec(ctx, `SELECT query_to_xml('SELECT pg_advisory_lock(987654321)', false, false, '')`)
		return "a", err
	})
	require.NoError(t, err)
	// Another session gets the lock, never while a pooled connection holds
	// it (the wait would end at lock_timeout).
	ctx := context.Background()
	tx, err := testdb.Admin(t).Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(ctx) }()
	_, err = tx.Exec(ctx, fmt.Sprintf(`SET LOCAL lock_timeout = '%dms'`, liveness.Milliseconds()))
	require.NoError(t, err)
	_, err = tx.Exec(ctx, `SELECT pg_advisory_xact_lock(987654321)`)
	require.NoError(t, err, "the advisory lock call a's handler took is still held by a pooled connection")
}

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
