package idempotency_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/exactlyonce/idempotency"
	"github.com/exactlyonce/idempotency/internal/testdb"
)

// recordingTracer keeps every call and cleaner batch it sees.
type recordingTracer struct {
	mu      sync.Mutex
	started []idempotency.TraceCallStartData
	ended   []idempotency.TraceCallEndData
	batches []idempotency.TraceCleanerBatchData
}

type traceCtxKey struct{}

func (r *recordingTracer) TraceCallStart(ctx context.Context, data idempotency.TraceCallStartData) context.Context {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.started = append(r.started, data)
	return context.WithValue(ctx, traceCtxKey{}, data.Key)
}

func (r *recordingTracer) TraceCallEnd(ctx context.Context, data idempotency.TraceCallEndData) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if ctx.Value(traceCtxKey{}) != data.Key {
		panic("TraceCallEnd did not get the context TraceCallStart returned")
	}
	r.ended = append(r.ended, data)
}

func (r *recordingTracer) TraceCleanerBatch(_ context.Context, data idempotency.TraceCleanerBatchData) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.batches = append(r.batches, data)
}

func (r *recordingTracer) calls() []idempotency.TraceCallEndData {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]idempotency.TraceCallEndData(nil), r.ended...)
}

// One tracer on the store sees every call of every transport, with its
// outcome and where its time went, and every cleaner batch.
func TestTracerSeesEveryTransport(t *testing.T) {
	t.Parallel()
	tr := &recordingTracer{}
	var e *env
	holding, release := make(chan struct{}), make(chan struct{})
	e = newEnv(t, envConfig{
		storeOpts: []idempotency.StoreOption{idempotency.WithInProgressWait(50 * time.Millisecond)},
		tracer:    tr,
		handler: func(ctx context.Context, req *wrapperspb.StringValue) (*wrapperspb.StringValue, error) {
			if req.GetValue() == "slow" {
				close(holding)
				select { // holds the key until the duplicate has given up
				case <-release:
				case <-time.After(liveness):
					return nil, status.Error(codes.DeadlineExceeded, "the test never released the slow call")
				}
			}
			return e.insertLedger(ctx, req)
		},
	})
	ctx := context.Background()
	require.NoError(t, e.call(ctx, methodCharge, "k", "x").err)
	require.True(t, e.call(ctx, methodCharge, "k", "x").replayed)
	require.Equal(t, codes.FailedPrecondition, status.Code(e.call(ctx, methodCharge, "k", "y").err))
	require.Equal(t, codes.InvalidArgument, status.Code(e.call(ctx, methodCharge, "bad key", "x").err))
	require.NoError(t, e.call(ctx, methodCharge, "", "x").err, "passes through, not traced")
	slow := make(chan reply, 1)
	go func() { slow <- e.call(ctx, methodCharge, "slow", "slow") }()
	await(t, holding, "the slow call's handler to run")
	require.Equal(t, codes.Aborted, status.Code(e.call(ctx, methodCharge, "slow", "slow").err))
	close(release)
	require.NoError(t, await(t, slow, "the slow call").err)

	_, err := e.store.ProcessMessage(ctx, idempotency.Message{Scope: "orders", ID: "m-1"}, func(context.Context, pgx.Tx) error { return nil })
	require.NoError(t, err)
	_, err = e.store.Execute(ctx, idempotency.Call{Key: "d-1", Method: "direct", TTL: time.Millisecond}, func(context.Context, pgx.Tx) (proto.Message, error) { return nil, nil })
	require.NoError(t, err)

	mw := idempotency.HTTPMiddleware(e.store)(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { w.WriteHeader(http.StatusCreated) }))
	mux := http.NewServeMux()
	mux.Handle("POST /v1/things", mw)
	req, _ := http.NewRequest(http.MethodPost, "/v1/things", strings.NewReader("{}"))
	req.Header.Set(idempotency.HeaderKey, "h-1")
	w := &discardWriter{header: http.Header{}}
	mux.ServeHTTP(w, req)
	require.Equal(t, http.StatusCreated, w.status)

	time.Sleep(5 * time.Millisecond) // d-1 expires
	n, err := e.store.DeleteExpired(ctx, 10)
	require.NoError(t, err)
	require.EqualValues(t, 1, n)

	type seen struct {
		transport idempotency.Transport
		method    string
		key       string
		outcome   idempotency.Outcome
	}
	var got []seen
	byKey := map[string]idempotency.TraceCallEndData{}
	for _, c := range tr.calls() {
		got = append(got, seen{c.Transport, c.Method, c.Key, c.Outcome})
		if c.Outcome == idempotency.OutcomeExecuted {
			byKey[c.Key] = c
		}
		if c.Transport == idempotency.TransportMessage {
			require.Equal(t, "orders", c.Scope, "the message's scope, apart from its method")
		} else {
			require.Empty(t, c.Scope)
		}
		require.Positive(t, c.Duration, "%v", c)
		require.GreaterOrEqual(t, c.Duration, c.Claim+c.Wait+c.Handler+c.Commit, "%v", c)
	}
	require.ElementsMatch(t, []seen{
		{idempotency.TransportGRPC, methodCharge, "k", idempotency.OutcomeExecuted},
		{idempotency.TransportGRPC, methodCharge, "k", idempotency.OutcomeReplayed},
		{idempotency.TransportGRPC, methodCharge, "k", idempotency.OutcomeKeyReused},
		{idempotency.TransportGRPC, methodCharge, "bad key", idempotency.OutcomeRejected},
		{idempotency.TransportGRPC, methodCharge, "slow", idempotency.OutcomeExecuted},
		{idempotency.TransportGRPC, methodCharge, "slow", idempotency.OutcomeInProgress},
		{idempotency.TransportMessage, "", "m-1", idempotency.OutcomeExecuted},
		{idempotency.TransportDirect, "direct", "d-1", idempotency.OutcomeExecuted},
		{idempotency.TransportHTTP, "POST /v1/things", "h-1", idempotency.OutcomeExecuted},
	}, got)

	// What happened, not how long it took: the slow call's phases were
	// each measured, and the duplicate was traced as waiting.
	k := byKey["slow"]
	require.Positive(t, k.Handler, "the handler's time")
	require.Positive(t, k.Claim)
	require.Positive(t, k.Commit)
	for _, c := range tr.calls() {
		if c.Outcome == idempotency.OutcomeInProgress {
			require.Positive(t, c.Wait, "the duplicate waited outside the database")
			require.Positive(t, c.Claim, "and looked at the key while it waited")
			require.Zero(t, c.Handler, "its handler never ran")
			require.ErrorIs(t, c.Err, idempotency.ErrInProgress)
		}
	}
	require.Len(t, tr.batches, 1)
	require.EqualValues(t, 1, tr.batches[0].Deleted)
}

// discardWriter is a minimal http.ResponseWriter for calling a handler
// directly.
type discardWriter struct {
	header http.Header
	status int
}

func (d *discardWriter) Header() http.Header { return d.header }
func (d *discardWriter) WriteHeader(code int) {
	if d.status == 0 {
		d.status = code
	}
}
func (d *discardWriter) Write(p []byte) (int, error) {
	d.WriteHeader(http.StatusOK)
	return len(p), nil
}

// panickingTracer is a tracer with a bug: it panics where told to.
type panickingTracer struct{ inStart, inEnd, inCleaner bool }

func (p panickingTracer) TraceCallStart(ctx context.Context, _ idempotency.TraceCallStartData) context.Context {
	if p.inStart {
		panic("metrics bug in TraceCallStart")
	}
	return ctx
}

func (p panickingTracer) TraceCallEnd(context.Context, idempotency.TraceCallEndData) {
	if p.inEnd {
		panic("metrics bug in TraceCallEnd")
	}
}

func (p panickingTracer) TraceCleanerBatch(context.Context, idempotency.TraceCleanerBatchData) {
	if p.inCleaner {
		panic("metrics bug in TraceCleanerBatch")
	}
}

// It failed (the test binary crashed) when a tracer's panic went up
// through the call: a bug in metrics code took the server down. A
// panicking tracer changes nothing a client, a consumer or the cleaner
// sees, and its first panic is logged once, with its stack. Not parallel:
// it replaces slog's default logger.
func TestPanickingTracerNeverFailsACall(t *testing.T) {
	for _, c := range []struct {
		name   string
		tracer panickingTracer
		method string // the method whose panic is logged
	}{
		{"start", panickingTracer{inStart: true, inCleaner: true}, "TraceCallStart"},
		{"end", panickingTracer{inEnd: true, inCleaner: true}, "TraceCallEnd"},
		{"cleaner", panickingTracer{inCleaner: true}, "TraceCleanerBatch"},
	} {
		t.Run(c.name, func(t *testing.T) {
			var logs testdb.SyncBuffer
			defer slog.SetDefault(slog.Default())
			slog.SetDefault(slog.New(slog.NewTextHandler(&logs, nil)))

			e := newEnv(t, envConfig{tracer: c.tracer})
			ctx := context.Background()
			first := e.call(ctx, methodCharge, "k", "x")
			require.NoError(t, first.err)
			require.Equal(t, "succeeded", e.keyState("k"))
			again := e.call(ctx, methodCharge, "k", "x")
			require.True(t, again.replayed)
			require.Equal(t, first.raw, again.raw)
			require.Equal(t, codes.FailedPrecondition, status.Code(e.call(ctx, methodCharge, "k", "y").err), "key reuse is still told")

			mux := http.NewServeMux()
			mux.Handle("POST /v1/things", idempotency.HTTPMiddleware(e.store)(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				_, err := idempotency.MustTxFromContext(r.Context()).Exec(r.Context(), `INSERT INTO ledger (note) VALUES ('http')`)
				require.NoError(t, err)
				w.WriteHeader(http.StatusCreated)
				_, _ = io.WriteString(w, "made")
			})))
			post := func() *httptest.ResponseRecorder {
				req := httptest.NewRequest(http.MethodPost, "/v1/things", strings.NewReader("{}"))
				req.Header.Set(idempotency.HeaderKey, "h")
				w := httptest.NewRecorder()
				mux.ServeHTTP(w, req)
				return w
			}
			w := post()
			require.Equal(t, http.StatusCreated, w.Code)
			require.Equal(t, "made", w.Body.String())
			require.Equal(t, "succeeded", e.keyState("http h"), "stored under the HTTP namespace")
			w = post()
			require.Equal(t, http.StatusCreated, w.Code)
			require.Equal(t, "true", w.Header().Get(idempotency.ReplayedHeader))

			outcome, err := e.store.ProcessMessage(ctx, idempotency.Message{Scope: "orders", ID: "m-1"}, func(context.Context, pgx.Tx) error { return nil })
			require.NoError(t, err)
			require.Equal(t, idempotency.OutcomeExecuted, outcome)
			require.Equal(t, 2, e.ledgerRows(), "the gRPC call, the HTTP request, once each")

			_, err = e.store.Execute(ctx, idempotency.Call{Key: "d-1", Method: "direct", TTL: time.Millisecond}, func(context.Context, pgx.Tx) (proto.Message, error) { return nil, nil })
			require.NoError(t, err)
			time.Sleep(5 * time.Millisecond) // d-1 expires
			n, err := e.store.DeleteExpired(ctx, 10)
			require.NoError(t, err)
			require.EqualValues(t, 1, n)

			require.Equal(t, 1, strings.Count(logs.String(), "the store's Tracer panicked"), "logged once:\n%s", logs.String())
			require.Contains(t, logs.String(), "method="+c.method)
			require.Contains(t, logs.String(), "metrics bug in "+c.method)
			require.Contains(t, logs.String(), "tracer_test.go", "with the stack")
		})
	}
}

// LogTracer writes one line per call's end: the transport, method, scope,
// the client's attempt, the outcome, the duration and the error with its
// code, at a level that says whether someone must act; never the key,
// which can be a secret (a payment's token, say).
func TestLogTracerLogsEveryCallsEndWithoutItsKey(t *testing.T) {
	t.Parallel()
	var logs testdb.SyncBuffer
	e := newEnv(t, envConfig{
		tracer: idempotency.LogTracer(slog.New(slog.NewTextHandler(&logs, nil))),
		opts:   []idempotency.ServerOption{idempotency.WithScope(func(context.Context) (string, error) { return "tenant-a", nil })},
		handler: func(ctx context.Context, req *wrapperspb.StringValue) (*wrapperspb.StringValue, error) {
			switch req.GetValue() {
			case "flaky":
				return nil, status.Error(codes.Unavailable, "provider down")
			case "decline":
				return nil, status.Error(codes.FailedPrecondition, "insufficient funds")
			case "broken": // ends the call's transaction: the engine stores Internal
				_, err := idempotency.MustTxFromContext(ctx).Exec(ctx, "COMMIT")
				return nil, err
			}
			return wrapperspb.String("done"), nil
		},
	})
	ctx := context.Background()
	retried := metadata.AppendToOutgoingContext(ctx, "x-retry-attempt", "2")
	for _, c := range []struct {
		name      string
		ctx       context.Context
		key, body string
		want      []string // in the call's line
	}{
		{"executed", ctx, "secret-k1", "ok", []string{"level=INFO", "outcome=executed", "attempt=1"}},
		{"replayed on the client's third attempt", retried, "secret-k1", "ok", []string{"level=INFO", "outcome=replayed", "attempt=3"}},
		{"released", ctx, "secret-k2", "flaky", []string{"level=WARN", "outcome=released", "code=Unavailable", `error="rpc error: code = Unavailable desc = provider down"`}},
		{"a decided failure stored", ctx, "secret-k3", "decline", []string{"level=INFO", "outcome=executed", "code=FailedPrecondition", "insufficient funds"}},
		{"a fault stored for good", ctx, "secret-k4", "broken", []string{"level=ERROR", "outcome=executed", "code=Internal"}},
		{"key reused", ctx, "secret-k1", "other", []string{"level=WARN", "outcome=key_reused", "code=FailedPrecondition"}},
	} {
		before := len(logs.String())
		_ = e.call(c.ctx, methodCharge, c.key, c.body)
		line := strings.TrimSuffix(logs.String()[before:], "\n")
		require.NotContains(t, line, "\n", "%s: one line per call", c.name)
		for _, w := range append([]string{"transport=grpc", "method=" + methodCharge, "scope=tenant-a", "duration="}, c.want...) {
			require.Contains(t, line, w, c.name)
		}
		t.Logf("%s: %s", c.name, line)
	}
	require.NotContains(t, logs.String(), "secret-k", "keys are never logged")
}

// panickyTracer panics in the methods it is told to, with values
// of several kinds (an error, nil, a value whose String panics).
type panickyTracer struct {
	start, end bool
	value      func() any
}

func (p panickyTracer) TraceCallStart(ctx context.Context, _ idempotency.TraceCallStartData) context.Context {
	if p.start {
		panic(p.value())
	}
	return context.WithValue(ctx, tracedKey{}, "traced")
}

func (p panickyTracer) TraceCallEnd(context.Context, idempotency.TraceCallEndData) {
	if p.end {
		panic(p.value())
	}
}

type tracedKey struct{}

type badStringer struct{}

func (badStringer) String() string { panic("String panicked too") }

// A tracer that panics (at the start, at the end, or both; with an error,
// nil, or a value whose String panics) changes nothing a caller sees:
// Execute's outcomes and errors, the HTTP status and body, and the rows.
func TestPanickingTracerChangesNoOutcome(t *testing.T) {
	t.Parallel()
	values := map[string]func() any{
		"error":         func() any { return errors.New("tracer bug") },
		"nil":           func() any { return nil },
		"string panics": func() any { return badStringer{} },
		"abort handler": func() any { return http.ErrAbortHandler },
	}
	for name, value := range values {
		for _, where := range []panickyTracer{{start: true}, {end: true}, {start: true, end: true}} {
			where.value = value
			label := fmt.Sprintf("%s start=%v end=%v", name, where.start, where.end)
			db := suiteDB(t)
			store := migratedStore(t, db, idempotency.WithTracer(where))
			ctx := context.Background()
			var ran atomic.Int64
			run := func(key string, fail error) (idempotency.Result, error) {
				return store.Execute(ctx, idempotency.Call{Scope: "s", Key: key, Method: "/r31.Svc/Do"},
					func(context.Context, pgx.Tx) (proto.Message, error) {
						ran.Add(1)
						if fail != nil {
							return nil, fail
						}
						return wrapperspb.String("ok-" + key), nil
					})
			}
			res, err := run("a", nil)
			require.NoError(t, err, label)
			require.Equal(t, idempotency.OutcomeExecuted, res.Outcome, label)
			res, err = run("a", nil)
			require.NoError(t, err, label)
			require.Equal(t, idempotency.OutcomeReplayed, res.Outcome, label)
			_, err = run("b", idempotency.Final(status.Error(codes.NotFound, "no such order")))
			require.Equal(t, codes.NotFound, status.Code(err), label)
			_, err = run("b", nil)
			require.Equal(t, codes.NotFound, status.Code(err), label)
			_, err = run("c", status.Error(codes.Unavailable, "downstream"))
			require.Equal(t, codes.Unavailable, status.Code(err), label)
			res, err = run("c", nil)
			require.NoError(t, err, label)
			require.Equal(t, idempotency.OutcomeExecuted, res.Outcome, label)
			require.EqualValues(t, 4, ran.Load(), label)

			srv := httptest.NewServer(idempotency.HTTPMiddleware(store)(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				w.WriteHeader(http.StatusCreated)
				_, _ = io.WriteString(w, "created")
			})))
			for i := range 2 {
				req, err := http.NewRequest(http.MethodPost, srv.URL+"/x", strings.NewReader("{}"))
				require.NoError(t, err)
				req.Header.Set(idempotency.HeaderKey, "h")
				resp, err := srv.Client().Do(req)
				require.NoError(t, err, label)
				b, _ := io.ReadAll(resp.Body)
				resp.Body.Close()
				require.Equal(t, http.StatusCreated, resp.StatusCode, label)
				require.Equal(t, "created", string(b), label)
				require.Equal(t, i == 1, resp.Header.Get(idempotency.ReplayedHeader) == "true", label)
			}
			srv.Close()
			require.Equal(t, 4, db.Count(t, `SELECT count(*) FROM idempotency_keys`), label)
		}
	}
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
