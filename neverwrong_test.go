package idempotency_test

import (
	"bytes"
	"compress/gzip"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protodesc"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/reflect/protoregistry"
	"google.golang.org/protobuf/types/descriptorpb"
	"google.golang.org/protobuf/types/dynamicpb"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/exactlyonce/idempotency"
	"github.com/exactlyonce/idempotency/internal/testdb"
)

// Whatever the client sends and whatever the handler does, a key with a
// stored result never runs again, and every caller of a key gets the same
// answer: the defects of engine v2 that broke it, one test each.

// A service mesh resends a request exactly as it was first sent, markers
// included: a finished key must replay, and the handler (whose second run
// would fail on its own unique constraint, or call a payment provider
// again) must not run.
func TestProxyResendOfAFinishedCallNeverRunsTheHandler(t *testing.T) {
	t.Parallel()
	var e *env
	e = newEnv(t, envConfig{handler: func(ctx context.Context, req *wrapperspb.StringValue) (*wrapperspb.StringValue, error) {
		// One charge per order: a second run fails on the unique index.
		if _, err := idempotency.MustTxFromContext(ctx).Exec(ctx, `INSERT INTO charges (order_id) VALUES ($1)`, req.GetValue()); err != nil {
			return nil, err
		}
		return e.insertLedger(ctx, req)
	}})
	_, err := e.db.Pool.Exec(context.Background(), `CREATE TABLE charges (order_id text PRIMARY KEY)`)
	require.NoError(t, err)
	// As a client of the previous release sent its generated keys.
	sent := metadata.Pairs(idempotency.MetadataKey, "k", "idempotency-key-new", "true", "x-request-id", "r-1")
	ctx := metadata.NewOutgoingContext(context.Background(), sent)
	first := invoke(ctx, e.conn, methodCharge, "order-1")
	require.NoError(t, first.err)
	for i := 0; i < 3; i++ {
		again := invoke(ctx, e.conn, methodCharge, "order-1")
		require.NoError(t, again.err, "the stored success, not the handler's second-run error")
		require.True(t, again.replayed)
		require.Equal(t, first.raw, again.raw)
	}
	require.EqualValues(t, 1, e.runs.Load(), "the handler ran once")
	require.Equal(t, 1, e.ledgerRows())
}

// A COMMIT the handler sends while a duplicate arrives: through tx it never
// reaches PostgreSQL; through tx.Conn() it does, but the key stays locked
// for the session until the engine has stored the call's error. Either way
// the duplicate waits and gets that error; the handler runs once.
func TestHandlerCommitWithAConcurrentDuplicateRunsOnce(t *testing.T) {
	t.Parallel()
	for name, tc := range map[string]struct {
		commit     func(ctx context.Context, tx pgx.Tx) error
		ledgerRows int
		pool       func(*pgxpool.Config)
	}{
		"through tx": {commit: func(ctx context.Context, tx pgx.Tx) error {
			_, err := tx.Exec(ctx, `INSERT INTO ledger (note) VALUES ('x'); COMMIT`)
			return err
		}},
		"through tx, after a comment ended by a carriage return": {commit: func(ctx context.Context, tx pgx.Tx) error {
			_, err := tx.Exec(ctx, "INSERT INTO ledger (note) VALUES ('x'); --\rCOMMIT")
			return err
		}},
		"through tx, standard_conforming_strings off": {commit: func(ctx context.Context, tx pgx.Tx) error {
			if _, err := tx.Exec(ctx, `SET LOCAL standard_conforming_strings = off`); err == nil {
				return errors.New("standard_conforming_strings was not refused")
			}
			_, err := tx.Exec(ctx, `INSERT INTO ledger (note) VALUES ('x'); SELECT '\'' ; COMMIT; --'`)
			return err
		}},
		"through tx, by the name of a statement prepared on the connection": {
			commit: func(ctx context.Context, tx pgx.Tx) error {
				_, err := tx.Exec(ctx, "finish_batch")
				return err
			},
			pool: func(cfg *pgxpool.Config) {
				cfg.AfterConnect = func(ctx context.Context, c *pgx.Conn) error {
					_, err := c.Prepare(ctx, "finish_batch", "COMMIT")
					return err
				}
			},
		},
		"through tx, made by a query rewriter": {commit: func(ctx context.Context, tx pgx.Tx) error {
			_, err := tx.Exec(ctx, `INSERT INTO ledger (note) VALUES ('x')`, rewriteTo(`INSERT INTO ledger (note) VALUES ('x'); COMMIT`))
			return err
		}},
		"through tx.Conn()": {commit: func(ctx context.Context, tx pgx.Tx) error {
			_, err := tx.Conn().Exec(ctx, `INSERT INTO ledger (note) VALUES ('x'); COMMIT`)
			return err
		}, ledgerRows: 1},
		"through the Conn of the call's rows": {commit: func(ctx context.Context, tx pgx.Tx) error {
			rows, err := tx.Query(ctx, `SELECT 1`)
			if err != nil {
				return err
			}
			conn := rows.Conn()
			rows.Close()
			_, err = conn.Exec(ctx, `INSERT INTO ledger (note) VALUES ('x'); COMMIT`)
			return err
		}, ledgerRows: 1},
		"through the Conn of rows handed to a batch's callback": {commit: func(ctx context.Context, tx pgx.Tx) error {
			var conn *pgx.Conn
			b := &pgx.Batch{}
			b.Queue(`SELECT 1`).Query(func(rows pgx.Rows) error { conn = rows.Conn(); return nil })
			if err := tx.SendBatch(ctx, b).Close(); err != nil {
				return err
			}
			_, err := conn.Exec(ctx, `INSERT INTO ledger (note) VALUES ('x'); COMMIT`)
			return err
		}, ledgerRows: 1},
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			var tries atomic.Int64 // the engine's lock attempts, counted once the handler has committed
			var committed atomic.Bool
			db := testdb.NewConfigured(t, func(cfg *pgxpool.Config) {
				cfg.ConnConfig.Tracer = &testdb.Tracer{OnRoundTrip: func(_ context.Context, _ *pgx.Conn, statements []string) {
					if committed.Load() && strings.Contains(strings.Join(statements, ";"), "pg_try_advisory") {
						tries.Add(1)
					}
				}}
				if tc.pool != nil {
					tc.pool(cfg)
				}
			})
			store := migratedStore(t, db, idempotency.WithInProgressWait(liveness))
			createLedger(t, db)
			var runs atomic.Int64
			release := make(chan struct{})
			call := idempotency.Call{Key: "k", Method: "m"}
			fn := func(ctx context.Context, tx pgx.Tx) (proto.Message, error) {
				if runs.Add(1) > 1 {
					return wrapperspb.String("second run"), nil
				}
				_ = tc.commit(ctx, tx)
				committed.Store(true)
				select {
				case <-release:
				case <-time.After(liveness):
				}
				return wrapperspb.String("first run"), nil
			}
			first := make(chan error, 1)
			go func() {
				_, err := store.Execute(context.Background(), call, fn)
				first <- err
			}()
			require.Eventually(t, committed.Load, liveness, time.Millisecond, "the handler to commit")
			dup := make(chan error, 1)
			go func() {
				_, err := store.Execute(context.Background(), call, fn)
				dup <- err
			}()
			// The duplicate's claim, then a probe of its wait: it is waiting.
			require.Eventually(t, func() bool { return tries.Load() >= 2 }, liveness, time.Millisecond, "the duplicate to try the key")
			close(release)
			for _, err := range []error{await(t, first, "the first call"), await(t, dup, "the duplicate")} {
				require.Equal(t, codes.Internal, status.Code(err), "%v", err)
				require.True(t, idempotency.IsFinal(err), "the stored error, for both callers")
			}
			require.EqualValues(t, 1, runs.Load(), "the duplicate never ran the handler")
			require.Equal(t, tc.ledgerRows, db.Count(t, `SELECT count(*) FROM ledger`))
		})
	}
}

// rewriteTo is a query rewriter that replaces a statement's SQL with sql.
type rewriteTo string

func (r rewriteTo) RewriteQuery(_ context.Context, _ *pgx.Conn, _ string, args []any) (string, []any, error) {
	return string(r), args, nil
}

// withdraw is a handler that reads an account's balance and writes it back
// less 10: a lost update at READ COMMITTED when two run interleaved.
// Before writing, the first run of each key waits until both keys' first
// runs have read, so that they interleave.
type withdrawal struct {
	read    sync.WaitGroup
	mu      sync.Mutex
	ran     map[string]bool
	levels  []string
	aborted atomic.Int64
}

func newWithdrawal() *withdrawal {
	w := &withdrawal{ran: map[string]bool{}}
	w.read.Add(2)
	return w
}

func (w *withdrawal) run(ctx context.Context, tx pgx.Tx, key string) (proto.Message, error) {
	var balance int
	var level string
	if err := tx.QueryRow(ctx, `SELECT balance, current_setting('transaction_isolation') FROM accounts WHERE id = 1`).Scan(&balance, &level); err != nil {
		return nil, err
	}
	w.mu.Lock()
	first := !w.ran[key]
	w.ran[key] = true
	w.levels = append(w.levels, level)
	w.mu.Unlock()
	if first {
		w.read.Done()
		w.read.Wait()
	}
	_, err := tx.Exec(ctx, `UPDATE accounts SET balance = $1 WHERE id = 1`, balance-10)
	return wrapperspb.String(fmt.Sprint("balance ", balance-10)), err
}

// A database whose default is SERIALIZABLE keeps it: two interleaved
// withdrawals cannot both apply to the same balance; one is Aborted, and
// retried with its key it applies to the new balance.
func TestSerializableDefaultIsHonoured(t *testing.T) {
	t.Parallel()
	db := testdb.NewConfigured(t, func(cfg *pgxpool.Config) {
		cfg.ConnConfig.RuntimeParams["default_transaction_isolation"] = "serializable"
	})
	requireSerializableWithdrawals(t, db, migratedStore(t, db), "")
}

// WithIsolation, and Call.Isolation, raise the level where the database's
// default is READ COMMITTED.
func TestIsolationCanBeChosen(t *testing.T) {
	t.Parallel()
	t.Run("WithIsolation", func(t *testing.T) {
		t.Parallel()
		db := testdb.New(t, 4)
		requireSerializableWithdrawals(t, db, migratedStore(t, db, idempotency.WithIsolation(pgx.Serializable)), "")
	})
	t.Run("Call.Isolation", func(t *testing.T) {
		t.Parallel()
		db := testdb.New(t, 4)
		requireSerializableWithdrawals(t, db, migratedStore(t, db), pgx.Serializable)
	})
	t.Run("REPEATABLE READ", func(t *testing.T) {
		t.Parallel()
		db := testdb.New(t, 4)
		requireSerializableWithdrawals(t, db, migratedStore(t, db), pgx.RepeatableRead)
	})
}

func requireSerializableWithdrawals(t *testing.T, db *testdb.DB, store *idempotency.Store, level pgx.TxIsoLevel) {
	t.Helper()
	ctx := context.Background()
	_, err := db.Pool.Exec(ctx, `CREATE TABLE accounts (id int PRIMARY KEY, balance int NOT NULL); INSERT INTO accounts VALUES (1, 100)`)
	require.NoError(t, err)
	w := newWithdrawal()
	var wg sync.WaitGroup
	for _, key := range []string{"w-1", "w-2"} {
		wg.Add(1)
		go func() {
			defer wg.Done()
			call := idempotency.Call{Key: key, Method: "withdraw", Isolation: level}
			fn := func(ctx context.Context, tx pgx.Tx) (proto.Message, error) { return w.run(ctx, tx, key) }
			for attempt := 0; attempt < 5; attempt++ { // as a client retries Aborted with its key
				_, err := store.Execute(ctx, call, fn)
				if status.Code(err) != codes.Aborted {
					require.NoError(t, err)
					return
				}
				w.aborted.Add(1)
			}
			t.Errorf("%s: still Aborted after 5 attempts", key)
		}()
	}
	wg.Wait()
	require.Equal(t, 80, db.Count(t, `SELECT balance FROM accounts`), "both withdrawals, neither lost")
	require.Positive(t, w.aborted.Load(), "one was Aborted and retried")
	want := "serializable"
	if level == pgx.RepeatableRead {
		want = "repeatable read"
	}
	for _, l := range w.levels {
		require.Equal(t, want, l, "the handler's transaction")
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

// An HTTP client that sends a predictable message ID as its key takes
// nothing from the message: keys of different transports never meet.
func TestHTTPKeyCannotSquatAMessageID(t *testing.T) {
	t.Parallel()
	e := newHTTPEnv(t, nil)
	ctx := context.Background()
	require.Equal(t, http.StatusCreated, e.post("order-7", "http charge").status)
	applied := 0
	for i := 0; i < 2; i++ {
		o, err := e.store.ProcessMessage(ctx, idempotency.Message{ID: "order-7", Body: []byte("message"), Redelivered: i > 0}, func(ctx context.Context, tx pgx.Tx) error {
			applied++
			_, err := tx.Exec(ctx, `INSERT INTO ledger (note, key) VALUES ('message effect', 'order-7')`)
			return err
		})
		require.NoError(t, err)
		require.Equal(t, []idempotency.Outcome{idempotency.OutcomeExecuted, idempotency.OutcomeReplayed}[i], o)
		require.Equal(t, idempotency.Ack, idempotency.DispositionOf(o, err))
	}
	require.Equal(t, 1, applied, "the message's effect happened, once")
	// And the other way round: a gRPC-style direct call with the same key.
	res, err := e.store.Execute(ctx, idempotency.Call{Key: "order-7", Method: "m"}, func(context.Context, pgx.Tx) (proto.Message, error) { return nil, nil })
	require.NoError(t, err)
	require.Equal(t, idempotency.OutcomeExecuted, res.Outcome)
	require.Equal(t, http.StatusCreated, e.post("order-7", "http charge").status)
	rec, err := e.store.Inspect(ctx, "", "order-7")
	require.NoError(t, err)
	require.Equal(t, idempotency.TransportGRPC, rec.Transport, "Inspect looks among gRPC and direct calls first")
	require.Equal(t, 3, e.db.Count(t, `SELECT count(*) FROM idempotency_keys`))
}

// The large objects and savepoints of a call's transaction die with it,
// as pgx's own nested transactions do after their Commit.
func TestLargeObjectsAndSavepointsDieWithTheCall(t *testing.T) {
	t.Parallel()
	db := testdb.New(t, 1) // one connection: the next call gets the same one
	ctx := context.Background()
	store := migratedStore(t, db)
	createLedger(t, db)
	var keptTx, keptSavepoint pgx.Tx
	var keptLO pgx.LargeObjects
	_, err := store.Execute(ctx, idempotency.Call{Key: "first", Method: "m"}, func(ctx context.Context, tx pgx.Tx) (proto.Message, error) {
		keptTx, keptLO = tx, tx.LargeObjects()
		sp, err := tx.Begin(ctx)
		if err != nil {
			return nil, err
		}
		if err := sp.Commit(ctx); err != nil {
			return nil, err
		}
		// A savepoint is closed by its own Commit, as pgx's are.
		if _, err := sp.Exec(ctx, `INSERT INTO ledger (note) VALUES ('after its commit')`); !errors.Is(err, pgx.ErrTxClosed) {
			return nil, fmt.Errorf("savepoint after Commit: %v", err)
		}
		keptSavepoint, err = tx.Begin(ctx)
		return nil, err
	})
	require.NoError(t, err)

	// Large objects with OIDs of their own, to look for them afterwards.
	oid := uint32(1_900_000_000 + time.Now().UnixNano()%100_000_000)
	lo := keptTx.LargeObjects()
	_, err = lo.Create(ctx, oid)
	require.ErrorIs(t, err, pgx.ErrTxClosed, "LargeObjects of a dead transaction")
	_, err = keptLO.Create(ctx, oid+1)
	require.ErrorIs(t, err, pgx.ErrTxClosed, "LargeObjects kept from the call")
	_, err = keptSavepoint.Exec(ctx, `INSERT INTO ledger (note) VALUES ('x')`)
	require.ErrorIs(t, err, pgx.ErrTxClosed, "a savepoint kept from the call")
	spLO := keptSavepoint.LargeObjects()
	_, err = spLO.Create(ctx, oid+2)
	require.ErrorIs(t, err, pgx.ErrTxClosed)

	// Inside another call on the same connection: still dead.
	_, err = store.Execute(ctx, idempotency.Call{Key: "second", Method: "m"}, func(ctx context.Context, tx pgx.Tx) (proto.Message, error) {
		if _, err := keptLO.Create(ctx, oid+3); !errors.Is(err, pgx.ErrTxClosed) {
			return nil, fmt.Errorf("kept large objects inside another call: %v", err)
		}
		if _, err := keptSavepoint.Exec(ctx, `INSERT INTO ledger (note) VALUES ('x')`); !errors.Is(err, pgx.ErrTxClosed) {
			return nil, fmt.Errorf("kept savepoint inside another call: %v", err)
		}
		return nil, nil
	})
	require.NoError(t, err)
	require.Equal(t, 0, db.Count(t, `SELECT count(*) FROM pg_largeobject_metadata WHERE oid::bigint BETWEEN $1 AND $1 + 3`, int64(oid)), "no large object written")
	require.Equal(t, 0, db.Count(t, `SELECT count(*) FROM ledger`))
}

// A COMMIT that fails on a deferred constraint, while a duplicate runs and
// succeeds before the first call stores its error: both callers get one
// answer, the stored one.
func TestDeferredFailureAndADuplicateGetOneAnswer(t *testing.T) {
	t.Parallel()
	storing, stored := make(chan struct{}), make(chan struct{})
	var once sync.Once
	db := testdb.NewConfigured(t, func(cfg *pgxpool.Config) {
		cfg.ConnConfig.Tracer = &testdb.Tracer{OnRoundTrip: func(_ context.Context, _ *pgx.Conn, statements []string) {
			if strings.Contains(strings.Join(statements, ";"), "BEGIN ISOLATION LEVEL READ COMMITTED READ WRITE") {
				// The first call is about to store its error outside its
				// transaction: let the duplicate finish first.
				once.Do(func() {
					close(storing)
					select {
					case <-stored:
					case <-time.After(liveness):
					}
				})
			}
		}}
	})
	ctx := context.Background()
	store := migratedStore(t, db)
	_, err := db.Pool.Exec(ctx, `CREATE TABLE audit (note text UNIQUE DEFERRABLE INITIALLY DEFERRED); INSERT INTO audit VALUES ('taken')`)
	require.NoError(t, err)
	var runs atomic.Int64
	srv := grpc.NewServer(grpc.ChainUnaryInterceptor(idempotency.UnaryServerInterceptor(store))) // FailedPrecondition is final
	srv.RegisterService(ledgerDesc(), &ledger{handler: func(ctx context.Context, req *wrapperspb.StringValue) (*wrapperspb.StringValue, error) {
		note := "taken" // the first run's write collides at COMMIT
		if runs.Add(1) > 1 {
			note = "free"
		}
		_, err := idempotency.MustTxFromContext(ctx).Exec(ctx, `INSERT INTO audit VALUES ($1)`, note)
		return wrapperspb.String("audited " + note), err
	}})
	conn := dial(t, serve(t, srv))
	kctx := metadata.AppendToOutgoingContext(ctx, idempotency.MetadataKey, "k")
	first := make(chan reply, 1)
	go func() { first <- invoke(kctx, conn, methodCharge, "x") }()
	await(t, storing, "the first call's COMMIT to fail")
	dup := invoke(kctx, conn, methodCharge, "x")
	require.NoError(t, dup.err, "the duplicate ran after the failed COMMIT, and succeeded")
	close(stored)
	r := await(t, first, "the first call")
	require.NoError(t, r.err, "the first caller gets the stored answer, not a second one")
	require.Equal(t, dup.raw, r.raw)
	later := invoke(kctx, conn, methodCharge, "x")
	require.NoError(t, later.err)
	require.True(t, later.replayed)
	require.Equal(t, dup.raw, later.raw)
	require.EqualValues(t, 2, runs.Load())
}

// A response whose type this process does not know (a dynamic message, a
// service whose descriptors are registered nowhere) replays its bytes
// exactly, through Execute and through gRPC.
func TestUnknownResponseTypeReplaysItsBytes(t *testing.T) {
	t.Parallel()
	receipt := unregisteredReceiptType(t)
	newReceipt := func(v string) proto.Message {
		m := dynamicpb.NewMessage(receipt)
		m.Set(receipt.Fields().ByName("value"), protoreflect.ValueOfString(v))
		return m
	}
	e := newEnv(t, envConfig{})
	ctx := context.Background()

	res, err := e.store.Execute(ctx, idempotency.Call{Key: "d", Method: "m"}, func(context.Context, pgx.Tx) (proto.Message, error) { return newReceipt("paid"), nil })
	require.NoError(t, err)
	want, err := proto.Marshal(res.Response)
	require.NoError(t, err)
	again, err := e.store.Execute(ctx, idempotency.Call{Key: "d", Method: "m"}, func(context.Context, pgx.Tx) (proto.Message, error) { return nil, errors.New("ran") })
	require.NoError(t, err)
	require.Equal(t, idempotency.OutcomeReplayed, again.Outcome)
	require.Equal(t, "idempotency.test.unregistered.Receipt", string(again.Response.ProtoReflect().Descriptor().FullName()))
	got, err := proto.Marshal(again.Response)
	require.NoError(t, err)
	require.Equal(t, want, got, "the stored bytes, exactly")

	// Through gRPC: a hand-written service (no descriptor registered)
	// whose handler answers with the dynamic type.
	var runs atomic.Int64
	srv := grpc.NewServer(grpc.ChainUnaryInterceptor(idempotency.UnaryServerInterceptor(e.store)))
	desc := ledgerDesc()
	desc.ServiceName = "idempotency.test.Unregistered"
	desc.Methods = desc.Methods[:1]
	desc.Methods[0].Handler = func(srv any, ctx context.Context, dec func(any) error, icpt grpc.UnaryServerInterceptor) (any, error) {
		req := &wrapperspb.StringValue{}
		if err := dec(req); err != nil {
			return nil, err
		}
		info := &grpc.UnaryServerInfo{Server: srv, FullMethod: "/idempotency.test.Unregistered/Charge"}
		return icpt(ctx, req, info, func(context.Context, any) (any, error) {
			runs.Add(1)
			return newReceipt("charged " + req.GetValue()), nil
		})
	}
	srv.RegisterService(desc, &ledger{})
	conn := dial(t, serve(t, srv))
	kctx := metadata.AppendToOutgoingContext(ctx, idempotency.MetadataKey, "g")
	r1 := invoke(kctx, conn, "/idempotency.test.Unregistered/Charge", "x")
	require.NoError(t, r1.err)
	require.Equal(t, "charged x", r1.resp.GetValue(), "the receipt's bytes read as the client's type")
	r2 := invoke(kctx, conn, "/idempotency.test.Unregistered/Charge", "x")
	require.NoError(t, r2.err, "replayed, not Internal 'not linked into this binary'")
	require.True(t, r2.replayed)
	require.Equal(t, r1.raw, r2.raw)
	require.EqualValues(t, 1, runs.Load())
}

// unregisteredReceiptType is a message type registered nowhere:
// idempotency.test.unregistered.Receipt {string value = 1}, the wire
// shape of a StringValue.
func unregisteredReceiptType(t *testing.T) protoreflect.MessageDescriptor {
	t.Helper()
	fd, err := protodesc.NewFile(&descriptorpb.FileDescriptorProto{
		Name:    proto.String("idempotency/test/unregistered.proto"),
		Package: proto.String("idempotency.test.unregistered"),
		Syntax:  proto.String("proto3"),
		MessageType: []*descriptorpb.DescriptorProto{{
			Name: proto.String("Receipt"),
			Field: []*descriptorpb.FieldDescriptorProto{{
				Name: proto.String("value"), Number: proto.Int32(1), JsonName: proto.String("value"),
				Type: descriptorpb.FieldDescriptorProto_TYPE_STRING.Enum(), Label: descriptorpb.FieldDescriptorProto_LABEL_OPTIONAL.Enum(),
			}},
		}},
	}, new(protoregistry.Files))
	require.NoError(t, err)
	return fd.Messages().Get(0)
}

// An HTTP response compressed by the handler replays with its
// Content-Encoding, readable; a cookie it set is neither replayed nor
// stored.
func TestHTTPReplayKeepsContentEncodingAndNoCookie(t *testing.T) {
	t.Parallel()
	var compressed bytes.Buffer
	zw := gzip.NewWriter(&compressed)
	_, _ = zw.Write([]byte(`{"charged":true}`))
	require.NoError(t, zw.Close())
	e := newHTTPEnv(t, func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("Content-Encoding", "gzip")
		http.SetCookie(w, &http.Cookie{Name: "session", Value: "first-callers-secret"})
		w.WriteHeader(http.StatusCreated)
		_, _ = w.Write(compressed.Bytes())
	})
	for i := 0; i < 2; i++ {
		req, err := http.NewRequest(http.MethodPost, e.srv.URL+"/v1/charges", strings.NewReader("x"))
		require.NoError(t, err)
		req.Header.Set(idempotency.HeaderKey, "k")
		resp, err := e.srv.Client().Do(req) // decompresses what says gzip
		require.NoError(t, err)
		body, err := io.ReadAll(resp.Body)
		resp.Body.Close()
		require.NoError(t, err)
		require.Equal(t, `{"charged":true}`, string(body), "attempt %d", i)
		require.Equal(t, i == 1, resp.Header.Get(idempotency.ReplayedHeader) == "true")
		if i == 1 {
			require.Empty(t, resp.Cookies(), "the first caller's cookie is not replayed")
		}
	}
	require.EqualValues(t, 1, e.runs.Load())
	rec, err := e.store.Inspect(context.Background(), "", "k")
	require.NoError(t, err)
	require.NotContains(t, string(rec.Metadata), "first-callers-secret", "nor stored")
}

// An answer that is not this run's (here the engine's error for a handler
// that ended the call's transaction) carries none of the headers and
// trailers the run set.
func TestEngineErrorCarriesNothingOfTheRun(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envConfig{handler: func(ctx context.Context, req *wrapperspb.StringValue) (*wrapperspb.StringValue, error) {
		if err := grpc.SetHeader(ctx, metadata.Pairs("x-charge-id", "ch_never_happened")); err != nil {
			return nil, err
		}
		if err := grpc.SetTrailer(ctx, metadata.Pairs("x-charge-trailer", "ch_never_happened")); err != nil {
			return nil, err
		}
		_, err := idempotency.MustTxFromContext(ctx).Conn().Exec(ctx, `COMMIT`)
		return wrapperspb.String("mine"), err
	}})
	var header, trailer metadata.MD
	ctx := metadata.AppendToOutgoingContext(context.Background(), idempotency.MetadataKey, "k")
	err := e.conn.Invoke(ctx, methodCharge, wrapperspb.String("x"), &wrapperspb.StringValue{}, grpc.Header(&header), grpc.Trailer(&trailer))
	require.Equal(t, codes.Internal, status.Code(err), "%v", err)
	require.Contains(t, status.Convert(err).Message(), "ended the call's transaction")
	require.Empty(t, header.Get("x-charge-id"), "the run's header")
	require.Empty(t, trailer.Get("x-charge-trailer"))
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

// A tracer tells a caller that gave up, and a store that cannot work as
// configured, from an outage.
func TestOutcomesOfCancellationAndMisconfiguration(t *testing.T) {
	t.Parallel()
	var mu sync.Mutex
	var outcomes []idempotency.Outcome
	tracer := endTracer(func(_ context.Context, d idempotency.TraceCallEndData) {
		mu.Lock()
		defer mu.Unlock()
		outcomes = append(outcomes, d.Outcome)
	})
	db := testdb.New(t, 4)
	ctx := context.Background()
	store := migratedStore(t, db, idempotency.WithTracer(tracer), idempotency.WithInProgressWait(10*time.Second))
	holding, release := make(chan struct{}), make(chan struct{})
	done := make(chan error, 1)
	go func() {
		_, err := store.Execute(ctx, idempotency.Call{Key: "k", Method: "m"}, func(context.Context, pgx.Tx) (proto.Message, error) {
			close(holding)
			<-release
			return nil, nil
		})
		done <- err
	}()
	await(t, holding, "the first call to hold the key")
	cctx, cancel := context.WithCancel(ctx)
	waiting := make(chan error, 1)
	go func() {
		_, err := store.Execute(cctx, idempotency.Call{Key: "k", Method: "m"}, func(context.Context, pgx.Tx) (proto.Message, error) { return nil, nil })
		waiting <- err
	}()
	cancel() // the duplicate's caller gives up, before or while it waits
	require.ErrorIs(t, await(t, waiting, "the cancelled duplicate"), context.Canceled)
	close(release)
	require.NoError(t, await(t, done, "the first call"))

	unmigrated, err := idempotency.NewStore(db.Pool, idempotency.WithTable("", "never_migrated"), idempotency.WithTracer(tracer))
	require.NoError(t, err)
	_, err = unmigrated.Execute(ctx, idempotency.Call{Key: "k", Method: "m"}, func(context.Context, pgx.Tx) (proto.Message, error) { return nil, nil })
	require.Equal(t, codes.Internal, status.Code(err))
	mu.Lock()
	defer mu.Unlock()
	require.ElementsMatch(t, []idempotency.Outcome{idempotency.OutcomeExecuted, idempotency.OutcomeCanceled, idempotency.OutcomeMisconfigured}, outcomes)
}

// A message whose writes violate a deferred constraint at every COMMIT can
// never succeed: it is dead-lettered at once, and every redelivery too,
// without running again.
func TestMessageThatCanNeverCommitIsDeadLettered(t *testing.T) {
	t.Parallel()
	db := testdb.New(t, 4)
	ctx := context.Background()
	store := migratedStore(t, db)
	_, err := db.Pool.Exec(ctx, `CREATE TABLE audit (note text UNIQUE DEFERRABLE INITIALLY DEFERRED); INSERT INTO audit VALUES ('taken')`)
	require.NoError(t, err)
	runs := 0
	for delivery := 1; delivery <= 5; delivery++ {
		o, err := store.ProcessMessage(ctx, idempotency.Message{Scope: "orders", ID: "m-1", Body: []byte("audit"), Redelivered: delivery > 1}, func(ctx context.Context, tx pgx.Tx) error {
			runs++
			_, err := tx.Exec(ctx, `INSERT INTO audit VALUES ('taken')`)
			return err
		})
		require.Equal(t, codes.FailedPrecondition, status.Code(err), "delivery %d: %v", delivery, err)
		require.Equal(t, idempotency.DeadLetter, idempotency.DispositionOf(o, err), "delivery %d", delivery)
	}
	require.Equal(t, 1, runs)
}

// What a review of the engine found, each kept as a test: ways around the
// checks of the call's transaction, and answers that were not one.

// SQL-standard function bodies (BEGIN ATOMIC ... END) hold semicolons and
// an END that end no transaction: allowed.
func TestBeginAtomicBodyIsAllowed(t *testing.T) {
	t.Parallel()
	db := testdb.New(t, 2)
	store := migratedStore(t, db)
	res, err := store.Execute(context.Background(), idempotency.Call{Key: "k", Method: "m"}, func(ctx context.Context, tx pgx.Tx) (proto.Message, error) {
		_, err := tx.Exec(ctx, `CREATE FUNCTION answer() RETURNS int LANGUAGE sql BEGIN ATOMIC SELECT CASE WHEN true THEN 42 END; END`)
		return nil, err
	})
	require.NoError(t, err)
	require.Equal(t, idempotency.OutcomeExecuted, res.Outcome)
	require.Equal(t, 42, db.Count(t, `SELECT answer()`))
}

// tx.Conn() called by a goroutine the handler left behind, once the call is
// over and its connection serves another call: the other call's writes are
// not committed by it; that call fails with Unavailable, and its retry
// runs.
func TestStaleConnCannotReachAnotherCall(t *testing.T) {
	t.Parallel()
	db := testdb.New(t, 1) // one connection: the next call gets the same one
	store := migratedStore(t, db)
	createLedger(t, db)
	ctx := context.Background()
	var kept pgx.Tx
	_, err := store.Execute(ctx, idempotency.Call{Key: "a", Method: "m"}, func(ctx context.Context, tx pgx.Tx) (proto.Message, error) {
		kept = tx
		return wrapperspb.String("a"), nil
	})
	require.NoError(t, err)
	var staleErr error
	fn := func(ctx context.Context, tx pgx.Tx) (proto.Message, error) {
		if _, err := tx.Exec(ctx, `INSERT INTO ledger (note) VALUES ('b')`); err != nil {
			return nil, err
		}
		if kept != nil {
			_, staleErr = kept.Conn().Exec(context.Background(), `COMMIT`) // the left-behind goroutine
			kept = nil
		}
		return wrapperspb.String("b"), nil
	}
	_, err = store.Execute(ctx, idempotency.Call{Key: "b", Method: "m"}, fn)
	require.Equal(t, codes.Unavailable, status.Code(err), "%v", err)
	require.Error(t, staleErr, "the stale COMMIT went nowhere")
	require.Zero(t, db.Count(t, `SELECT count(*) FROM ledger`), "nothing of b committed")
	res, err := store.Execute(ctx, idempotency.Call{Key: "b", Method: "m"}, fn)
	require.NoError(t, err)
	require.Equal(t, idempotency.OutcomeExecuted, res.Outcome)
}

// A handler that commits on tx.Conn() and then closes it: the engine cannot
// know whether its writes committed, so the key keeps an error (stored on
// another connection) and the handler never runs again.
func TestConnCommittedThenClosedRunsOnce(t *testing.T) {
	t.Parallel()
	db := testdb.New(t, 4)
	store := migratedStore(t, db)
	createLedger(t, db)
	var runs atomic.Int64
	fn := func(ctx context.Context, tx pgx.Tx) (proto.Message, error) {
		runs.Add(1)
		c := tx.Conn()
		if _, err := c.Exec(ctx, `INSERT INTO ledger (note) VALUES ('x'); COMMIT`); err != nil {
			return nil, err
		}
		return wrapperspb.String("x"), c.Close(ctx)
	}
	for i := 0; i < 2; i++ {
		_, err := store.Execute(context.Background(), idempotency.Call{Key: "k", Method: "m"}, fn)
		require.Equal(t, codes.Internal, status.Code(err), "%v", err)
		require.True(t, idempotency.IsFinal(err))
	}
	require.EqualValues(t, 1, runs.Load())
	require.Equal(t, 1, db.Count(t, `SELECT count(*) FROM ledger`))
}

// An error the engine stores for a call (its handler ended the transaction
// on tx.Conn()) is one answer: the first caller gets none of the headers
// its handler set, as no replay does.
func TestStoredEngineErrorIsOneAnswer(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envConfig{handler: func(ctx context.Context, req *wrapperspb.StringValue) (*wrapperspb.StringValue, error) {
		_ = grpc.SetHeader(ctx, metadata.Pairs("x-charge-id", "ch_123"))
		_ = grpc.SetTrailer(ctx, metadata.Pairs("x-receipt", "r_1"))
		_, err := idempotency.MustTxFromContext(ctx).Conn().Exec(ctx, `COMMIT`)
		return wrapperspb.String("ok"), err
	}})
	var answers [2][2]metadata.MD
	for i := range answers {
		ctx := metadata.AppendToOutgoingContext(context.Background(), idempotency.MetadataKey, "k")
		err := e.conn.Invoke(ctx, methodCharge, wrapperspb.String("x"), &wrapperspb.StringValue{}, grpc.Header(&answers[i][0]), grpc.Trailer(&answers[i][1]))
		require.Equal(t, codes.Internal, status.Code(err))
	}
	for i := range answers {
		require.Empty(t, answers[i][0].Get("x-charge-id"), "call %d", i)
		require.Empty(t, answers[i][1].Get("x-receipt"), "call %d", i)
	}
}

// A handler that ends the call's transaction on tx.Conn() and then panics
// (behind a recovery middleware): its writes may have committed, with the
// claim or on their own outside it, so the key keeps an error and the
// handler never runs again; the panic goes on.
func TestPanicAfterEndingTheTransactionOnConnRunsOnce(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct{ name, sql string }{
		{name: "a COMMIT", sql: `INSERT INTO ledger (note) VALUES ('x'); COMMIT`},
		{name: "a ROLLBACK, then a write outside", sql: `ROLLBACK; INSERT INTO ledger (note) VALUES ('x')`},
		{name: "a ROLLBACK, a write committed outside, then a failed block of its own",
			sql: `ROLLBACK; INSERT INTO ledger (note) VALUES ('x'); COMMIT; BEGIN; SELECT 1/0`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			db := testdb.New(t, 4)
			store := migratedStore(t, db)
			createLedger(t, db)
			var runs atomic.Int64
			fn := func(ctx context.Context, tx pgx.Tx) (proto.Message, error) {
				if runs.Add(1) == 1 {
					_, _ = tx.Conn().Exec(ctx, tc.sql, pgx.QueryExecModeSimpleProtocol)
					panic("a bug")
				}
				_, err := tx.Exec(ctx, `INSERT INTO ledger (note) VALUES ('x')`)
				return wrapperspb.String("x"), err
			}
			call := idempotency.Call{Key: "k", Method: "m"}
			require.PanicsWithValue(t, "a bug", func() { _, _ = store.Execute(context.Background(), call, fn) })
			_, err := store.Execute(context.Background(), call, fn)
			requireStoredInternal(t, err, "ended the call's transaction")
			require.EqualValues(t, 1, runs.Load())
			require.Equal(t, 1, db.Count(t, `SELECT count(*) FROM ledger`))
		})
	}
}

// The middleware mounted twice (on a router group and on its route), and
// the interceptor chained twice, protect a call once: the inner one does
// not answer "in progress" for the outer one's own key.
func TestProtectionNestedInItselfRunsTheHandlerOnce(t *testing.T) {
	t.Parallel()
	db := suiteDB(t)
	store := migratedStore(t, db, idempotency.WithInProgressWait(50*time.Millisecond))
	var runs atomic.Int64
	mw := idempotency.HTTPMiddleware(store)
	srv := httptest.NewServer(mw(mw(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { runs.Add(1); w.WriteHeader(http.StatusCreated) }))))
	t.Cleanup(srv.Close)
	for i := 0; i < 2; i++ {
		req, err := http.NewRequest(http.MethodPost, srv.URL+"/v1/x", strings.NewReader("b"))
		require.NoError(t, err)
		req.Header.Set(idempotency.HeaderKey, "k")
		resp, err := srv.Client().Do(req)
		require.NoError(t, err)
		resp.Body.Close()
		require.Equal(t, http.StatusCreated, resp.StatusCode, "attempt %d", i)
	}
	require.EqualValues(t, 1, runs.Load())

	var grpcRuns atomic.Int64
	icpt := idempotency.UnaryServerInterceptor(store)
	gs := grpc.NewServer(grpc.ChainUnaryInterceptor(icpt, icpt))
	gs.RegisterService(ledgerDesc(), &ledger{handler: func(ctx context.Context, req *wrapperspb.StringValue) (*wrapperspb.StringValue, error) {
		grpcRuns.Add(1)
		return keyedLedger(ctx, req)
	}})
	conn := dial(t, serve(t, gs))
	ctx := metadata.AppendToOutgoingContext(context.Background(), idempotency.MetadataKey, "g")
	first := invoke(ctx, conn, methodCharge, "x")
	require.NoError(t, first.err)
	again := invoke(ctx, conn, methodCharge, "x")
	require.NoError(t, again.err)
	require.True(t, again.replayed)
	require.EqualValues(t, 1, grpcRuns.Load())
}

// Inspect and Forget reach each transport's key when named with its
// namespace, and tell a key whose call is running from a key never used.
func TestInspectAndForgetNameEachTransportsKey(t *testing.T) {
	t.Parallel()
	e := newHTTPEnv(t, nil)
	ctx := context.Background()
	require.Equal(t, http.StatusCreated, e.post("x", "charge 1").status)
	runs := 0
	fn := func(context.Context, pgx.Tx) (proto.Message, error) { runs++; return wrapperspb.String("ok"), nil }
	_, err := e.store.Execute(ctx, idempotency.Call{Key: "x", Method: "/svc/Refund"}, fn)
	require.NoError(t, err)

	rec, err := e.store.Inspect(ctx, "", "x")
	require.NoError(t, err)
	require.Equal(t, idempotency.TransportGRPC, rec.Transport)
	rec, err = e.store.Inspect(ctx, "", "http x")
	require.NoError(t, err)
	require.Equal(t, idempotency.TransportHTTP, rec.Transport)
	require.Equal(t, "x", rec.Key)
	require.Equal(t, "POST /v1/charges", rec.Method)

	require.NoError(t, e.store.Forget(ctx, "", "http x", ""), "the HTTP charge")
	_, err = e.store.Execute(ctx, idempotency.Call{Key: "x", Method: "/svc/Refund"}, fn)
	require.NoError(t, err)
	require.Equal(t, 1, runs, "the gRPC key was left alone")
	require.Equal(t, http.StatusCreated, e.post("x", "charge 1").status)
	require.Equal(t, 2, e.ledgerRows(), "the forgotten HTTP key ran again")

	holding, release := make(chan struct{}), make(chan struct{})
	done := make(chan error, 1)
	go func() {
		_, err := e.store.Execute(ctx, idempotency.Call{Key: "running", Method: "m"}, func(context.Context, pgx.Tx) (proto.Message, error) {
			close(holding)
			<-release
			return nil, nil
		})
		done <- err
	}()
	await(t, holding, "the call to hold its key")
	_, err = e.store.Inspect(ctx, "", "running")
	require.ErrorIs(t, err, idempotency.ErrInProgress, "running, not never used")
	close(release)
	require.NoError(t, await(t, done, "the call"))
	_, err = e.store.Inspect(ctx, "", "never")
	require.ErrorIs(t, err, idempotency.ErrKeyNotFound)
}

// Migration 003 moves the HTTP and message rows of older versions into
// their namespaces, the errors the engine stored for HTTP requests too,
// and leaves Store.Execute's alone; a downgrade and an upgrade again never
// make it fail.
func TestMigrationMovesOlderRowsIntoTheirNamespaces(t *testing.T) {
	t.Parallel()
	e := newHTTPEnv(t, func(w http.ResponseWriter, r *http.Request) {
		switch body, _ := io.ReadAll(r.Body); string(body) {
		case "end":
			_, _ = idempotency.MustTxFromContext(r.Context()).Conn().Exec(r.Context(), `COMMIT`)
		}
		w.WriteHeader(http.StatusCreated)
	})
	ctx := context.Background()
	store := e.store
	var runs atomic.Int64
	direct := idempotency.Call{Key: "d", Method: "POST /v1/orders"}
	fn := func(context.Context, pgx.Tx) (proto.Message, error) {
		runs.Add(1)
		return wrapperspb.Bytes([]byte("{}")), nil
	}
	_, err := store.Execute(ctx, direct, fn)
	require.NoError(t, err)
	require.Equal(t, http.StatusCreated, e.post("ok", "fine").status)
	require.Equal(t, http.StatusInternalServerError, e.post("ended", "end").status, "an error the engine stored")
	_, err = store.ProcessMessage(ctx, idempotency.Message{ID: "m"}, func(context.Context, pgx.Tx) error { return nil })
	require.NoError(t, err)

	ms, err := idempotency.Migrations("", idempotency.DefaultTable)
	require.NoError(t, err)
	downgrade := func() { // as the older version's table looks
		_, err := e.db.Pool.Exec(ctx, ms[2].Down)
		require.NoError(t, err)
		_, err = e.db.Pool.Exec(ctx, `DELETE FROM idempotency_keys_migrations WHERE version = 3`)
		require.NoError(t, err)
	}
	for round := 0; round < 2; round++ {
		downgrade()
		require.NoError(t, store.Migrate(ctx), "round %d", round)
		require.Equal(t, http.StatusCreated, e.post("ok", "fine").status)
		require.Equal(t, http.StatusInternalServerError, e.post("ended", "end").status)
		o, err := store.ProcessMessage(ctx, idempotency.Message{ID: "m", Redelivered: true}, func(context.Context, pgx.Tx) error { return errors.New("ran") })
		require.NoError(t, err)
		require.Equal(t, idempotency.OutcomeReplayed, o)
		res, err := store.Execute(ctx, direct, fn)
		require.NoError(t, err)
		require.Equal(t, idempotency.OutcomeReplayed, res.Outcome, "Execute's row stays in its namespace")
	}
	require.EqualValues(t, 2, e.runs.Load(), "each HTTP request ran once")
	require.EqualValues(t, 1, runs.Load())

	// A downgrade, then the older version writes the bare key again: the
	// upgrade leaves the row it cannot move, instead of failing.
	downgrade()
	_, err = e.db.Pool.Exec(ctx, `INSERT INTO idempotency_keys (scope, key, method, fingerprint, state, response_type, response, metadata, expires_at)
VALUES ('', 'taken', 'POST /v1/charges', '\x00', 'succeeded', 'google.protobuf.BytesValue', '', '\x08c901', now() + interval '1 hour'),
       ('', 'http taken', 'POST /v1/charges', '\x00', 'succeeded', 'google.protobuf.BytesValue', '', '\x08c901', now() + interval '1 hour')`)
	require.NoError(t, err)
	require.NoError(t, store.Migrate(ctx))
}

// The engine's own reads and writes of the key table outside calls (the
// cleaner, Inspect, Forget) never fail a SERIALIZABLE call.
func TestCleanerNeverFailsSerializableCalls(t *testing.T) {
	t.Parallel()
	db := testdb.NewConfigured(t, func(c *pgxpool.Config) {
		c.ConnConfig.RuntimeParams["default_transaction_isolation"] = "serializable"
	})
	store := migratedStore(t, db)
	ctx := context.Background()
	_, err := db.Pool.Exec(ctx, `CREATE TABLE acct (id int PRIMARY KEY, bal int); INSERT INTO acct VALUES (1, 0)`)
	require.NoError(t, err)
	_, err = store.Execute(ctx, idempotency.Call{Key: "warm", Method: "m"}, func(context.Context, pgx.Tx) (proto.Message, error) { return nil, nil })
	require.NoError(t, err)
	_, err = store.Execute(ctx, idempotency.Call{Key: "k", Method: "m"}, func(ctx context.Context, tx pgx.Tx) (proto.Message, error) {
		var b int
		if err := tx.QueryRow(ctx, `SELECT bal FROM acct WHERE id = 1`).Scan(&b); err != nil {
			return nil, err
		}
		if _, err := db.Pool.Exec(ctx, `UPDATE acct SET bal = bal + 1 WHERE id = 1`); err != nil {
			return nil, err
		}
		if _, err := store.DeleteExpired(ctx, 100); err != nil {
			return nil, err
		}
		if _, err := store.Inspect(ctx, "", "warm"); err != nil {
			return nil, err
		}
		return wrapperspb.String("ok"), nil
	})
	require.NoError(t, err)
}

// A consumer whose scope PostgreSQL cannot store is misconfigured: its
// messages are good, and come back once it is fixed.
func TestBadConsumerScopeRedeliversGoodMessages(t *testing.T) {
	t.Parallel()
	store := migratedStore(t, testdb.New(t, 2))
	o, err := store.ProcessMessage(context.Background(), idempotency.Message{Scope: strings.Repeat("s", idempotency.MaxScopeLen+1), ID: "m-1", Body: []byte("good")},
		func(context.Context, pgx.Tx) error { return nil })
	require.Equal(t, idempotency.OutcomeMisconfigured, o)
	require.Equal(t, codes.Internal, status.Code(err))
	require.Equal(t, idempotency.Redeliver, idempotency.DispositionOf(o, err))
}
