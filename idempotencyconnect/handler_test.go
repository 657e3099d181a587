package idempotencyconnect_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"os/exec"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/metadata"
	"google.golang.org/protobuf/reflect/protoreflect"

	"github.com/exactlyonce/idempotency"
	"github.com/exactlyonce/idempotency/idempotencyconnect"
	"github.com/exactlyonce/idempotency/internal/testdb"
	testingv1 "github.com/exactlyonce/idempotency/internal/testpb/idempotency/testing/v1"
)

// One key, sent through each of connect's protocols (Connect with JSON and
// with binary protobuf over HTTP/1.1, gRPC over HTTP/2, gRPC-Web), a
// grpc-go client and curl: one call. The handler runs once; every other
// caller gets its response, with the headers and trailers the handler set
// and the replay marker, in its own protocol.
func TestOneKeyThroughEveryProtocolIsOneCall(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	ctx := context.Background()
	first, err := client(t, e.url, procRequired, protocols[0], true).CallUnary(ctx, keyed("order-1", "100"))
	require.NoError(t, err)
	require.Positive(t, first.Msg.GetLedgerId())
	require.Empty(t, first.Trailer().Get(idempotency.ReplayedTrailer), "the first call ran")
	want := first.Msg.GetLedgerId()

	for _, p := range protocols {
		resp, err := client(t, e.url, procRequired, p, true).CallUnary(ctx, keyed("order-1", "100"))
		require.NoError(t, err, p.name)
		require.Equal(t, want, resp.Msg.GetLedgerId(), "%s: the first call's response", p.name)
		require.Equal(t, "charged 100", resp.Msg.GetBody(), p.name)
		require.Equal(t, "true", resp.Trailer().Get(idempotency.ReplayedTrailer), "%s: marked replayed", p.name)
		require.Equal(t, first.Header().Get("X-Ledger-Id"), resp.Header().Get("X-Ledger-Id"), "%s: the handler's header, stored and replayed", p.name)
		require.Equal(t, "ran", resp.Trailer().Get("X-Handler"), "%s: the handler's trailer, stored and replayed", p.name)
	}

	var trailer metadata.MD
	g, err := grpcClient(t, e.url).Required(metadata.AppendToOutgoingContext(ctx, idempotency.MetadataKey, "order-1"), &testingv1.Request{Body: "100"}, grpc.Trailer(&trailer))
	require.NoError(t, err, "grpc-go")
	require.Equal(t, want, g.GetLedgerId(), "grpc-go: the first call's response")
	require.Equal(t, []string{"true"}, trailer.Get(idempotency.ReplayedTrailer), "grpc-go: marked replayed")

	out, err := exec.Command("curl", "-sS", "-i", "-X", "POST", e.url+procRequired,
		"-H", "Content-Type: application/json", "-H", "Idempotency-Key: order-1", "-d", `{"body": "100"}`).CombinedOutput()
	require.NoError(t, err, "curl: %s", out)
	head, body, _ := strings.Cut(strings.ReplaceAll(string(out), "\r\n", "\n"), "\n\n")
	require.Contains(t, head, "200 OK", "curl")
	require.Contains(t, head, "Trailer-Idempotency-Replayed: true", "curl: the Connect protocol sends a unary call's trailers as headers")
	var got struct {
		Body     string `json:"body"`
		LedgerID string `json:"ledgerId"`
	}
	require.NoError(t, json.Unmarshal([]byte(body), &got), "curl: %s", body)
	require.Equal(t, "charged 100", got.Body)

	require.EqualValues(t, 1, e.runs.Load(), "the handler ran once")
	require.Equal(t, 1, e.ledgerRows())
}

// A replay is answered without the handler's response in hand: by another
// handler (a new interceptor, as a replica or a restarted process has)
// whose handler never ran, and which would fail if it did.
func TestReplayNeedsNoRunOfTheMethodInTheProcess(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	ctx := context.Background()
	first, err := client(t, e.url, procRequired, protocols[1], true).CallUnary(ctx, keyed("order-2", "7"))
	require.NoError(t, err)

	other := serve(t, handlers(t, e.store, func(context.Context, *testingv1.Request) (*testingv1.Response, error) {
		t.Error("the replica's handler ran")
		return nil, errors.New("must not run")
	}))
	for _, p := range protocols {
		resp, err := client(t, other, procRequired, p, true).CallUnary(ctx, keyed("order-2", "7"))
		require.NoError(t, err, p.name)
		require.Equal(t, first.Msg.GetLedgerId(), resp.Msg.GetLedgerId(), p.name)
		require.Equal(t, "true", resp.Trailer().Get(idempotency.ReplayedTrailer), p.name)
	}
	require.Equal(t, 1, e.ledgerRows())
}

// 32 callers send one key at once, through the four protocols: the
// handler runs once; the client interceptor retries the callers that meet
// the call still running (Aborted, KEY_IN_PROGRESS) until they get its
// response.
func TestConcurrentDuplicatesRunOnce(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.hold = make(chan struct{})
	ctx := context.Background()
	const n = 32
	var wg sync.WaitGroup
	ids := make([]int64, n)
	errs := make([]error, n)
	for i := range n {
		wg.Go(func() {
			resp, err := client(t, e.url, procRequired, protocols[i%len(protocols)], false).CallUnary(idempotency.WithOutgoingKey(ctx, "order-3"), connect.NewRequest(&testingv1.Request{Body: "5"}))
			errs[i] = err
			if err == nil {
				ids[i] = resp.Msg.GetLedgerId()
			}
		})
	}
	waitFor(t, "the first call runs", func() bool { return e.runs.Load() == 1 })
	close(e.hold)
	wg.Wait()
	for i := range n {
		require.NoError(t, errs[i], "caller %d", i)
		require.Equal(t, ids[0], ids[i], "caller %d got the one call's response", i)
	}
	require.EqualValues(t, 1, e.runs.Load())
	require.Equal(t, 1, e.ledgerRows())
}

// The same key with another request: FailedPrecondition with the details
// the gRPC side sends (ErrorInfo KEY_REUSED, PreconditionFailure), in
// every protocol; the handler does not run again.
func TestKeyReusedForAnotherRequest(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	ctx := context.Background()
	_, err := client(t, e.url, procRequired, protocols[0], true).CallUnary(ctx, keyed("order-4", "100"))
	require.NoError(t, err)
	for _, p := range protocols {
		_, err := client(t, e.url, procRequired, p, false).CallUnary(ctx, keyed("order-4", "999"))
		require.Equal(t, connect.CodeFailedPrecondition, connectCode(err), "%s: %v", p.name, err)
		require.True(t, idempotencyconnect.IsKeyReused(err), "%s: the library's answer, not a handler's", p.name)
		var info *errdetails.ErrorInfo
		var pf *errdetails.PreconditionFailure
		for _, d := range errDetails(t, err) {
			switch v := d.(type) {
			case *errdetails.ErrorInfo:
				info = v
			case *errdetails.PreconditionFailure:
				pf = v
			}
		}
		require.NotNil(t, info, p.name)
		require.Equal(t, "KEY_REUSED", info.GetReason())
		require.Equal(t, idempotency.ErrorDomain, info.GetDomain())
		require.NotNil(t, pf, p.name)
	}
	require.EqualValues(t, 1, e.runs.Load())
}

// errDetails are the details of a connect error, decoded.
func errDetails(t *testing.T, err error) []any {
	t.Helper()
	var ce *connect.Error
	require.True(t, errors.As(err, &ce), "%v is a connect error", err)
	var out []any
	for _, d := range ce.Details() {
		v, err := d.Value()
		require.NoError(t, err)
		out = append(out, v)
	}
	return out
}

// A handler's own errors keep their code, message and details: a final
// one (FailedPrecondition) is stored and replayed with them, a transient
// one (Unavailable) releases the key and the retry runs the handler again.
func TestHandlerErrorsAreStoredOrReleasedAsOverGRPC(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	fail := true
	var mu sync.Mutex
	e.handle = func(ctx context.Context, req *testingv1.Request) (*testingv1.Response, error) {
		mu.Lock()
		defer mu.Unlock()
		switch {
		case req.GetBody() == "declined":
			ce := connect.NewError(connect.CodeFailedPrecondition, errors.New("the card was declined"))
			d, _ := connect.NewErrorDetail(&errdetails.ErrorInfo{Reason: "CARD_DECLINED", Domain: "payments.example"})
			ce.AddDetail(d)
			ce.Meta().Set("X-Decline-Code", "51")
			return nil, ce
		case fail:
			fail = false
			return nil, connect.NewError(connect.CodeUnavailable, errors.New("the ledger is busy"))
		}
		return ledger(ctx, req)
	}
	ctx := context.Background()
	plain := client(t, e.url, procRequired, protocols[0], true)
	for range 2 {
		_, err := plain.CallUnary(ctx, keyed("order-5", "declined"))
		require.Equal(t, connect.CodeFailedPrecondition, connectCode(err))
		require.ErrorContains(t, err, "the card was declined")
		require.False(t, idempotencyconnect.IsKeyReused(err), "the handler's own FailedPrecondition")
		var ce *connect.Error
		require.True(t, errors.As(err, &ce))
		require.Equal(t, "51", ce.Meta().Get("X-Decline-Code"), "the error's metadata, stored and replayed")
		found := false
		for _, d := range errDetails(t, err) {
			if info, ok := d.(*errdetails.ErrorInfo); ok && info.GetReason() == "CARD_DECLINED" {
				found = true
			}
		}
		require.True(t, found, "the handler's detail, stored and replayed")
	}
	require.EqualValues(t, 1, e.runs.Load(), "the final error replayed")

	_, err := plain.CallUnary(ctx, keyed("order-6", "10"))
	require.Equal(t, connect.CodeUnavailable, connectCode(err))
	resp, err := plain.CallUnary(ctx, keyed("order-6", "10"))
	require.NoError(t, err, "the released key runs again")
	require.Positive(t, resp.Msg.GetLedgerId())
	require.Equal(t, 1, e.ledgerRows())
}

// Keys follow the method's descriptor: a NO_SIDE_EFFECTS method passes
// through (a key is ignored, the handler runs every time, outside any
// transaction), an annotated one without a key is InvalidArgument
// (MISSING_KEY, with BadRequest).
func TestMethodPoliciesComeFromTheDescriptor(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	ctx := context.Background()
	for range 2 {
		resp, err := client(t, e.url, procNoSideEffects, protocols[0], true).CallUnary(ctx, keyed("ignored", "read"))
		require.NoError(t, err)
		require.Equal(t, "unprotected read", resp.Msg.GetBody())
	}
	require.EqualValues(t, 2, e.runs.Load())

	_, err := client(t, e.url, procRequired, protocols[0], true).CallUnary(ctx, connect.NewRequest(&testingv1.Request{Body: "1"}))
	require.Equal(t, connect.CodeInvalidArgument, connectCode(err))
	var reason string
	for _, d := range errDetails(t, err) {
		if info, ok := d.(*errdetails.ErrorInfo); ok {
			reason = info.GetReason()
		}
	}
	require.Equal(t, "MISSING_KEY", reason)
	require.EqualValues(t, 2, e.runs.Load(), "the handler did not run")
}

// A streaming call that carries a key is refused (Unimplemented,
// STREAMING_UNSUPPORTED) before its handler runs; without a key it runs.
func TestKeyedStreamingCallsAreRefused(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	ctx := context.Background()
	c := connect.NewClient[testingv1.Request, testingv1.Response](httpClient(t, false), e.url+procStream)
	req := keyed("order-7", "s")
	stream, err := c.CallServerStream(ctx, req)
	require.NoError(t, err)
	defer stream.Close()
	require.False(t, stream.Receive())
	require.Equal(t, connect.CodeUnimplemented, connectCode(stream.Err()))
	require.ErrorContains(t, stream.Err(), "streaming")

	unkeyed, err := c.CallServerStream(ctx, connect.NewRequest(&testingv1.Request{Body: "s"}))
	require.NoError(t, err)
	defer unkeyed.Close()
	require.True(t, unkeyed.Receive())
	require.Equal(t, "streamed", unkeyed.Msg().GetBody())
}

// A connect client (gRPC protocol) against a grpc-go server with
// UnaryServerInterceptor, on the same store as a connect handler: the key
// is one call whichever server it reaches.
func TestConnectClientAgainstAGRPCServerIsTheSameCall(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	srv := grpc.NewServer(grpc.ChainUnaryInterceptor(idempotency.UnaryServerInterceptor(e.store)))
	testingv1.RegisterPolicyServiceServer(srv, grpcService{e: e})
	lis := listen(t)
	go func() { _ = srv.Serve(lis) }()
	t.Cleanup(srv.Stop)
	grpcURL := "http://" + lis.Addr().String()
	ctx := context.Background()

	var key string
	resp, err := client(t, grpcURL, procRequired, protocols[2], false).CallUnary(ctx, connect.NewRequest(&testingv1.Request{Body: "42"}))
	require.NoError(t, err, "connect client, grpc-go server")
	require.Positive(t, resp.Msg.GetLedgerId())
	key = resp.Header().Get("X-Key-Seen")
	require.NotEmpty(t, key, "the client interceptor sent a key")

	again, err := client(t, e.url, procRequired, protocols[0], true).CallUnary(ctx, keyed(key, "42"))
	require.NoError(t, err, "connect client, connect handler")
	require.Equal(t, resp.Msg.GetLedgerId(), again.Msg.GetLedgerId(), "one call, whichever server the key reached")
	require.Equal(t, "true", again.Trailer().Get(idempotency.ReplayedTrailer))
	require.EqualValues(t, 1, e.runs.Load())
}

// grpcService is the test service on grpc-go, writing through the env.
type grpcService struct {
	testingv1.UnimplementedPolicyServiceServer
	e *env
}

func (g grpcService) Required(ctx context.Context, req *testingv1.Request) (*testingv1.Response, error) {
	md, _ := metadata.FromIncomingContext(ctx)
	_ = grpc.SetHeader(ctx, metadata.Pairs("x-key-seen", strings.Join(md.Get(idempotency.MetadataKey), ",")))
	return g.e.serve(ctx, req)
}

func (g grpcService) NoSideEffects(ctx context.Context, req *testingv1.Request) (*testingv1.Response, error) {
	return g.e.serve(ctx, req)
}

// The caller's deadline (Connect-Timeout-Ms) passes while the handler
// runs. A handler that honours it: DeadlineExceeded, nothing committed,
// the retry runs. A handler that ignores it and commits: the caller got
// DeadlineExceeded, and its retry gets the committed answer.
func TestCallersDeadlinePassingMidCall(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	var runs atomic.Int64
	fn := func(ctx context.Context, req *connect.Request[testingv1.Request]) (*connect.Response[testingv1.Response], error) {
		n := runs.Add(1)
		if n == 1 || n == 3 {
			<-ctx.Done()
			if n == 1 {
				return nil, ctx.Err()
			}
			// Ignores the deadline: its write goes on.
			tx := idempotency.MustTxFromContext(ctx)
			var id int64
			if err := tx.QueryRow(context.WithoutCancel(ctx), `INSERT INTO ledger (body) VALUES ($1) RETURNING id`, req.Msg.GetBody()).Scan(&id); err != nil {
				return nil, err
			}
			return connect.NewResponse(&testingv1.Response{Body: "late", LedgerId: id}), nil
		}
		resp, err := ledger(ctx, req.Msg)
		if err != nil {
			return nil, err
		}
		return connect.NewResponse(resp), nil
	}
	url := mount(t, e.store, fn, nil, nil, nil)
	c := client(t, url, procRequired, protocols[0], true)
	short, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	_, err := c.CallUnary(short, keyed("r32-dl-1", "a"))
	cancel()
	require.Equal(t, connect.CodeDeadlineExceeded, connectCode(err))
	resp, err := c.CallUnary(context.Background(), keyed("r32-dl-1", "a"))
	require.NoError(t, err, "released: runs again")
	require.Equal(t, "charged a", resp.Msg.GetBody())

	short, cancel = context.WithTimeout(context.Background(), 300*time.Millisecond)
	_, err = c.CallUnary(short, keyed("r32-dl-2", "b"))
	cancel()
	require.Equal(t, connect.CodeDeadlineExceeded, connectCode(err))
	var again *connect.Response[testingv1.Response]
	waitFor(t, "the late run committed", func() bool {
		again, err = c.CallUnary(context.Background(), keyed("r32-dl-2", "b"))
		return err == nil || !idempotencyconnect.IsInProgress(err)
	})
	require.NoError(t, err)
	require.Equal(t, "late", again.Msg.GetBody(), "the committed run's answer")
	require.EqualValues(t, 3, runs.Load())
	require.Equal(t, 2, e.ledgerRows())
}

// Two Idempotency-Key headers, and the binary form, sent to the handler:
// InvalidArgument with the library's ErrorInfo, the handler not run.
func TestTwoKeyHeadersOrABinaryKeyAreRefused(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	var runs atomic.Int64
	url := mount(t, e.store, ledgerFn(&runs), nil, nil, nil)
	for name, set := range map[string]func(h http.Header){
		"two":     func(h http.Header) { h.Add("Idempotency-Key", "a"); h.Add("Idempotency-Key", "b") },
		"twosame": func(h http.Header) { h.Add("Idempotency-Key", "a"); h.Add("idempotency-key", "a") },
		"bin":     func(h http.Header) { h.Set("Idempotency-Key-Bin", connect.EncodeBinaryHeader([]byte("a"))) },
		"both":    func(h http.Header) { h.Set("Idempotency-Key", "a"); h.Set("Idempotency-Key-Bin", "YQ") },
	} {
		for _, p := range protocols {
			req := connect.NewRequest(&testingv1.Request{Body: "k"})
			set(req.Header())
			_, err := client(t, url, procRequired, p, true).CallUnary(context.Background(), req)
			require.Equal(t, connect.CodeInvalidArgument, connectCode(err), "%s %s: %v", name, p.name, err)
			found := false
			for _, d := range errDetails(t, err) {
				if info, ok := d.(interface{ GetDomain() string }); ok && info.GetDomain() == idempotency.ErrorDomain {
					found = true
				}
			}
			require.True(t, found, "%s %s: the library's ErrorInfo", name, p.name)
		}
	}
	require.EqualValues(t, 0, runs.Load())
}

// 16 callers of one key at once: connect clients in every protocol to a
// connect handler, and grpc-go clients to a grpc-go server with
// UnaryServerInterceptor on the same store, on a database whose sessions
// default to SERIALIZABLE: one run, one row, one answer.
func TestSixteenCallersAcrossFrameworksUnderSerializableRunOnce(t *testing.T) {
	t.Parallel()
	db := testdb.NewConfigured(t, func(c *pgxpool.Config) {
		c.ConnConfig.RuntimeParams["default_transaction_isolation"] = "serializable"
		c.MaxConns = 8
	})
	store, err := idempotency.NewStore(db.Pool)
	require.NoError(t, err)
	ctx := context.Background()
	require.NoError(t, store.Migrate(ctx))
	_, err = db.Pool.Exec(ctx, `CREATE TABLE ledger (id bigserial PRIMARY KEY, body text NOT NULL)`)
	require.NoError(t, err)
	var runs atomic.Int64
	hold := make(chan struct{})
	work := func(ctx context.Context, req *testingv1.Request) (*testingv1.Response, error) {
		runs.Add(1)
		<-hold
		return ledger(ctx, req)
	}
	url := mount(t, store, func(ctx context.Context, req *connect.Request[testingv1.Request]) (*connect.Response[testingv1.Response], error) {
		resp, err := work(ctx, req.Msg)
		if err != nil {
			return nil, err
		}
		return connect.NewResponse(resp), nil
	}, nil, nil, nil)
	srv := grpc.NewServer(grpc.ChainUnaryInterceptor(idempotency.UnaryServerInterceptor(store)))
	testingv1.RegisterPolicyServiceServer(srv, serializableWork{work: work})
	lis := listen(t)
	go func() { _ = srv.Serve(lis) }()
	t.Cleanup(srv.Stop)
	grpcURL := "http://" + lis.Addr().String()
	gc := grpcClient(t, grpcURL, idempotency.UnaryClientInterceptor(idempotency.WithRetryBackoff(5*time.Millisecond, 20*time.Millisecond)))

	const n = 16
	ids := make([]int64, n)
	errs := make([]error, n)
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() {
			kctx := idempotency.WithOutgoingKey(ctx, "r32-sixteen")
			if i%5 == 4 {
				resp, err := gc.Required(kctx, &testingv1.Request{Body: "16"})
				errs[i] = err
				ids[i] = resp.GetLedgerId()
				return
			}
			resp, err := client(t, url, procRequired, protocols[i%len(protocols)], false, idempotency.WithRetryBackoff(5*time.Millisecond, 20*time.Millisecond)).
				CallUnary(kctx, connect.NewRequest(&testingv1.Request{Body: "16"}))
			errs[i] = err
			if err == nil {
				ids[i] = resp.Msg.GetLedgerId()
			}
		})
	}
	waitFor(t, "the first run", func() bool { return runs.Load() >= 1 })
	time.Sleep(200 * time.Millisecond) // let the others meet the running call (not asserted on)
	close(hold)
	wg.Wait()
	for i := range n {
		require.NoError(t, errs[i], "caller %d", i)
		require.Equal(t, ids[0], ids[i], "caller %d", i)
	}
	require.EqualValues(t, 1, runs.Load())
	require.Equal(t, 1, db.Count(t, `SELECT count(*) FROM ledger`))
}

type serializableWork struct {
	testingv1.UnimplementedPolicyServiceServer
	work func(context.Context, *testingv1.Request) (*testingv1.Response, error)
}

func (w serializableWork) Required(ctx context.Context, req *testingv1.Request) (*testingv1.Response, error) {
	return w.work(ctx, req)
}

// One key sent to two procedures: the second is KEY_REUSED, not run.
func TestSameKeyForAnotherProcedureIsKeyReused(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	var runs atomic.Int64
	url := mount(t, e.store, ledgerFn(&runs), nil, nil, nil)
	ctx := context.Background()
	_, err := client(t, url, procRequired, protocols[0], true).CallUnary(ctx, keyed("r32-proc", "p"))
	require.NoError(t, err)
	_, err = client(t, url, "/idempotency.testing.v1.PolicyService/Optional", protocols[1], true).CallUnary(ctx, keyed("r32-proc", "p"))
	require.Equal(t, connect.CodeFailedPrecondition, connectCode(err), "%v", err)
	require.EqualValues(t, 1, runs.Load())
}

// A handler that returns a *connect.Response with a nil message: every
// caller gets the same answer, and the handler runs once.
func TestNilResponseMessageRunsOnceAndReplaysAlike(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	var runs atomic.Int64
	fn := func(ctx context.Context, req *connect.Request[testingv1.Request]) (*connect.Response[testingv1.Response], error) {
		runs.Add(1)
		if _, err := ledger(ctx, req.Msg); err != nil {
			return nil, err
		}
		return connect.NewResponse[testingv1.Response](nil), nil
	}
	url := mount(t, e.store, fn, nil, nil, nil)
	ctx := context.Background()
	for _, p := range protocols {
		key := "r32-nil-" + p.name
		c := client(t, url, procRequired, p, true)
		r1, err1 := c.CallUnary(ctx, keyed(key, "n"))
		r2, err2 := c.CallUnary(ctx, keyed(key, "n"))
		require.Equal(t, connectCode(err1), connectCode(err2), "%s: %v / %v", p.name, err1, err2)
		if err1 == nil {
			require.True(t, protoEqual(r1.Msg, r2.Msg), p.name)
		}
	}
	require.EqualValues(t, len(protocols), runs.Load())
}

func protoEqual(a, b *testingv1.Response) bool {
	return a.GetBody() == b.GetBody() && a.GetLedgerId() == b.GetLedgerId()
}

// A handler that sets a header through CallInfo, writes, then panics,
// under connect.WithRecover outside the idempotency interceptor: the
// writes roll back, the key is released (the retry runs and commits once)
// and the database connection goes back to the pool.
func TestPanicUnderWithRecoverRollsBackAndReleasesTheKey(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	var runs atomic.Int64
	fn := func(ctx context.Context, req *connect.Request[testingv1.Request]) (*connect.Response[testingv1.Response], error) {
		n := runs.Add(1)
		resp, err := ledger(ctx, req.Msg)
		if err != nil {
			return nil, err
		}
		if info, ok := connect.CallInfoForHandlerContext(ctx); ok {
			info.ResponseHeader().Set("X-Run", fmt.Sprint(n))
		}
		if req.Msg.GetBody() == "panic" && n <= 20 {
			panic("boom")
		}
		return connect.NewResponse(resp), nil
	}
	recoverOpt := connect.WithRecover(func(context.Context, connect.Spec, http.Header, any) error {
		return connect.NewError(connect.CodeInternal, errors.New("recovered"))
	})
	url := mount(t, e.store, fn, nil, nil, []connect.HandlerOption{recoverOpt})
	ctx := context.Background()
	c := client(t, url, procRequired, protocols[1], true)
	for i := range 20 { // more than the pool's 8 connections
		_, err := c.CallUnary(ctx, keyed(fmt.Sprintf("r32-panic-%d", i), "panic"))
		require.Equal(t, connect.CodeInternal, connectCode(err), "%v", err)
	}
	require.Equal(t, 0, e.ledgerRows(), "the panicking runs rolled back")
	resp, err := c.CallUnary(ctx, keyed("r32-panic-0", "panic"))
	require.NoError(t, err, "the released key runs again")
	require.Equal(t, "21", resp.Header().Get("X-Run"))
	again, err := c.CallUnary(ctx, keyed("r32-panic-0", "panic"))
	require.NoError(t, err)
	require.Equal(t, resp.Msg.GetLedgerId(), again.Msg.GetLedgerId())
	require.Equal(t, []string{"21"}, again.Header().Values("X-Run"), "the replay has the committed run's header only")
	require.Equal(t, 1, e.ledgerRows())
}

// An authentication interceptor placed after the idempotency interceptor
// (inside it) that refuses the caller: Unauthenticated, the key released,
// and the corrected call (with credentials) runs.
func TestAuthRefusalInsideTheInterceptorReleasesTheKey(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	var runs atomic.Int64
	auth := connect.UnaryInterceptorFunc(func(next connect.UnaryFunc) connect.UnaryFunc {
		return func(ctx context.Context, req connect.AnyRequest) (connect.AnyResponse, error) {
			if req.Header().Get("Authorization") == "" {
				return nil, connect.NewError(connect.CodeUnauthenticated, errors.New("who are you"))
			}
			return next(ctx, req)
		}
	})
	url := mount(t, e.store, ledgerFn(&runs), nil, []connect.Interceptor{auth}, nil)
	ctx := context.Background()
	c := client(t, url, procRequired, protocols[0], true)
	_, err := c.CallUnary(ctx, keyed("r32-auth", "a"))
	require.Equal(t, connect.CodeUnauthenticated, connectCode(err))
	req := keyed("r32-auth", "a")
	req.Header().Set("Authorization", "Bearer x")
	resp, err := c.CallUnary(ctx, req)
	require.NoError(t, err)
	require.Positive(t, resp.Msg.GetLedgerId())
	require.EqualValues(t, 1, runs.Load())
}

// A first attempt that already carries a retry interceptor's marker
// (X-Retry-Attempt: 3, as a stale header of a reused request): the handler
// runs once, and the replay is the same.
func TestRetryMarkerOnAFirstAttemptRunsOnce(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	var runs atomic.Int64
	url := mount(t, e.store, ledgerFn(&runs), nil, nil, nil)
	for _, p := range protocols {
		c := client(t, url, procRequired, p, true)
		req := keyed("r32b-marker-first-"+p.name, "m")
		req.Header().Set("X-Retry-Attempt", "3")
		first, err := c.CallUnary(context.Background(), req)
		require.NoError(t, err)
		require.Empty(t, first.Trailer().Get(idempotency.ReplayedTrailer))
		again, err := c.CallUnary(context.Background(), req)
		require.NoError(t, err)
		require.Equal(t, first.Msg.GetLedgerId(), again.Msg.GetLedgerId())
	}
	require.EqualValues(t, len(protocols), runs.Load())
	require.Equal(t, len(protocols), e.ledgerRows())
}

// The handler interceptor installed twice (a handler option and again in
// a shared option list): one run per key, the handler's headers on the
// first answer and the replay alike, a final error's metadata likewise.
func TestInterceptorInstalledTwiceRunsOncePerKey(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	var runs atomic.Int64
	ic, err := idempotencyconnect.NewHandlerInterceptor(e.store)
	require.NoError(t, err)
	fn := func(ctx context.Context, req *connect.Request[testingv1.Request]) (*connect.Response[testingv1.Response], error) {
		runs.Add(1)
		info, _ := connect.CallInfoForHandlerContext(ctx)
		info.ResponseHeader().Set("X-Info", "i")
		info.ResponseTrailer().Set("X-Info-Trailer", "t")
		if req.Msg.GetBody() == "fail" {
			ce := connect.NewError(connect.CodeNotFound, errors.New("no such account"))
			ce.Meta().Set("X-Err", "e")
			return nil, ce
		}
		resp, err := ledger(ctx, req.Msg)
		if err != nil {
			return nil, err
		}
		r := connect.NewResponse(resp)
		r.Header().Set("X-Resp", "r")
		return r, nil
	}
	mux := http.NewServeMux()
	for _, name := range []protoreflect.Name{"Required"} {
		m := method(name)
		path := "/" + string(m.Parent().FullName()) + "/" + string(m.Name())
		mux.Handle(path, connect.NewUnaryHandler(path, fn, connect.WithSchema(m), connect.WithInterceptors(ic), connect.WithHandlerOptions(connect.WithInterceptors(ic))))
	}
	url := serve(t, mux)
	for _, p := range protocols {
		c := client(t, url, procRequired, p, true)
		key := "r32b-twice-" + p.name
		first, err := c.CallUnary(context.Background(), keyed(key, "ok"))
		require.NoError(t, err)
		again, err := c.CallUnary(context.Background(), keyed(key, "ok"))
		require.NoError(t, err)
		require.Equal(t, "true", again.Trailer().Get(idempotency.ReplayedTrailer))
		for _, h := range []string{"X-Info", "X-Resp"} {
			require.Equal(t, first.Header().Values(h), again.Header().Values(h), "%s %s", p.name, h)
			require.NotEmpty(t, first.Header().Values(h), "%s %s", p.name, h)
		}
		require.Equal(t, first.Trailer().Values("X-Info-Trailer"), again.Trailer().Values("X-Info-Trailer"))
		_, err1 := c.CallUnary(context.Background(), keyed(key+"-f", "fail"))
		_, err2 := c.CallUnary(context.Background(), keyed(key+"-f", "fail"))
		require.Equal(t, viewOf(t, err1), viewOf(t, err2), "%s", p.name)
	}
	require.EqualValues(t, 2*len(protocols), runs.Load())
	require.Equal(t, len(protocols), e.ledgerRows())
}

// An interceptor outside the idempotency interceptor fails the call after
// the handler committed (a response check that flaked): the key is stored,
// the client's retry is answered from it, and the handler ran once.
func TestOuterErrorAfterCommitIsAnsweredByTheReplay(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	var runs, outerCalls atomic.Int64
	outer := connect.UnaryInterceptorFunc(func(next connect.UnaryFunc) connect.UnaryFunc {
		return func(ctx context.Context, req connect.AnyRequest) (connect.AnyResponse, error) {
			resp, err := next(ctx, req)
			if outerCalls.Add(1) == 1 {
				return nil, connect.NewError(connect.CodeUnavailable, errors.New("response check flaked"))
			}
			return resp, err
		}
	})
	url := mount(t, e.store, ledgerFn(&runs), []connect.Interceptor{outer}, nil, nil)
	resp, err := client(t, url, procRequired, protocols[2], false).CallUnary(context.Background(), connect.NewRequest(&testingv1.Request{Body: "o"}))
	require.NoError(t, err)
	require.Equal(t, "true", resp.Trailer().Get(idempotency.ReplayedTrailer))
	require.EqualValues(t, 1, runs.Load())
	require.EqualValues(t, 2, outerCalls.Load())
	require.Equal(t, 1, e.ledgerRows())
}

// An interceptor outside the idempotency interceptor (an auth or audit
// interceptor, placed first as the docs ask) that reads the response
// message by its type: it sees the first answer's message and must see
// the replay's the same way, or the replay differs from the first answer.
//
// A known limit, documented on NewHandlerInterceptor: a replay's response
// holds the stored message behind a wrapper (a connect.Response's type is
// fixed at compile time, and a replay may be answered by a process that
// never ran the method); an interceptor outside reads it as a
// proto.Message, or goes inside.
func TestOuterInterceptorSeesTheReplayByItsType(t *testing.T) {
	t.Skip("a known limit: an interceptor outside sees a replay's message behind a wrapper type (NewHandlerInterceptor's doc)")
	t.Parallel()
	e := newEnv(t)
	var runs atomic.Int64
	audit := connect.UnaryInterceptorFunc(func(next connect.UnaryFunc) connect.UnaryFunc {
		return func(ctx context.Context, req connect.AnyRequest) (connect.AnyResponse, error) {
			resp, err := next(ctx, req)
			if err != nil {
				return nil, err
			}
			m, ok := resp.Any().(*testingv1.Response)
			if !ok {
				return nil, connect.NewError(connect.CodeInternal, fmt.Errorf("audit: unexpected response %T", resp.Any()))
			}
			resp.Header().Set("X-Audited-Ledger", fmt.Sprint(m.GetLedgerId()))
			return resp, nil
		}
	})
	url := mount(t, e.store, ledgerFn(&runs), []connect.Interceptor{audit}, nil, nil)
	c := client(t, url, procRequired, protocols[1], true)
	first, err := c.CallUnary(context.Background(), keyed("r32-audit", "a"))
	require.NoError(t, err)
	again, err := c.CallUnary(context.Background(), keyed("r32-audit", "a"))
	require.NoError(t, err, "the replay through the same interceptors")
	require.Equal(t, first.Header().Get("X-Audited-Ledger"), again.Header().Get("X-Audited-Ledger"))
	require.EqualValues(t, 1, runs.Load())
}
