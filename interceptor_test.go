package idempotency_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
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
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/mem"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/exactlyonce/idempotency"
	"github.com/exactlyonce/idempotency/internal/testdb"
)

func TestFirstCallStoresAndRetryReplaysByteForByte(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envConfig{})
	ctx := context.Background()

	first := e.call(ctx, methodCharge, "key-1", "charge 100")
	require.NoError(t, first.err)
	require.False(t, first.replayed, "a first call is executed, not replayed")
	require.Equal(t, "succeeded", e.keyState("key-1"))

	for i := 0; i < 3; i++ {
		again := e.call(ctx, methodCharge, "key-1", "charge 100")
		require.NoError(t, again.err)
		require.True(t, again.replayed, "retry must carry the %s trailer", idempotency.ReplayedTrailer)
		require.True(t, bytes.Equal(first.raw, again.raw), "replayed response differs: %q vs %q", first.resp.GetValue(), again.resp.GetValue())
	}
	require.EqualValues(t, 1, e.runs.Load(), "handler runs")
	require.Equal(t, 1, e.ledgerRows(), "business rows")
	require.Equal(t, 1, e.keyRows())
}

// Duplicates that arrive while the first call runs: it runs once, and each
// duplicate either waits for its response or, past a short in-progress
// wait, gives up with Aborted. The first call is held until the test has
// seen what it needs (every call at the server, or every duplicate back),
// so nothing here depends on how fast the machine is.
func TestConcurrentDuplicatesExecuteOnce(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name    string
		wait    time.Duration // how long duplicates wait for the first call
		aborted bool          // duplicates give up with Aborted; else they get the replay
	}{
		{name: "duplicates wait and replay", wait: liveness},
		{name: "duplicates give up with Aborted", wait: 50 * time.Millisecond, aborted: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			var e *env
			release := newGate()
			defer release.open() // a failed assertion must not leave the handler held
			e = newEnv(t, envConfig{
				storeOpts: []idempotency.StoreOption{idempotency.WithInProgressWait(tc.wait), idempotency.WithSuggestedRetryDelay(123 * time.Millisecond)},
				handler: func(ctx context.Context, req *wrapperspb.StringValue) (*wrapperspb.StringValue, error) {
					resp, err := e.insertLedger(ctx, req)
					if err := release.wait(ctx); err != nil {
						return nil, status.Error(codes.Internal, err.Error())
					}
					return resp, err
				},
			})
			const n = 32
			replies := make([]reply, n)
			call := func(i int) { replies[i] = e.call(context.Background(), methodCharge, "dup-key", "charge 5") }
			if tc.aborted {
				heldDuplicates(t, n, release, call, func(back int64) bool { return back == n-1 }, "every duplicate gives up while the first call runs")
			} else {
				heldDuplicates(t, n, release, call, func(int64) bool { return e.arrived.Load() == n }, "every call reaches the server while the first one runs")
			}

			require.EqualValues(t, 1, e.runs.Load(), "handler must run exactly once for %d concurrent duplicates", n)
			require.Equal(t, 1, e.ledgerRows())
			var executed, replayed, aborted int
			var winner []byte
			for _, r := range replies {
				switch {
				case r.err == nil && !r.replayed:
					executed++
					winner = r.raw
				case r.err == nil && r.replayed:
					replayed++
				case status.Code(r.err) == codes.Aborted:
					aborted++
					require.True(t, idempotency.IsInProgress(r.err))
					d, ok := idempotency.RetryDelay(r.err)
					require.True(t, ok, "Aborted must carry RetryInfo")
					require.Equal(t, 123*time.Millisecond, d)
				default:
					t.Fatalf("unexpected reply: %v", r.err)
				}
			}
			require.Equal(t, 1, executed)
			for _, r := range replies {
				if r.replayed {
					require.Equal(t, winner, r.raw)
				}
			}
			if tc.aborted {
				require.Equal(t, n-1, aborted, "every duplicate gives up after the short wait")
			} else {
				require.Equal(t, n-1, replayed, "every duplicate waits for the winner and gets its response")
			}
		})
	}
}

func TestHandlerErrorRollsBackAndReleasesKey(t *testing.T) {
	t.Parallel()
	var e *env
	fail := true
	e = newEnv(t, envConfig{handler: func(ctx context.Context, req *wrapperspb.StringValue) (*wrapperspb.StringValue, error) {
		resp, err := e.insertLedger(ctx, req)
		if fail {
			return nil, status.Error(codes.Unavailable, "downstream flaked")
		}
		return resp, err
	}})
	ctx := context.Background()

	r := e.call(ctx, methodCharge, "k", "x")
	require.Equal(t, codes.Unavailable, status.Code(r.err))
	require.Equal(t, 0, e.ledgerRows(), "business write must roll back with the failed handler")
	require.Equal(t, 0, e.keyRows(), "a transient error releases the key")

	fail = false
	r = e.call(ctx, methodCharge, "k", "x")
	require.NoError(t, r.err)
	require.False(t, r.replayed)
	require.EqualValues(t, 2, e.runs.Load(), "the retry executes again")
	require.Equal(t, 1, e.ledgerRows())
}

func TestFinalErrorIsStoredAndReplayed(t *testing.T) {
	t.Parallel()
	var e *env
	e = newEnv(t, envConfig{handler: func(ctx context.Context, req *wrapperspb.StringValue) (*wrapperspb.StringValue, error) {
		if _, err := e.insertLedger(ctx, req); err != nil {
			return nil, err
		}
		st, _ := status.New(codes.FailedPrecondition, "insufficient funds").WithDetails(&errdetails.PreconditionFailure{
			Violations: []*errdetails.PreconditionFailure_Violation{{Type: "BALANCE", Subject: "acct-1", Description: "balance 3 < 5"}},
		})
		return nil, st.Err()
	}})
	ctx := context.Background()

	first := e.call(ctx, methodCharge, "k", "-5")
	require.Equal(t, codes.FailedPrecondition, status.Code(first.err))
	require.False(t, first.replayed)
	require.Equal(t, 0, e.ledgerRows(), "business writes of a failed call roll back")
	require.Equal(t, "failed", e.keyState("k"), "a final error keeps the key")

	again := e.call(ctx, methodCharge, "k", "-5")
	require.True(t, again.replayed)
	require.Equal(t, status.Convert(first.err).Proto().String(), status.Convert(again.err).Proto().String(), "replayed error must match, details included")
	require.Len(t, status.Convert(again.err).Details(), 1)
	require.EqualValues(t, 1, e.runs.Load())
}

// A handler whose statement failed (the transaction is aborted) and that
// returns a final error: the error must still be stored and replayed.
func TestFinalErrorAfterFailedStatementIsStored(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envConfig{handler: func(ctx context.Context, req *wrapperspb.StringValue) (*wrapperspb.StringValue, error) {
		tx := idempotency.MustTxFromContext(ctx)
		_, err := tx.Exec(ctx, `INSERT INTO ledger (id, note) VALUES (1, 'x'), (1, 'duplicate id')`)
		if err == nil {
			return nil, errors.New("expected a unique violation")
		}
		return nil, status.Error(codes.AlreadyExists, "charge already recorded")
	}})
	// Twice on fresh keys, so the second runs on a connection whose
	// statement cache has seen the first.
	for _, key := range []string{"k1", "k2"} {
		r := e.call(context.Background(), methodCharge, key, "x")
		require.Equal(t, codes.AlreadyExists, status.Code(r.err), "%s: %v", key, r.err)
		require.Equal(t, "failed", e.keyState(key))
		again := e.call(context.Background(), methodCharge, key, "x")
		require.Equal(t, codes.AlreadyExists, status.Code(again.err))
		require.True(t, again.replayed)
	}
	require.EqualValues(t, 2, e.runs.Load())
}

// A call that outlasts its TTL must not commit a key that is already
// expired: the key lives a full TTL from when the call finished, not from
// when it was claimed.
func TestCallLongerThanTTLKeepsItsKey(t *testing.T) {
	t.Parallel()
	const ttl = 100 * time.Millisecond
	var e *env
	var finished atomic.Int64 // when the handler returned, in Unix microseconds
	e = newEnv(t, envConfig{
		opts: []idempotency.ServerOption{idempotency.WithTTL(ttl)},
		handler: func(ctx context.Context, req *wrapperspb.StringValue) (*wrapperspb.StringValue, error) {
			resp, err := e.insertLedger(ctx, req)
			time.Sleep(2 * ttl) // a key that lived from its claim would expire here
			finished.Store(time.Now().UnixMicro())
			return resp, err
		},
	})
	require.NoError(t, e.call(context.Background(), methodCharge, "k", "x").err)
	var lifetime time.Duration
	require.NoError(t, e.db.Pool.QueryRow(context.Background(),
		`SELECT (extract(epoch FROM expires_at - $1::timestamptz) * 1e6)::bigint FROM idempotency_keys WHERE key = 'k'`,
		time.UnixMicro(finished.Load())).Scan(&lifetime))
	lifetime *= time.Microsecond
	require.GreaterOrEqual(t, lifetime, ttl, "the key expires a full TTL after the handler returned")
	require.Equal(t, 1, e.ledgerRows())
}

// A handler that ends the call's transaction behind the engine's back may
// have committed its writes without the key. It must never run a second
// time: the call fails with Internal saying what happened, and so does
// every retry, from the stored key.
func TestHandlerEndingTheTransactionNeverRunsTwice(t *testing.T) {
	t.Parallel()
	// Through tx, what would end the transaction is refused before it
	// reaches PostgreSQL: nothing the handler wrote commits. Through
	// tx.Conn(), which the engine cannot check, it does commit: the engine
	// finds out afterwards. Either way the call fails once, its error is
	// stored, and the handler never runs again.
	const refused, ended = "through the call's transaction, which the engine refused", "handler ended the call's transaction"
	for name, tc := range map[string]struct {
		misuse     func(ctx context.Context, tx pgx.Tx) error
		message    string
		ledgerRows int
	}{
		"raw COMMIT": {func(ctx context.Context, tx pgx.Tx) error {
			_, err := tx.Exec(ctx, "INSERT INTO ledger (note) VALUES ('x'); COMMIT")
			return err
		}, refused, 0},
		"BeginFunc on tx.Conn()": {func(ctx context.Context, tx pgx.Tx) error {
			// pgx's BEGIN is a no-op inside the open transaction, and its
			// COMMIT commits the call's transaction.
			return pgx.BeginFunc(ctx, tx.Conn(), func(inner pgx.Tx) error {
				_, err := inner.Exec(ctx, "INSERT INTO ledger (note) VALUES ('x')")
				return err
			})
		}, ended, 1},
		"raw ROLLBACK, then writes": {func(ctx context.Context, tx pgx.Tx) error {
			_, err := tx.Exec(ctx, "ROLLBACK")
			if err == nil {
				_, err = tx.Exec(ctx, "INSERT INTO ledger (note) VALUES ('x')") // autocommitted
			}
			return err
		}, refused, 0},
		"COMMIT, then a transaction of its own": {func(ctx context.Context, tx pgx.Tx) error {
			_, err := tx.Exec(ctx, "INSERT INTO ledger (note) VALUES ('x'); COMMIT; BEGIN")
			if err == nil {
				_, err = tx.Exec(ctx, "INSERT INTO ledger (note) VALUES ('rolled back with the call')")
			}
			return err
		}, refused, 0},
		"COMMIT, a transaction of its own, then an error": {func(ctx context.Context, tx pgx.Tx) error {
			if _, err := tx.Exec(ctx, "INSERT INTO ledger (note) VALUES ('x'); COMMIT; BEGIN"); err != nil {
				return err
			}
			return status.Error(codes.Unavailable, "downstream flaked") // would release the key
		}, refused, 0},
		"the refusal ignored, then an error": {func(ctx context.Context, tx pgx.Tx) error {
			_, _ = tx.Exec(ctx, "INSERT INTO ledger (note) VALUES ('x'); COMMIT")
			return status.Error(codes.Unavailable, "downstream flaked") // would release the key
		}, refused, 0},
		"BeginFunc on tx.Conn(), then an error": {func(ctx context.Context, tx pgx.Tx) error {
			err := pgx.BeginFunc(ctx, tx.Conn(), func(inner pgx.Tx) error {
				_, err := inner.Exec(ctx, "INSERT INTO ledger (note) VALUES ('x')")
				return err
			})
			if err != nil {
				return err
			}
			return status.Error(codes.Unavailable, "downstream flaked")
		}, ended, 1},
		"COMMIT, BEGIN on tx.Conn(), then a failing statement": {func(ctx context.Context, tx pgx.Tx) error {
			if _, err := tx.Conn().Exec(ctx, "INSERT INTO ledger (note) VALUES ('x'); COMMIT; BEGIN"); err != nil {
				return err
			}
			_, err := tx.Exec(ctx, "SELECT 1/0")
			return err
		}, ended, 1},
		"COMMIT AND CHAIN on tx.Conn(), then a failing statement": {func(ctx context.Context, tx pgx.Tx) error {
			if _, err := tx.Conn().Exec(ctx, "INSERT INTO ledger (note) VALUES ('x'); COMMIT AND CHAIN"); err != nil {
				return err
			}
			_, err := tx.Exec(ctx, "SELECT 1/0")
			return err
		}, ended, 1},
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			e := newEnv(t, envConfig{handler: func(ctx context.Context, req *wrapperspb.StringValue) (*wrapperspb.StringValue, error) {
				if err := tc.misuse(ctx, idempotency.MustTxFromContext(ctx)); err != nil {
					return nil, err
				}
				return wrapperspb.String("ok"), nil
			}})
			first := e.call(context.Background(), methodCharge, "k", "x")
			require.Equal(t, codes.Internal, status.Code(first.err), "%v", first.err)
			require.ErrorContains(t, first.err, tc.message)
			for i := 0; i < 2; i++ {
				again := e.call(context.Background(), methodCharge, "k", "x")
				require.Equal(t, codes.Internal, status.Code(again.err), "%v", again.err)
				require.True(t, again.replayed, "the retry gets the stored error")
			}
			require.EqualValues(t, 1, e.runs.Load(), "the handler never runs a second time")
			require.Equal(t, tc.ledgerRows, e.ledgerRows(), "what the handler committed itself, once; no second one")
			require.Equal(t, "failed", e.keyState("k"))
		})
	}
}

func TestFinalCodesOption(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envConfig{
		opts: []idempotency.ServerOption{idempotency.WithFinalCodes(codes.ResourceExhausted)},
		handler: func(ctx context.Context, req *wrapperspb.StringValue) (*wrapperspb.StringValue, error) {
			if req.GetValue() == "exhausted" {
				return nil, status.Error(codes.ResourceExhausted, "quota")
			}
			return nil, status.Error(codes.InvalidArgument, "bad")
		},
	})
	ctx := context.Background()
	require.Equal(t, codes.ResourceExhausted, status.Code(e.call(ctx, methodCharge, "a", "exhausted").err))
	require.Equal(t, "failed", e.keyState("a"), "ResourceExhausted is in the configured set")
	require.Equal(t, codes.InvalidArgument, status.Code(e.call(ctx, methodCharge, "b", "bad").err))
	require.Equal(t, "", e.keyState("b"), "InvalidArgument is not in the configured set: key released")
}

func TestKeyReusedWithDifferentRequest(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envConfig{})
	ctx := context.Background()
	require.NoError(t, e.call(ctx, methodCharge, "k", "charge 100").err)

	for _, tc := range []struct{ name, method, body string }{
		{"different body", methodCharge, "charge 999"},
		{"different method", methodRefund, "charge 100"},
	} {
		r := e.call(ctx, tc.method, "k", tc.body)
		require.Equal(t, codes.FailedPrecondition, status.Code(r.err), tc.name)
		require.True(t, idempotency.IsKeyReused(r.err), tc.name)
		var pf *errdetails.PreconditionFailure
		for _, d := range status.Convert(r.err).Details() {
			if v, ok := d.(*errdetails.PreconditionFailure); ok {
				pf = v
			}
		}
		require.NotNil(t, pf, "%s: FailedPrecondition must carry PreconditionFailure", tc.name)
		require.Equal(t, "k", pf.GetViolations()[0].GetSubject())
	}
	require.EqualValues(t, 1, e.runs.Load())
	require.Equal(t, 1, e.ledgerRows())
}

// A newer client's request carries a map the server does not know, and its
// retry encodes the map's entries in another order (protobuf's default
// marshal does not fix it): the same request, replayed, not KEY_REUSED.
func TestUnknownFieldsInAnotherOrderAreTheSameRequest(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envConfig{})
	send := func(order ...int) reply {
		b := protowire.AppendTag(nil, 1, protowire.BytesType)
		b = protowire.AppendString(b, "charge 100") // StringValue.value, known
		for _, i := range order {
			entry := protowire.AppendString(protowire.AppendTag(nil, 1, protowire.BytesType), fmt.Sprint("k", i))
			entry = protowire.AppendString(protowire.AppendTag(entry, 2, protowire.BytesType), fmt.Sprint("v", i))
			b = protowire.AppendBytes(protowire.AppendTag(b, 7, protowire.BytesType), entry) // unknown to the server
		}
		var trailer metadata.MD
		ctx := metadata.AppendToOutgoingContext(context.Background(), idempotency.MetadataKey, "k")
		req, out := rawMessage(b), rawMessage(nil)
		err := e.conn.Invoke(ctx, methodCharge, &req, &out, grpc.ForceCodecV2(rawCodec{}), grpc.Trailer(&trailer))
		return reply{err: err, raw: out, replayed: len(trailer.Get(idempotency.ReplayedTrailer)) == 1}
	}
	first := send(0, 1, 2)
	require.NoError(t, first.err)
	for _, order := range [][]int{{2, 0, 1}, {1, 2, 0}} {
		again := send(order...)
		require.NoError(t, again.err, "the same logical request")
		require.True(t, again.replayed)
		require.Equal(t, first.raw, again.raw)
	}
	require.EqualValues(t, 1, e.runs.Load())
}

// rawMessage and rawCodec send and receive bytes exactly as given, as a
// client of another language or schema version would encode them.
type rawMessage []byte

type rawCodec struct{}

func (rawCodec) Marshal(v any) (mem.BufferSlice, error) {
	return mem.BufferSlice{mem.SliceBuffer(*v.(*rawMessage))}, nil
}

func (rawCodec) Unmarshal(data mem.BufferSlice, v any) error {
	*v.(*rawMessage) = data.Materialize()
	return nil
}

func (rawCodec) Name() string { return "proto" }

func TestExpiredKeyExecutesAgain(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envConfig{opts: []idempotency.ServerOption{idempotency.WithTTL(time.Hour)}})
	ctx := context.Background()
	first := e.call(ctx, methodCharge, "k", "x")
	require.NoError(t, first.err)
	require.True(t, e.call(ctx, methodCharge, "k", "x").replayed, "within the TTL the key replays")

	// The hour passes.
	_, err := e.db.Pool.Exec(ctx, `UPDATE idempotency_keys SET expires_at = now() - interval '1 second' WHERE key = 'k'`)
	require.NoError(t, err)
	again := e.call(ctx, methodCharge, "k", "x")
	require.NoError(t, again.err)
	require.False(t, again.replayed, "an expired key is treated as absent")
	require.NotEqual(t, first.raw, again.raw)
	require.EqualValues(t, 2, e.runs.Load())
	require.Equal(t, 1, e.keyRows(), "the expired row was replaced, not duplicated")
}

func TestDisconnectAfterSuccessStillStores(t *testing.T) {
	t.Parallel()
	var e *env
	started := make(chan struct{}, 1)
	finished := make(chan error, 1)
	e = newEnv(t, envConfig{handler: func(ctx context.Context, req *wrapperspb.StringValue) (*wrapperspb.StringValue, error) {
		resp, err := e.insertLedger(ctx, req)
		if req.GetValue() == "slow" {
			started <- struct{}{}
			<-ctx.Done() // the client hung up; the work is already done
		}
		return resp, err
	}, tracer: endTracer(func(_ context.Context, data idempotency.TraceCallEndData) {
		if data.Outcome == idempotency.OutcomeExecuted {
			finished <- data.Err
		}
	})})

	ctx, cancel := context.WithCancel(context.Background())
	go func() { <-started; cancel() }()
	r := e.call(ctx, methodCharge, "k", "slow")
	require.Equal(t, codes.Canceled, status.Code(r.err))
	select {
	case <-finished:
	case <-time.After(liveness):
		t.Fatal("server never finished the call")
	}

	again := e.call(context.Background(), methodCharge, "k", "slow")
	require.NoError(t, again.err)
	require.True(t, again.replayed, "the result committed although the client left")
	require.EqualValues(t, 1, e.runs.Load())
	require.Equal(t, 1, e.ledgerRows())
}

func TestDatabaseDownGivesUnavailable(t *testing.T) {
	t.Parallel()
	// A server whose store points at a port where nothing listens.
	pool, err := pgxpool.New(context.Background(), "postgres://postgres@127.0.0.1:1/test?sslmode=disable&connect_timeout=2")
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	deadStore, err := idempotency.NewStore(pool)
	require.NoError(t, err)
	srv := grpc.NewServer(grpc.UnaryInterceptor(idempotency.UnaryServerInterceptor(deadStore)))
	var ran bool
	srv.RegisterService(ledgerDesc(), &ledger{handler: func(context.Context, *wrapperspb.StringValue) (*wrapperspb.StringValue, error) {
		ran = true
		return wrapperspb.String("ran"), nil
	}})
	addr := serve(t, srv)

	ctx := metadata.AppendToOutgoingContext(context.Background(), idempotency.MetadataKey, "k")
	r := invoke(ctx, dial(t, addr), methodCharge, "x")
	require.Equal(t, codes.Unavailable, status.Code(r.err), "an unreachable database is Unavailable: %v", r.err)
	require.False(t, ran, "fail closed: the handler must not run without a claimed key")

	// The same when a live database kills the session during the claim:
	// the server's session is terminated just before its claim is sent.
	db := suiteDB(t)
	var claims atomic.Int64
	killing := schemaPool(t, db.Schema, 2, func(c *pgxpool.Config) {
		c.ConnConfig.Tracer = &testdb.Tracer{OnRoundTrip: func(ctx context.Context, conn *pgx.Conn, statements []string) {
			if !strings.Contains(strings.Join(statements, ";"), "pg_try_advisory_xact_lock") {
				return
			}
			claims.Add(1)
			killBackend(t, conn.PgConn().PID())
		}}
	})
	var runs atomic.Int64
	killed := startReplica(t, killing, replicaConfig{handler: func(ctx context.Context, req *wrapperspb.StringValue) (*wrapperspb.StringValue, error) {
		runs.Add(1)
		return keyedLedger(ctx, req)
	}})
	ctx = metadata.AppendToOutgoingContext(context.Background(), idempotency.MetadataKey, "k2")
	r = invoke(ctx, dial(t, killed.addr), methodCharge, "x")
	require.Equal(t, codes.Unavailable, status.Code(r.err), "%v", r.err)
	require.NotZero(t, claims.Load())
	require.EqualValues(t, 0, runs.Load())
}

func TestInvalidKeysAreRejectedAndWriteNothing(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envConfig{})
	icpt := idempotency.UnaryServerInterceptor(e.store)
	info := &grpc.UnaryServerInfo{FullMethod: methodCharge}
	for _, tc := range []struct {
		name string
		keys []string
		wire bool // grpc-go clients can send it; others are refused by the client library itself
	}{
		{"empty", []string{""}, true},
		{"256 characters", []string{strings.Repeat("a", 256)}, true},
		{"space", []string{"has space"}, true},
		{"two values", []string{"a", "b"}, true},
		{"non-ASCII", []string{"ключ"}, false},
		{"control character", []string{"a\x7fb"}, false},
		{"tab", []string{"a\tb"}, false},
		{"NUL", []string{"a\x00b"}, false},
	} {
		// Straight into the interceptor, as a non-Go client's bytes would
		// arrive, and over the wire where grpc-go lets the client send it.
		md := metadata.MD{idempotency.MetadataKey: tc.keys}
		_, err := icpt(metadata.NewIncomingContext(context.Background(), md), wrapperspb.String("x"), info,
			func(context.Context, any) (any, error) { t.Fatalf("%s: handler ran", tc.name); return nil, nil })
		requireBadKey(t, tc.name, err)
		if tc.wire {
			ctx := metadata.NewOutgoingContext(context.Background(), md)
			requireBadKey(t, tc.name+" (wire)", invoke(ctx, e.conn, methodCharge, "x").err)
		}
	}
	require.EqualValues(t, 0, e.runs.Load(), "the handler never runs for an invalid key")
	require.Equal(t, 0, e.keyRows(), "no row is written for an invalid key")

	longest := strings.Repeat("~", idempotency.MaxKeyLen)
	require.NoError(t, e.call(context.Background(), methodCharge, longest, "x").err, "255 printable characters is valid")
	require.NoError(t, e.call(context.Background(), methodCharge, "!", "x").err, "1 character is valid")
}

func requireBadKey(t *testing.T, name string, err error) {
	t.Helper()
	require.Equal(t, codes.InvalidArgument, status.Code(err), "%s: %v", name, err)
	require.True(t, hasInvalidKeyInfo(err), "%s: ErrorInfo reason INVALID_KEY", name)
	var br *errdetails.BadRequest
	for _, d := range status.Convert(err).Details() {
		if v, ok := d.(*errdetails.BadRequest); ok {
			br = v
		}
	}
	require.NotNil(t, br, "%s: InvalidArgument must carry BadRequest", name)
	require.Equal(t, idempotency.MetadataKey, br.GetFieldViolations()[0].GetField())
}

func hasInvalidKeyInfo(err error) bool {
	for _, d := range status.Convert(err).Details() {
		if ei, ok := d.(*errdetails.ErrorInfo); ok {
			return ei.GetDomain() == idempotency.ErrorDomain && ei.GetReason() == "INVALID_KEY"
		}
	}
	return false
}

func TestCallsWithoutKey(t *testing.T) {
	t.Parallel()
	optional := newEnv(t, envConfig{handler: func(ctx context.Context, req *wrapperspb.StringValue) (*wrapperspb.StringValue, error) {
		_, inTx := idempotency.TxFromContext(ctx)
		return wrapperspb.String(map[bool]string{true: "tx", false: "no tx"}[inTx]), nil
	}})
	r := optional.call(context.Background(), methodCharge, "", "x")
	require.NoError(t, r.err)
	require.Equal(t, "no tx", r.resp.GetValue(), "a call without a key passes through untouched")
	require.Equal(t, 0, optional.keyRows())

	required := newEnv(t, envConfig{opts: []idempotency.ServerOption{idempotency.WithKeyRequired()}})
	r = required.call(context.Background(), methodCharge, "", "x")
	require.Equal(t, codes.InvalidArgument, status.Code(r.err))
	require.ErrorContains(t, r.err, "required")
	require.EqualValues(t, 0, required.runs.Load())
}

// heldKeyLocks, which the tests above and below use to show that no lock
// outlives a call, sees the lock of a running call, gRPC's and HTTP's.
func TestHeldKeyLocksSeesARunningCall(t *testing.T) {
	t.Parallel()
	var e *env
	var during atomic.Int64
	e = newEnv(t, envConfig{handler: func(ctx context.Context, req *wrapperspb.StringValue) (*wrapperspb.StringValue, error) {
		during.Store(int64(heldKeyLocks(t, e.db, "", []string{"k"})))
		return e.insertLedger(ctx, req)
	}})
	require.NoError(t, e.call(context.Background(), methodCharge, "k", "x").err)
	require.EqualValues(t, 1, during.Load(), "the running call's lock")
	requireNoKeyLocks(t, e.db, "", []string{"k"}, "and none after it")

	var h *httpEnv
	h = newHTTPEnv(t, func(w http.ResponseWriter, r *http.Request) {
		during.Store(int64(heldKeyLocks(t, h.db, "", []string{"http k"})))
		h.charge(w, r)
	})
	require.Equal(t, http.StatusCreated, h.post("k", "x").status)
	require.EqualValues(t, 1, during.Load(), "the running request's lock")
}

// A crash between the claim and the commit: the server's database session
// dies while the handler runs. Nothing of the call may remain, and a retry
// must execute immediately rather than wait for a lease.
func TestCrashBeforeCommitLeavesNoKey(t *testing.T) {
	t.Parallel()
	var e *env
	pids := make(chan uint32, 1)
	resume := make(chan struct{})
	e = newEnv(t, envConfig{handler: func(ctx context.Context, req *wrapperspb.StringValue) (*wrapperspb.StringValue, error) {
		resp, err := e.insertLedger(ctx, req)
		if e.runs.Load() == 1 {
			pids <- idempotency.MustTxFromContext(ctx).Conn().PgConn().PID()
			<-resume
		}
		return resp, err
	}})

	done := make(chan reply, 1)
	go func() { done <- e.call(context.Background(), methodCharge, "k", "x") }()
	pid := <-pids
	var killed bool
	require.NoError(t, e.db.Pool.QueryRow(context.Background(), `SELECT pg_terminate_backend($1)`, pid).Scan(&killed))
	require.True(t, killed)
	close(resume)
	r := <-done
	require.Equal(t, codes.Unavailable, status.Code(r.err), "the lost session makes the outcome unknown: %v", r.err)
	require.Equal(t, 0, e.ledgerRows(), "no business write without its stored result")
	require.Equal(t, 0, e.keyRows(), "no key without its result")

	// A lock or lease that outlived the session would make the retry wait
	// out the in-progress wait and fail Aborted.
	r = e.call(context.Background(), methodCharge, "k", "x")
	require.NoError(t, r.err, "the retry runs")
	require.False(t, r.replayed)
	require.Equal(t, 1, e.ledgerRows())
}

// A handler whose database session dies returns the driver's error; the
// client must see Unavailable (retry) rather than Unknown.
func TestLostSessionInHandlerIsUnavailable(t *testing.T) {
	t.Parallel()
	var e *env
	e = newEnv(t, envConfig{handler: func(ctx context.Context, req *wrapperspb.StringValue) (*wrapperspb.StringValue, error) {
		if _, err := e.insertLedger(ctx, req); err != nil {
			return nil, err
		}
		if e.runs.Load() == 1 {
			_, err := idempotency.MustTxFromContext(ctx).Exec(ctx, `SELECT pg_terminate_backend(pg_backend_pid())`)
			return nil, err
		}
		return wrapperspb.String("ok"), nil
	}})
	r := e.call(context.Background(), methodCharge, "k", "x")
	require.Equal(t, codes.Unavailable, status.Code(r.err), "%v", r.err)
	require.Equal(t, 0, e.ledgerRows())
	require.NoError(t, e.call(context.Background(), methodCharge, "k", "x").err)
	require.Equal(t, 1, e.ledgerRows())
}

// If the result cannot be stored, the business write must not commit either.
func TestStoreFailureRollsBackBusinessWrite(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envConfig{})
	ctx := context.Background()
	_, err := e.db.Pool.Exec(ctx, `CREATE FUNCTION refuse_result() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN RAISE EXCEPTION 'disk full' USING ERRCODE = 'disk_full'; END $$;
CREATE TRIGGER refuse_result BEFORE UPDATE ON idempotency_keys FOR EACH ROW EXECUTE FUNCTION refuse_result()`)
	require.NoError(t, err)

	r := e.call(ctx, methodCharge, "k", "x")
	require.Equal(t, codes.Unavailable, status.Code(r.err), "%v", r.err)
	require.EqualValues(t, 1, e.runs.Load(), "the handler ran")
	require.Equal(t, 0, e.ledgerRows(), "its write rolled back with the unstored result")
	require.Equal(t, 0, e.keyRows())

	_, err = e.db.Pool.Exec(ctx, `DROP TRIGGER refuse_result ON idempotency_keys`)
	require.NoError(t, err)
	r = e.call(ctx, methodCharge, "k", "x")
	require.NoError(t, r.err)
	require.Equal(t, 1, e.ledgerRows())
	require.Equal(t, "succeeded", e.keyState("k"))
}

func TestHandlerCannotEndTheTransaction(t *testing.T) {
	t.Parallel()
	var commitErr, rollbackErr error
	var key string
	e := newEnv(t, envConfig{handler: func(ctx context.Context, req *wrapperspb.StringValue) (*wrapperspb.StringValue, error) {
		key, _ = idempotency.IncomingKey(ctx)
		tx := idempotency.MustTxFromContext(ctx)
		commitErr = tx.Commit(ctx)
		rollbackErr = tx.Rollback(ctx)
		// Nested transactions are savepoints and work as usual.
		err := pgx.BeginFunc(ctx, tx, func(tx pgx.Tx) error {
			_, err := tx.Exec(ctx, `INSERT INTO ledger (note) VALUES ('nested')`)
			return err
		})
		if err != nil {
			return nil, err
		}
		_ = pgx.BeginFunc(ctx, tx, func(tx pgx.Tx) error {
			_, _ = tx.Exec(ctx, `INSERT INTO ledger (note) VALUES ('rolled back')`)
			return errors.New("undo this savepoint only")
		})
		// Large objects live in the same transaction.
		lo := tx.LargeObjects()
		_, err = lo.Create(ctx, 0)
		return wrapperspb.String("ok"), err
	}})
	require.NoError(t, e.call(context.Background(), methodCharge, "k", "x").err)
	require.Equal(t, "k", key, "the handler sees its call's key, to forward downstream")
	require.ErrorIs(t, commitErr, idempotency.ErrTxOwned)
	require.ErrorIs(t, rollbackErr, idempotency.ErrTxOwned)
	require.Equal(t, 1, e.ledgerRows(), "the released savepoint's row commits, the rolled back one does not")
	require.Equal(t, 1, e.db.Count(t, `SELECT count(*) FROM ledger WHERE note = 'nested'`))
	require.Panics(t, func() { idempotency.MustTxFromContext(context.Background()) })
}

func TestScopesIsolateCallers(t *testing.T) {
	t.Parallel()
	tenant := func(ctx context.Context) (string, error) {
		v := metadata.ValueFromIncomingContext(ctx, "tenant")
		if len(v) != 1 {
			return "", status.Error(codes.Unauthenticated, "no tenant")
		}
		return v[0], nil
	}
	e := newEnv(t, envConfig{opts: []idempotency.ServerOption{idempotency.WithScope(tenant)}})
	as := func(who string) context.Context {
		return metadata.AppendToOutgoingContext(context.Background(), "tenant", who)
	}
	alice := e.call(as("alice"), methodCharge, "shared-key", "x")
	require.NoError(t, alice.err)
	bob := e.call(as("bob"), methodCharge, "shared-key", "x")
	require.NoError(t, bob.err)
	require.False(t, bob.replayed, "bob must not get alice's stored response")
	require.NotEqual(t, alice.raw, bob.raw)
	require.EqualValues(t, 2, e.runs.Load())

	r := e.call(context.Background(), methodCharge, "k", "x")
	require.Equal(t, codes.Unauthenticated, status.Code(r.err), "a scope error keeps its status")
}

func TestTracerSeesEveryKeyedCall(t *testing.T) {
	t.Parallel()
	var mu sync.Mutex
	var seen []idempotency.Outcome
	e := newEnv(t, envConfig{tracer: endTracer(func(_ context.Context, data idempotency.TraceCallEndData) {
		mu.Lock()
		defer mu.Unlock()
		seen = append(seen, data.Outcome)
	})})
	ctx := context.Background()
	e.call(ctx, methodCharge, "k", "x")
	e.call(ctx, methodCharge, "k", "x")
	e.call(ctx, methodCharge, "k", "y")
	e.call(ctx, methodCharge, "", "x")
	e.call(ctx, methodCharge, " ", "x")
	mu.Lock()
	defer mu.Unlock()
	require.Equal(t, []idempotency.Outcome{idempotency.OutcomeExecuted, idempotency.OutcomeReplayed, idempotency.OutcomeKeyReused, idempotency.OutcomeRejected}, seen)
	require.Equal(t, "key_reused", idempotency.OutcomeKeyReused.String())
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
