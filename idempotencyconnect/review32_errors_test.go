package idempotencyconnect_test

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"sort"
	"strings"
	"sync/atomic"
	"testing"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/require"
	"google.golang.org/genproto/googleapis/rpc/errdetails"

	"github.com/exactlyonce/idempotency"
	testingv1 "github.com/exactlyonce/idempotency/internal/testpb/idempotency/testing/v1"
)

// r32ErrView is what a client sees of an error: code, message, details
// and the metadata it came with (less the replay marker).
type r32ErrView struct {
	code    connect.Code
	msg     string
	details []string
	meta    map[string]string
}

func r32View(t *testing.T, err error) r32ErrView {
	t.Helper()
	var ce *connect.Error
	require.True(t, errors.As(err, &ce), "%v is a connect error", err)
	v := r32ErrView{code: ce.Code(), msg: ce.Message(), meta: map[string]string{}}
	for _, d := range ce.Details() {
		v.details = append(v.details, d.Type())
	}
	for k, vs := range ce.Meta() {
		k = strings.ToLower(k)
		if strings.HasPrefix(k, "x-") {
			v.meta[k] = strings.Join(vs, ",")
		}
	}
	sort.Strings(v.details)
	return v
}

// A handler that sets headers and trailers through CallInfo, then fails
// with a final error wrapping a connect error (fmt.Errorf("%w")) that has
// a detail and metadata: every caller of the key, in every protocol, sees
// the code, message, details and metadata the first caller saw.
func TestReview32WrappedFinalErrorWithCallInfoHeadersIsReplayedAsSent(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	var runs atomic.Int64
	fn := func(ctx context.Context, req *connect.Request[testingv1.Request]) (*connect.Response[testingv1.Response], error) {
		runs.Add(1)
		info, ok := connect.CallInfoForHandlerContext(ctx)
		require.True(t, ok)
		info.ResponseHeader().Set("X-Info-Header", "h")
		info.ResponseTrailer().Set("X-Info-Trailer", "t")
		ce := connect.NewError(connect.CodeFailedPrecondition, errors.New("the card was declined"))
		d, _ := connect.NewErrorDetail(&errdetails.ErrorInfo{Reason: "CARD_DECLINED", Domain: "payments.example"})
		ce.AddDetail(d)
		ce.Meta().Set("X-Decline-Code", "51")
		return nil, fmt.Errorf("charge: %w", ce)
	}
	url := r32Mount(t, e.store, fn, nil, nil, nil)
	ctx := context.Background()
	for _, p := range protocols {
		key := "r32-wrapped-" + p.name
		c := client(t, url, procRequired, p, true)
		_, err := c.CallUnary(ctx, keyed(key, "d"))
		first := r32View(t, err)
		require.Equal(t, connect.CodeFailedPrecondition, first.code, p.name)
		_, err = c.CallUnary(ctx, keyed(key, "d"))
		require.Equal(t, first, r32View(t, err), "%s: the replay is the first answer", p.name)
	}
	require.EqualValues(t, len(protocols), runs.Load())
}

// A handler that returns a *connect.Response with a nil message: every
// caller gets the same answer, and the handler runs once.
func TestReview32NilResponseMessage(t *testing.T) {
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
	url := r32Mount(t, e.store, fn, nil, nil, nil)
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
func TestReview32PanicUnderWithRecover(t *testing.T) {
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
	url := r32Mount(t, e.store, fn, nil, nil, []connect.HandlerOption{recoverOpt})
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

// A handler that sets more than MaxStoredMetadata of headers on a keyed
// call: the call fails (nothing can be stored for a replay), its writes
// roll back, its oversized headers are not sent, and the answer is the
// same for a retry.
func TestReview32HugeHeaders(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	var runs atomic.Int64
	big := strings.Repeat("x", idempotency.MaxStoredMetadata+1)
	fn := func(ctx context.Context, req *connect.Request[testingv1.Request]) (*connect.Response[testingv1.Response], error) {
		runs.Add(1)
		resp, err := ledger(ctx, req.Msg)
		if err != nil {
			return nil, err
		}
		info, _ := connect.CallInfoForHandlerContext(ctx)
		info.ResponseHeader().Set("X-Big-Info", big)
		r := connect.NewResponse(resp)
		r.Header().Set("X-Small", "s")
		return r, nil
	}
	url := r32Mount(t, e.store, fn, nil, nil, nil)
	ctx := context.Background()
	for _, p := range protocols {
		c := client(t, url, procRequired, p, true)
		for range 2 {
			_, err := c.CallUnary(ctx, keyed("r32-big-"+p.name, "b"))
			require.Equal(t, connect.CodeInternal, connectCode(err), "%s: %v", p.name, err)
			require.ErrorContains(t, err, "MaxStoredMetadata", p.name)
			var ce *connect.Error
			require.True(t, errors.As(err, &ce))
			require.Empty(t, ce.Meta().Get("X-Big-Info"), p.name)
			require.Empty(t, ce.Meta().Get("X-Small"), p.name)
		}
	}
	require.Equal(t, 0, e.ledgerRows())
}

// An authentication interceptor placed after the idempotency interceptor
// (inside it) that refuses the caller: Unauthenticated, the key released,
// and the corrected call (with credentials) runs.
func TestReview32AuthAfterTheInterceptor(t *testing.T) {
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
	url := r32Mount(t, e.store, r32Ledger(&runs), nil, []connect.Interceptor{auth}, nil)
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

// A final error whose message is not valid UTF-8 (a byte of a legacy
// encoding), with metadata: the first caller and the replay see the same
// code, message and metadata.
func TestReview32FinalErrorWithInvalidUTF8MessageKeepsItsMetadata(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	var runs atomic.Int64
	fn := func(ctx context.Context, req *connect.Request[testingv1.Request]) (*connect.Response[testingv1.Response], error) {
		runs.Add(1)
		ce := connect.NewError(connect.CodeFailedPrecondition, errors.New("card holder M\xfcller declined"))
		d, _ := connect.NewErrorDetail(&errdetails.ErrorInfo{Reason: "CARD_DECLINED", Domain: "payments.example"})
		ce.AddDetail(d)
		ce.Meta().Set("X-Decline-Code", "51")
		return nil, ce
	}
	url := r32Mount(t, e.store, fn, nil, nil, nil)
	ctx := context.Background()
	for _, p := range protocols {
		key := "r32-utf8-" + p.name
		c := client(t, url, procRequired, p, true)
		_, err := c.CallUnary(ctx, keyed(key, "d"))
		first := r32View(t, err)
		require.Equal(t, connect.CodeFailedPrecondition, first.code, p.name)
		_, err = c.CallUnary(ctx, keyed(key, "d"))
		require.Equal(t, first, r32View(t, err), "%s: the replay is the first answer", p.name)
		require.Equal(t, "51", first.meta["x-decline-code"], "%s: the error's metadata", p.name)
		require.Equal(t, []string{"google.rpc.ErrorInfo"}, first.details, "%s: the error's detail", p.name)
	}
	require.EqualValues(t, len(protocols), runs.Load())
}
