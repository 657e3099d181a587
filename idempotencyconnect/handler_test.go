package idempotencyconnect_test

import (
	"context"
	"encoding/json"
	"errors"
	"os/exec"
	"strings"
	"sync"
	"testing"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/require"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/metadata"

	"github.com/exactlyonce/idempotency"
	"github.com/exactlyonce/idempotency/idempotencyconnect"
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
