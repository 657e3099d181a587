package idempotencyconnect_test

import (
	"context"
	"errors"
	"net/http"
	"sync/atomic"
	"testing"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/reflect/protoreflect"

	"github.com/exactlyonce/idempotency"
	"github.com/exactlyonce/idempotency/idempotencyconnect"
	testingv1 "github.com/exactlyonce/idempotency/internal/testpb/idempotency/testing/v1"
)

// A first attempt that already carries a retry interceptor's marker
// (X-Retry-Attempt: 3, as a stale header of a reused request): the handler
// runs once, and the replay is the same.
func TestReview32bRetryMarkerOnAFirstAttempt(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	var runs atomic.Int64
	url := r32Mount(t, e.store, r32Ledger(&runs), nil, nil, nil)
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
func TestReview32bInterceptorInstalledTwice(t *testing.T) {
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
		require.Equal(t, r32View(t, err1), r32View(t, err2), "%s", p.name)
	}
	require.EqualValues(t, 2*len(protocols), runs.Load())
	require.Equal(t, len(protocols), e.ledgerRows())
}

// An interceptor outside the idempotency interceptor fails the call after
// the handler committed (a response check that flaked): the key is stored,
// the client's retry is answered from it, and the handler ran once.
func TestReview32bOuterErrorAfterCommitIsAnsweredByTheReplay(t *testing.T) {
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
	url := r32Mount(t, e.store, r32Ledger(&runs), []connect.Interceptor{outer}, nil, nil)
	resp, err := client(t, url, procRequired, protocols[2], false).CallUnary(context.Background(), connect.NewRequest(&testingv1.Request{Body: "o"}))
	require.NoError(t, err)
	require.Equal(t, "true", resp.Trailer().Get(idempotency.ReplayedTrailer))
	require.EqualValues(t, 1, runs.Load())
	require.EqualValues(t, 2, outerCalls.Load())
	require.Equal(t, 1, e.ledgerRows())
}
