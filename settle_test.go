package idempotency_test

import (
	"context"
	"encoding/binary"
	"fmt"
	"math/rand/v2"
	"net"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/exactlyonce/idempotency"
	"github.com/exactlyonce/idempotency/internal/testdb"
)

// A handler whose first attempt ends the call's transaction in a way the
// SQL check, switched off here, would have refused, and then is cut: its
// context ends (and pgx closes the connection under a statement still
// running), or it returns an error of its own. Before the engine tells its
// caller "released" (nothing committed, a retry is safe), it makes sure:
// on the attempt's connection, that the transaction it rolls back is still
// the claim's, or, in a failed transaction block, which hides that, whether
// the claim's transaction committed; without it, by ending the attempt's
// session and reading whether the claim's transaction committed. The
// caller gets the truth: the stored error when the claim committed or the
// session had left the call's transaction, the same as a caller that came
// meanwhile, and every later caller gets the same. Then 16
// callers of the key at once: the handler never runs again for a key
// whose first attempt may have committed anything.
func TestCutAttemptToldTheTruth(t *testing.T) {
	t.Parallel()
	for _, tc := range cutCases() {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			var db *testdb.DB
			storeOpts := []idempotency.StoreOption{idempotency.WithInProgressWait(liveness), idempotency.WithoutSQLCheck()}
			var pool *pgxpool.Pool
			// A stubborn wait survives the cancel request pgx sends once it
			// gives up on the statement, which the network loses here: the
			// postmaster signals a backend twice for one request, and a
			// second signal that lands in the wait's exception handler ends
			// the statement after all.
			configure := func(cfg *pgxpool.Config) {
				if strings.Contains(tc.sql, "{stubborn wait}") {
					loseCancelRequests(cfg)
				}
			}
			if tc.bounced {
				db = testdb.New(t, 4)
				pool = bouncedPoolWith(t, configure)
				storeOpts = append(storeOpts, idempotency.WithTable(db.Schema, idempotency.DefaultTable))
			} else {
				db = testdb.NewConfigured(t, func(cfg *pgxpool.Config) {
					cfg.MaxConns = 20
					configure(cfg)
				})
				pool = db.Pool
			}
			migratedStore(t, db)
			createLedger(t, db)
			store, err := idempotency.NewStore(pool, storeOpts...)
			require.NoError(t, err)
			ledger := pgx.Identifier{db.Schema, "ledger"}.Sanitize()

			// The test holds an advisory lock that the handler's statement
			// waits for, so that the statement is still running when the
			// attempt is cut.
			lockKey := rand.Int64N(1 << 31)
			holder, err := testdb.Admin(t).Acquire(context.Background())
			require.NoError(t, err)
			t.Cleanup(holder.Release)
			_, err = holder.Exec(context.Background(), `SELECT pg_advisory_lock($1)`, lockKey)
			require.NoError(t, err)
			var unlockOnce sync.Once
			unlock := func() {
				unlockOnce.Do(func() {
					_, err := holder.Exec(context.Background(), `SELECT pg_advisory_unlock($1)`, lockKey)
					require.NoError(t, err)
				})
			}
			t.Cleanup(unlock)
			sql := strings.NewReplacer("{ledger}", ledger, "{wait}", "SELECT pg_advisory_lock({lock})",
				// A wait that outlives the cancel request pgx sends when it
				// closes the connection: the session still runs when the
				// engine looks.
				"{stubborn wait}", `DO $$ BEGIN LOOP BEGIN PERFORM pg_advisory_lock({lock}); EXIT;
EXCEPTION WHEN query_canceled THEN NULL; END; END LOOP; END $$`).Replace(tc.sql)
			sql = strings.ReplaceAll(sql, "{lock}", fmt.Sprint(lockKey))
			waits := strings.Contains(tc.sql, "wait}")

			call := idempotency.Call{Key: "k", Method: "m"}
			type answer struct {
				res idempotency.Result
				err error
			}
			var runs atomic.Int64
			var meanwhile *answer // the caller that came while the first attempt ran
			blocking := make(chan struct{})
			cut := newGate()
			var fn idempotency.Func
			fn = func(ctx context.Context, tx pgx.Tx) (proto.Message, error) {
				if runs.Add(1) > 1 {
					if _, err := tx.Exec(ctx, `INSERT INTO `+ledger+` (note) VALUES ('later run')`); err != nil {
						return nil, err
					}
					return wrapperspb.String("later run"), nil
				}
				if _, err := tx.Exec(ctx, `INSERT INTO `+ledger+` (note) VALUES ('first run')`); err != nil {
					return nil, err
				}
				sctx := ctx
				if tc.ownCancel {
					var cancel context.CancelFunc
					sctx, cancel = context.WithCancel(ctx)
					go func() {
						_ = cut.wait(context.Background())
						cancel()
					}()
				}
				if waits {
					close(blocking) // the test waits for the statement to wait for its lock
					_, err := tx.Exec(sctx, sql, pgx.QueryExecModeSimpleProtocol)
					return wrapperspb.String("first run"), err
				}
				var err error
				if tc.onConn {
					_, err = tx.Conn().Exec(sctx, sql, pgx.QueryExecModeSimpleProtocol)
				} else {
					_, err = tx.Exec(sctx, sql, pgx.QueryExecModeSimpleProtocol)
				}
				if fails := tc.code != codes.Unavailable || tc.fails; fails != (err != nil) {
					t.Errorf("the handler's SQL: %v, want it to fail: %v", err, fails)
				}
				if tc.meanwhile {
					res, err := store.Execute(context.Background(), call, fn)
					meanwhile = &answer{res, err}
				}
				if tc.code == codes.Unavailable {
					return nil, status.Error(codes.Unavailable, "a downstream service is down") // released, unless something committed
				}
				close(blocking)
				<-ctx.Done() // the handler goes on until its deadline
				return nil, ctx.Err()
			}

			cue := newDeadlineCue()
			ctx := cue.wrap(context.Background())
			first := make(chan answer, 1)
			go func() {
				res, err := store.Execute(ctx, call, fn)
				first <- answer{res, err}
			}()
			var pid int64
			if tc.code != codes.Unavailable {
				await(t, blocking, "the handler to block")
				if waits {
					require.Eventually(t, func() bool {
						err := testdb.Admin(t).QueryRow(context.Background(), `SELECT pid FROM pg_locks
WHERE locktype = 'advisory' AND NOT granted AND classid = 0 AND objid = $1 AND objsubid = 1`, lockKey).Scan(&pid)
						return err == nil
					}, liveness, time.Millisecond, "the handler's statement to wait")
				}
				if tc.ownCancel {
					cut.open()
				} else {
					cue.expire()
				}
			}
			got := await(t, first, "the first caller")

			// Whatever the attempt's session was still running goes on now,
			// unless the engine ended it; it is gone before the next callers
			// come.
			unlock()
			if pid != 0 {
				require.Eventually(t, func() bool {
					return db.Count(t, `SELECT count(*) FROM pg_stat_activity WHERE pid = $1`, pid) == 0
				}, liveness, time.Millisecond, "the first attempt's session to end")
			}

			answers := make([]answer, 16)
			var wg sync.WaitGroup
			for i := range answers {
				wg.Go(func() {
					res, err := store.Execute(context.Background(), call, fn)
					answers[i] = answer{res, err}
				})
			}
			wg.Wait()

			if tc.stored == "" {
				// Nothing committed: the caller was told so, and one later
				// caller ran the handler again; the others replay its answer.
				require.Equal(t, idempotency.OutcomeReleased, got.res.Outcome, "%v", got.err)
				require.Equal(t, tc.code, status.Code(got.err), "%v", got.err)
				require.EqualValues(t, 2, runs.Load(), "the handler ran once more, for a key released")
				executed := 0
				for _, a := range answers {
					require.NoError(t, a.err)
					if a.res.Outcome == idempotency.OutcomeExecuted {
						executed++
					}
					require.True(t, proto.Equal(wrapperspb.String("later run"), a.res.Response))
				}
				require.Equal(t, 1, executed)
				require.Equal(t, 1, db.Count(t, `SELECT count(*) FROM `+ledger), "the later run's row alone")
				return
			}
			// The first caller got what every later caller gets: the error
			// stored for the key, byte for byte.
			require.NotEqual(t, idempotency.OutcomeReleased, got.res.Outcome, "told released: %v", got.err)
			requireStoredInternal(t, got.err, tc.stored)
			want := statusBytes(t, got.err)
			if tc.meanwhile {
				require.Equal(t, idempotency.OutcomeReplayed, meanwhile.res.Outcome, "the caller that came meanwhile: %v", meanwhile.err)
				require.Equal(t, want, statusBytes(t, meanwhile.err), "the caller that came meanwhile and the first: one answer")
			}
			for i, a := range answers {
				require.Equal(t, idempotency.OutcomeReplayed, a.res.Outcome, "caller %d: %v", i, a.err)
				require.Equal(t, want, statusBytes(t, a.err), "caller %d: one answer for every caller", i)
			}
			require.EqualValues(t, 1, runs.Load(), "the handler ran once")
			require.Equal(t, tc.ledger, db.Count(t, `SELECT count(*) FROM `+ledger))
			requireNoKeyLocks(t, db, "", []string{"k"}, "no lock outlives the calls")
		})
	}
}

// cutCase is one way a handler's first attempt ends.
type cutCase struct {
	name string
	// sql is what the handler sends after its first write, in the simple
	// protocol. {ledger} is the ledger table; {wait} waits for an advisory
	// lock the test holds until the attempt has answered, which the
	// attempt's deadline cuts; {stubborn wait} too, and survives the
	// cancel request pgx sends (see loseCancelRequests). Without a wait, PostgreSQL refuses sql (or
	// a statement of it fails) and the handler waits for its deadline, or
	// (code Unavailable) the handler returns an error of its own once sql
	// ran, or failed (fails).
	sql   string
	fails bool
	// meanwhile: once sql has run (or failed), the handler waits for a
	// caller of the key to be answered.
	meanwhile bool
	// ownCancel: the handler cancels its own context, not the caller.
	ownCancel bool
	// onConn: sql goes through tx.Conn(), which the SQL check never reads.
	onConn  bool
	bounced bool // through PgBouncer
	// stored: what the key's stored Internal error says; "" when nothing
	// committed and the key is released, the caller told code.
	stored string
	code   codes.Code
	ledger int // business rows committed in the end
}

func cutCases() []cutCase {
	const ended = "ended the call's transaction"
	chained := `ROLLBACK AND CHAIN; INSERT INTO {ledger} (note) VALUES ('chained'); {stubborn wait}; COMMIT`
	failedBlock := `COMMIT AND CHAIN; SELECT 1/0`
	// In one query string, the statements after a ROLLBACK run in an
	// implicit transaction block, which a BEGIN would make part of the
	// failed one: the COMMIT commits the write first.
	leftBlock := `ROLLBACK; INSERT INTO {ledger} (note) VALUES ('outside'); COMMIT; BEGIN; SELECT 1/0`
	return []cutCase{
		{name: "COMMIT AND CHAIN", sql: `COMMIT AND CHAIN; {wait}`, stored: ended, ledger: 1},
		{name: "COMMIT AND CHAIN, the session still running", sql: `COMMIT AND CHAIN; {stubborn wait}`, stored: ended, ledger: 1},
		{name: "COMMIT AND CHAIN, through PgBouncer", sql: `COMMIT AND CHAIN; {stubborn wait}`, bounced: true, stored: ended, ledger: 1},
		{name: "COMMIT AND CHAIN, the handler cancelling its own context", sql: `COMMIT AND CHAIN; {wait}`, ownCancel: true, stored: ended, ledger: 1},
		// The session left the call's transaction, and would commit a write
		// of its own once the wait is over: the engine ends it first.
		{name: "ROLLBACK AND CHAIN, then a COMMIT after the wait", sql: chained, stored: ended},
		// Behind a pooler the engine cannot tell the session's own later
		// transactions from another client's on the same server
		// connection, and ends neither: the write commits once the wait
		// is over, and the key keeps the error that says the handler left
		// the call's transaction, so that it never runs again.
		{name: "ROLLBACK AND CHAIN, then a COMMIT after the wait, through PgBouncer", sql: chained, bounced: true, stored: ended, ledger: 1},
		{name: "ROLLBACK, then a write and the wait outside the call's transaction",
			sql: `ROLLBACK; INSERT INTO {ledger} (note) VALUES ('outside'); {stubborn wait}`, stored: ended},
		// Not cut: the handler returns an error of its own once it has left
		// the call's transaction, and committed a write outside it.
		{name: "ROLLBACK AND CHAIN, a write, COMMIT AND CHAIN, then an error",
			sql: `ROLLBACK AND CHAIN; INSERT INTO {ledger} (note) VALUES ('chained'); COMMIT AND CHAIN`, code: codes.Unavailable, stored: ended, ledger: 1},
		// The claim committed, and the session is left in a failed block
		// of the transaction that followed, where nothing can be asked of
		// it but a ROLLBACK: the handler returns an error of its own, or
		// waits for its deadline.
		{name: "COMMIT AND CHAIN, a failing statement, then an error", sql: failedBlock, fails: true, code: codes.Unavailable, stored: ended, ledger: 1},
		{name: "COMMIT AND CHAIN, a failing statement, then the deadline", sql: failedBlock, stored: ended, ledger: 1},
		// The session left the call's transaction, committed a write of
		// its own outside it, and began another transaction, which a
		// failing statement left as a failed block: the claim's
		// transaction rolled back, but the attempt did not stay in it.
		{name: "ROLLBACK, a write committed outside, BEGIN, a failing statement, then an error",
			sql: leftBlock, fails: true, code: codes.Unavailable, stored: ended, ledger: 1},
		{name: "ROLLBACK, a write committed outside, BEGIN, a failing statement, then the deadline",
			sql: leftBlock, stored: ended, ledger: 1},
		{name: "ROLLBACK, a write committed outside, BEGIN, a failing statement on tx.Conn(), then an error",
			sql: leftBlock, onConn: true, fails: true, code: codes.Unavailable, stored: ended, ledger: 1},
		{name: "ROLLBACK AND CHAIN, a write, COMMIT AND CHAIN, a failing statement, then an error",
			sql: `ROLLBACK AND CHAIN; INSERT INTO {ledger} (note) VALUES ('chained'); COMMIT AND CHAIN; SELECT 1/0`, fails: true, code: codes.Unavailable, stored: ended, ledger: 1},
		{name: "ROLLBACK, a write committed outside, BEGIN, a failing statement, then an error, through PgBouncer",
			sql: leftBlock, fails: true, code: codes.Unavailable, bounced: true, stored: ended, ledger: 1},
		// A caller that comes meanwhile finds the claim committed, and
		// settles it with the error that says so.
		{name: "COMMIT AND CHAIN, a failing statement, a caller meanwhile, then an error",
			sql: failedBlock, fails: true, meanwhile: true, code: codes.Unavailable, stored: ended, ledger: 1},
		{name: "COMMIT AND CHAIN, a failing statement, a caller meanwhile, then an error, through PgBouncer",
			sql: failedBlock, fails: true, meanwhile: true, code: codes.Unavailable, bounced: true, stored: ended, ledger: 1},
		{name: "COMMIT AND CHAIN, a failing statement, a caller meanwhile, then the deadline", sql: failedBlock, meanwhile: true, stored: ended, ledger: 1},
		{name: "COMMIT AND CHAIN, a failing statement, a caller meanwhile, then the deadline, through PgBouncer",
			sql: failedBlock, meanwhile: true, bounced: true, stored: ended, ledger: 1},
		// Inside the call's transaction to the end: the truth is "released".
		{name: "a statement cut inside the call's transaction", sql: `{wait}`, code: codes.DeadlineExceeded},
		{name: "a statement cut inside the call's transaction, the session still running", sql: `{stubborn wait}`, code: codes.DeadlineExceeded},
		{name: "a statement cut inside the call's transaction, through PgBouncer", sql: `{stubborn wait}`, bounced: true, code: codes.DeadlineExceeded},
		{name: "a COMMIT in a procedure (CALL), which PostgreSQL refuses in a transaction block",
			sql:  `CREATE PROCEDURE commits() LANGUAGE plpgsql AS $$ BEGIN INSERT INTO {ledger} (note) VALUES ('procedure'); COMMIT; END $$; CALL commits()`,
			code: codes.DeadlineExceeded},
		// A PREPARE TRANSACTION that fails (prepared transactions disabled,
		// or the session's and the transaction's lock on the key) rolls the
		// transaction back: the handler ended it.
		{name: "PREPARE TRANSACTION", sql: `PREPARE TRANSACTION 'cut'`, stored: ended},
	}
}

// statusBytes is err's status as a client gets it (code, message,
// details), encoded.
func statusBytes(t testing.TB, err error) []byte {
	t.Helper()
	b, err := proto.MarshalOptions{Deterministic: true}.Marshal(status.Convert(err).Proto())
	require.NoError(t, err)
	return b
}

// A handler that plays with savepoints of its own (named ones, nested
// transactions through tx.Begin, ROLLBACK TO and RELEASE of its own, names
// like the engine's, a failed statement) and then returns a final error:
// the error is stored, none of the handler's writes is committed, and the
// handler runs once, while 16 duplicates of the key wait for it; directly,
// at READ COMMITTED and SERIALIZABLE, and behind PgBouncer.
func TestFinalErrorUndoesTheHandlersOwnSavepoints(t *testing.T) {
	t.Parallel()
	for _, where := range []struct {
		name      string
		bounced   bool
		isolation pgx.TxIsoLevel
	}{{name: "directly"}, {name: "directly, at SERIALIZABLE", isolation: pgx.Serializable}, {name: "through PgBouncer", bounced: true}} {
		for _, tc := range handlerSavepointCases() {
			t.Run(where.name+", "+tc.name, func(t *testing.T) {
				t.Parallel()
				// The duplicates that have looked at the key, each by its
				// number in its context.
				var looked sync.Map
				trace := func(cfg *pgxpool.Config) {
					cfg.ConnConfig.Tracer = &testdb.Tracer{OnRoundTrip: func(ctx context.Context, _ *pgx.Conn, statements []string) {
						if n, ok := ctx.Value(duplicateKey{}).(int); ok && strings.Contains(strings.Join(statements, ";"), "pg_try_advisory") {
							looked.Store(n, true)
						}
					}}
				}
				var db *testdb.DB
				var store *idempotency.Store
				var err error
				if where.bounced {
					db = testdb.New(t, 4)
					migratedStore(t, db)
					store, err = idempotency.NewStore(bouncedPoolWith(t, trace), idempotency.WithTable(db.Schema, idempotency.DefaultTable),
						idempotency.WithInProgressWait(liveness))
				} else {
					db = testdb.NewConfigured(t, func(cfg *pgxpool.Config) { cfg.MaxConns = 20; trace(cfg) })
					store, err = idempotency.NewStore(db.Pool, idempotency.WithInProgressWait(liveness))
					if err == nil {
						err = store.Migrate(context.Background())
					}
				}
				require.NoError(t, err)
				createLedger(t, db)
				ledger := pgx.Identifier{db.Schema, "ledger"}.Sanitize()

				var runs atomic.Int64
				release := newGate()
				handling := make(chan struct{})
				call := idempotency.Call{Key: "k", Method: "m", Isolation: where.isolation}
				fn := func(ctx context.Context, tx pgx.Tx) (proto.Message, error) {
					if runs.Add(1) > 1 {
						return wrapperspb.String("ran again"), nil
					}
					if _, err := tx.Exec(ctx, `INSERT INTO `+ledger+` (note) VALUES ('first')`); err != nil {
						return nil, err
					}
					if err := tc.run(ctx, tx, func(db savepointExecer, sql string) error {
						_, err := db.Exec(ctx, strings.ReplaceAll(sql, "{ledger}", ledger))
						return err
					}); err != nil {
						t.Errorf("the handler's statements: %v", err)
						close(handling)
						return nil, err
					}
					close(handling)
					_ = release.wait(ctx)
					return nil, idempotency.Final(status.Error(codes.NotFound, "no such card"))
				}
				type answer struct {
					res idempotency.Result
					err error
				}
				first := make(chan answer, 1)
				go func() {
					res, err := store.Execute(context.Background(), call, fn)
					first <- answer{res, err}
				}()
				await(t, handling, "the handler to be done with its savepoints")
				duplicates := make([]answer, 16)
				var wg sync.WaitGroup
				for i := range duplicates {
					wg.Go(func() {
						res, err := store.Execute(context.WithValue(context.Background(), duplicateKey{}, i), call, fn)
						duplicates[i] = answer{res, err}
					})
				}
				require.Eventually(t, func() bool {
					n := 0
					looked.Range(func(any, any) bool { n++; return true })
					return n == len(duplicates)
				}, liveness, time.Millisecond, "every duplicate to look at the key")
				release.open()
				got := await(t, first, "the first caller")
				wg.Wait()

				require.Equal(t, idempotency.OutcomeExecuted, got.res.Outcome, "%v", got.err)
				require.Equal(t, codes.NotFound, status.Code(got.err), "%v", got.err)
				require.True(t, idempotency.IsFinal(got.err), "stored: %v", got.err)
				for i, d := range duplicates {
					require.Equal(t, idempotency.OutcomeReplayed, d.res.Outcome, "duplicate %d: %v", i, d.err)
					require.Equal(t, statusBytes(t, got.err), statusBytes(t, d.err), "duplicate %d: one answer for every caller", i)
				}
				require.EqualValues(t, 1, runs.Load(), "the handler ran once")
				require.Zero(t, db.Count(t, `SELECT count(*) FROM `+ledger), "none of the handler's writes committed")
				require.Equal(t, "failed", keyState(t, db, "k"))
				requireNoKeyLocks(t, db, "", []string{"k"}, "no lock outlives the calls")
			})
		}
	}
}

// duplicateKey numbers a duplicate's context, for the pool's tracer.
type duplicateKey struct{}

// savepointExecer is what runs a handler's SQL: the call's transaction, a
// nested one, or the connection.
type savepointExecer interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
}

// handlerSavepointCase is what a handler does with savepoints after its
// first write, before it returns a final error. exec runs sql on db,
// {ledger} standing for the ledger table.
type handlerSavepointCase struct {
	name string
	run  func(ctx context.Context, tx pgx.Tx, exec func(db savepointExecer, sql string) error) error
}

func handlerSavepointCases() []handlerSavepointCase {
	const write = `INSERT INTO {ledger} (note) VALUES ('more')`
	each := func(db savepointExecer, exec func(savepointExecer, string) error, sqls ...string) error {
		for _, sql := range sqls {
			if err := exec(db, sql); err != nil {
				return fmt.Errorf("%s: %w", sql, err)
			}
		}
		return nil
	}
	// fails runs sql, which must fail.
	fails := func(db savepointExecer, exec func(savepointExecer, string) error, sql string) error {
		if err := exec(db, sql); err == nil {
			return fmt.Errorf("%s did not fail", sql)
		}
		return nil
	}
	return []handlerSavepointCase{
		{name: "a savepoint of its own, a write after it", run: func(ctx context.Context, tx pgx.Tx, exec func(savepointExecer, string) error) error {
			return each(tx, exec, `SAVEPOINT mine`, write)
		}},
		{name: "ROLLBACK TO its own savepoint, a write after it", run: func(ctx context.Context, tx pgx.Tx, exec func(savepointExecer, string) error) error {
			return each(tx, exec, `SAVEPOINT mine`, write, `ROLLBACK TO SAVEPOINT mine`, write)
		}},
		{name: "RELEASE of its outer savepoint, a nested one in it", run: func(ctx context.Context, tx pgx.Tx, exec func(savepointExecer, string) error) error {
			return each(tx, exec, `SAVEPOINT outer_one`, write, `SAVEPOINT inner_one`, write, `RELEASE SAVEPOINT outer_one`, write)
		}},
		{name: "savepoints named like the engine's", run: func(ctx context.Context, tx pgx.Tx, exec func(savepointExecer, string) error) error {
			return each(tx, exec, `SAVEPOINT idempotency_sp_1`, write, `SAVEPOINT U&"idempotency_claim"`, write,
				`ROLLBACK TO SAVEPOINT idempotency_sp_1`, write, `SAVEPOINT idempotency_claim`, write)
		}},
		{name: "nested transactions (tx.Begin), a write in each, left open", run: func(ctx context.Context, tx pgx.Tx, exec func(savepointExecer, string) error) error {
			outer, err := tx.Begin(ctx)
			if err != nil {
				return err
			}
			if err := exec(outer, write); err != nil {
				return err
			}
			inner, err := outer.Begin(ctx)
			if err != nil {
				return err
			}
			return exec(inner, write)
		}},
		{name: "a nested transaction committed, another rolled back", run: func(ctx context.Context, tx pgx.Tx, exec func(savepointExecer, string) error) error {
			for _, commit := range []bool{true, false} {
				nested, err := tx.Begin(ctx)
				if err != nil {
					return err
				}
				if err := exec(nested, write); err != nil {
					return err
				}
				end := nested.Rollback
				if commit {
					end = nested.Commit
				}
				if err := end(ctx); err != nil {
					return err
				}
			}
			return exec(tx, write)
		}},
		{name: "a failed statement in a nested transaction, rolled back", run: func(ctx context.Context, tx pgx.Tx, exec func(savepointExecer, string) error) error {
			nested, err := tx.Begin(ctx)
			if err != nil {
				return err
			}
			if err := exec(nested, write); err != nil {
				return err
			}
			if err := fails(nested, exec, `SELECT 1/0`); err != nil {
				return err
			}
			if err := nested.Rollback(ctx); err != nil {
				return err
			}
			return exec(tx, write)
		}},
		{name: "a savepoint, then a failed statement that leaves the call's transaction aborted", run: func(ctx context.Context, tx pgx.Tx, exec func(savepointExecer, string) error) error {
			if err := each(tx, exec, `SAVEPOINT mine`, write); err != nil {
				return err
			}
			return fails(tx, exec, `SELECT 1/0`)
		}},
		{name: "savepoints on tx.Conn()", run: func(ctx context.Context, tx pgx.Tx, exec func(savepointExecer, string) error) error {
			return each(tx.Conn(), exec, `SAVEPOINT mine`, write, `ROLLBACK TO mine`, write, `SAVEPOINT idempotency_sp_1`, write)
		}},
	}
}

// At SERIALIZABLE a final error commits in the call's transaction, whose
// reads PostgreSQL counts even once rolled back to a savepoint: a final
// error the handler decided on reads that do not serialize with the
// transactions around it is answered as its writes would be, Aborted,
// nothing stored, and the retry runs the handler again. Here the handler
// writes a row another open SERIALIZABLE transaction has read, and reads a
// table a third one then writes and commits.
func TestSerializableFinalErrorOnReadsThatDoNotSerialize(t *testing.T) {
	t.Parallel()
	db := testdb.New(t, 4)
	store := migratedStore(t, db)
	createLedger(t, db)
	ctx := context.Background()
	_, err := db.Pool.Exec(ctx, `CREATE TABLE cards (n int); CREATE TABLE audit (n int)`)
	require.NoError(t, err)
	reader, err := db.Pool.Acquire(ctx)
	require.NoError(t, err)
	defer reader.Release()
	// An open transaction that read the ledger and wrote elsewhere.
	_, err = reader.Exec(ctx, `BEGIN ISOLATION LEVEL SERIALIZABLE; SELECT count(*) FROM ledger; INSERT INTO audit VALUES (1)`)
	require.NoError(t, err)

	var runs atomic.Int64
	call := idempotency.Call{Key: "k", Method: "m", Isolation: pgx.Serializable}
	fn := func(ctx context.Context, tx pgx.Tx) (proto.Message, error) {
		n := runs.Add(1)
		if _, err := tx.Exec(ctx, `INSERT INTO ledger (note) VALUES ('charge')`); err != nil {
			return nil, err
		}
		var cards int
		if err := tx.QueryRow(ctx, `SELECT count(*) FROM cards`).Scan(&cards); err != nil {
			return nil, err
		}
		if n == 1 {
			// A card added, and committed, once the handler has read none.
			w, err := db.Pool.Begin(ctx)
			if err == nil {
				_, err = w.Exec(ctx, `SET TRANSACTION ISOLATION LEVEL SERIALIZABLE; INSERT INTO cards VALUES (1)`)
			}
			if err == nil {
				err = w.Commit(ctx)
			}
			require.NoError(t, err)
		}
		return nil, idempotency.Final(status.Errorf(codes.NotFound, "%d cards", cards))
	}
	res, err := store.Execute(ctx, call, fn)
	require.Equal(t, idempotency.OutcomeReleased, res.Outcome, "%v", err)
	require.Equal(t, codes.Aborted, status.Code(err), "%v", err)
	require.False(t, idempotency.IsFinal(err), "nothing stored: %v", err)
	require.Equal(t, "", keyState(t, db, "k"))
	require.Zero(t, db.Count(t, `SELECT count(*) FROM ledger`))

	_, err = reader.Exec(ctx, `ROLLBACK`)
	require.NoError(t, err)
	res, err = store.Execute(ctx, call, fn)
	require.Equal(t, idempotency.OutcomeExecuted, res.Outcome, "%v", err)
	require.Equal(t, codes.NotFound, status.Code(err), "%v", err)
	require.Equal(t, "1 cards", status.Convert(err).Message(), "the retry read the committed card")
	require.EqualValues(t, 2, runs.Load())
	res, err = store.Execute(ctx, call, fn)
	require.Equal(t, idempotency.OutcomeReplayed, res.Outcome, "%v", err)
	require.Equal(t, codes.NotFound, status.Code(err))
	require.EqualValues(t, 2, runs.Load())
	require.Zero(t, db.Count(t, `SELECT count(*) FROM ledger`))
}

// loseCancelRequests makes the network lose every cancel request a pool
// configured by cfg sends: the request's connection is made, and what is
// written to it never arrives.
func loseCancelRequests(cfg *pgxpool.Config) {
	dial := cfg.ConnConfig.DialFunc
	cfg.ConnConfig.DialFunc = func(ctx context.Context, network, addr string) (net.Conn, error) {
		c, err := dial(ctx, network, addr)
		if err != nil {
			return nil, err
		}
		return &cancelLosingConn{Conn: c}, nil
	}
}

// cancelLosingConn drops a cancel request, the first message of its
// connection (protocol code 80877102), and closes the connection, as a
// server that processed it would.
type cancelLosingConn struct {
	net.Conn
	wrote bool
}

func (c *cancelLosingConn) Write(p []byte) (int, error) {
	if !c.wrote {
		c.wrote = true
		if len(p) >= 8 && binary.BigEndian.Uint32(p[4:8]) == 80877102 {
			_ = c.Conn.Close()
			return len(p), nil
		}
	}
	return c.Conn.Write(p)
}
